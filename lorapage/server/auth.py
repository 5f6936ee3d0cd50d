"""API keys -> tenants, which adapters each tenant may use, and the admin key.

The tenants file (:mod:`lorapage.tenants`) holds only sha256 digests of keys. A tenant may use
the base model, the adapters its ``adapters`` list names (when the list is omitted: every
adapter not registered for another tenant), and the adapters the admin registered for it. Any
other adapter is reported exactly like one that does not exist, so names do not leak across
tenants.
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

from aiohttp import web

from lorapage.server.errors import AuthenticationError, PermissionDeniedError
from lorapage.tenants import TenantConfig, TenantsConfig


def hash_key(key: str) -> str:
    """The sha256 hex digest under which a key is stored in the tenants file."""
    return hashlib.sha256(key.encode()).hexdigest()


def bearer_key(request: web.Request) -> str | None:
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()


class Access:
    """Who may call what. ``owners`` grows and shrinks as the admin registers and removes adapters;
    the tenants file itself is immutable and replaced whole on reload."""

    def __init__(self, tenants: TenantsConfig, owners: dict[str, str] | None = None) -> None:
        self.tenants = tenants
        self.owners: dict[str, str] = dict(owners or {})  # adapter id -> tenant it was registered for

    @classmethod
    def from_file(cls, path: str | Path) -> Access:
        return cls(TenantsConfig.load(path))

    @classmethod
    def demo(cls, adapters: list[str]) -> tuple[Access, str, str]:
        """One ``demo`` tenant owning ``adapters``, with fresh random keys: (access, tenant key, admin key)."""
        tenant_key = f"lp-demo-{secrets.token_urlsafe(24)}"
        admin_key = f"lp-admin-{secrets.token_urlsafe(24)}"
        demo = TenantConfig("demo", key_sha256=(hash_key(tenant_key),), adapters=frozenset(adapters))
        config = TenantsConfig({"demo": demo}, admin_key_sha256=(hash_key(admin_key),))
        return cls(config), tenant_key, admin_key

    def tenant_for(self, request: web.Request) -> str:
        """The tenant a request's bearer key belongs to; 401 without a valid tenant key."""
        key = bearer_key(request)
        if key is None:
            raise AuthenticationError("missing API key: send it as 'Authorization: Bearer <key>'")
        tenant = self.tenants.authenticate(key)
        if tenant is None:
            if self.tenants.is_admin(key):
                raise AuthenticationError("the admin key only opens admin routes; use a tenant key here")
            raise AuthenticationError("incorrect API key provided")
        return tenant

    def require_admin(self, request: web.Request) -> None:
        """401 without a known key, 403 for a tenant key: admin routes take the admin key only."""
        key = bearer_key(request)
        if key is None:
            raise AuthenticationError("missing admin key: send it as 'Authorization: Bearer <key>'")
        if self.tenants.is_admin(key):
            return
        if self.tenants.authenticate(key) is not None:
            raise PermissionDeniedError("this route needs the admin key; a tenant key cannot use it")
        raise AuthenticationError("incorrect API key provided")

    def is_tenant(self, name: str) -> bool:
        return name in self.tenants.tenants

    def may_use(self, tenant: str, adapter: str) -> bool:
        """Registered for this tenant, or named in its ``adapters`` list. A tenant without a list
        may use every adapter that was not registered for some other tenant."""
        owner = self.owners.get(adapter)
        if owner == tenant:
            return True
        config = self.tenants.tenants.get(tenant)
        if config is None:
            return False
        if config.adapters is None:
            return owner is None
        return adapter in config.adapters
