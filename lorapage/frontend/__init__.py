"""The one HTTP front end (aiohttp), of ``lorapage serve`` and of the fleet's ingress alike:
OpenAI- and vLLM-compatible routes, admin routes, wire formats, auth, tenants, quotas, SLOs,
metrics and SSE, over a :class:`~lorapage.frontend.backend.Backend` (where requests go)."""

from typing import TYPE_CHECKING

from lorapage._exports import lazy

if TYPE_CHECKING:
    from lorapage.frontend.app import build_app as build_app
    from lorapage.frontend.auth import Access as Access
    from lorapage.tenancy.tenants import hash_key as hash_key

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "Access": "lorapage.frontend.auth",
        "build_app": "lorapage.frontend.app",
        "hash_key": "lorapage.tenancy.tenants",
    },
)
