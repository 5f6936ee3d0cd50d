"""OpenAI-compatible HTTP server over one :class:`~lorapage.Engine` (aiohttp)."""

from lorapage.server.app import create_app
from lorapage.server.auth import Access
from lorapage.server.tenants import hash_key

__all__ = ["Access", "create_app", "hash_key"]
