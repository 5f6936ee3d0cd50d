"""OpenAI-compatible HTTP server over one :class:`~lorapage.Engine` (aiohttp)."""

from typing import TYPE_CHECKING

from lorapage._exports import lazy

if TYPE_CHECKING:
    from lorapage.server.app import create_app as create_app
    from lorapage.server.auth import Access as Access
    from lorapage.server.tenants import hash_key as hash_key

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "Access": "lorapage.server.auth",
        "create_app": "lorapage.server.app",
        "hash_key": "lorapage.server.tenants",
    },
)
