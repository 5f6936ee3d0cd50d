"""API keys -> tenants, which adapters each tenant may use, the admin key and the metrics keys.

The tenants file (:mod:`lorapage.tenancy.tenants`) holds only sha256 digests of keys. Access
fails closed: a tenant may use the base model, the adapters the admin registered for it, and the
adapters without an owner that its ``adapters`` list opens (by name, or all with ``"*"``). An
owner set by the admin always wins over any list. Any other adapter is reported exactly like one
that does not exist, so names do not leak across tenants.

Nor does one tenant's traffic: what a response tells of the engine's caches (where an adapter
was, whether a prompt prefix was cached) reflects only the tenant's own requests, or those of the
tenants its operator put in its ``prefix_cache_group``.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from aiohttp import web

from lorapage.adapters.names import parse_name
from lorapage.errors import AdapterNotFoundError, AuthenticationError, PermissionDeniedError
from lorapage.tenancy.tenants import SHARED, TenantConfig, TenantsConfig, hash_key, key_id


def bearer_key(request: web.Request) -> str | None:
    """The key of ``Authorization: Bearer <key>``; None when there is none; 401 when it is not UTF-8."""
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    key = key.strip()
    try:
        key.encode("utf-8")  # aiohttp keeps bytes that are not UTF-8 as lone surrogates
    except UnicodeEncodeError:
        raise AuthenticationError("the API key in the Authorization header is not valid UTF-8") from None
    return key


class Access:
    """Who may call what. ``owners`` grows and shrinks as the admin registers and removes adapters
    (:meth:`set_owner`, :meth:`drop_owner`); the tenants file itself is immutable and replaced whole
    on reload. ``generation`` grows at each of these changes, so views built from them (a
    tenant's ``/v1/models``) know when they are stale."""

    def __init__(self, tenants: TenantsConfig, owners: dict[str, str] | None = None) -> None:
        self._tenants = tenants
        self._owners: dict[str, str] = dict(owners or {})  # adapter id -> tenant it was registered for
        self.owners: Mapping[str, str] = MappingProxyType(self._owners)
        self.generation = 0

    @property
    def tenants(self) -> TenantsConfig:
        return self._tenants

    @tenants.setter
    def tenants(self, config: TenantsConfig) -> None:
        self._tenants = config
        self.generation += 1

    def set_owner(self, adapter_id: str, tenant: str) -> None:
        """``adapter_id`` was registered for ``tenant``: only that tenant may use it."""
        if self._owners.get(adapter_id) != tenant:
            self._owners[adapter_id] = tenant
            self.generation += 1

    def drop_owner(self, adapter_id: str) -> None:
        """``adapter_id`` is gone (every version deleted)."""
        if self._owners.pop(adapter_id, None) is not None:
            self.generation += 1

    @classmethod
    def from_file(cls, path: str | Path) -> Access:
        return cls(TenantsConfig.load(path))

    @classmethod
    def demo(cls, adapters: list[str]) -> tuple[Access, str, str]:
        """One ``demo`` tenant that may use ``adapters``, with fresh random keys: (access, tenant key, admin key)."""
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
        self._refuse_known(key, "this route needs the admin key")

    def admin_actor(self, request: web.Request) -> str:
        """:meth:`require_admin`, then the key's id (:func:`~lorapage.tenancy.tenants.key_id`),
        which audit rows name as the actor."""
        self.require_admin(request)
        key = bearer_key(request)
        assert key is not None
        return key_id(key)

    def adapter_reader(self, request: web.Request, name: str) -> bool:
        """Who may read one adapter's record (``GET /v1/adapters/{id}``, ``name``: ``id`` or
        ``id@N``, in ``lorapage serve`` and the fleet alike): True for the admin key; False for the
        tenant that owns the id
        (it is not shown where the operator keeps the files); 401 without a valid key; any other
        tenant gets the 404 of an adapter that does not exist: shared adapters included, whose
        traffic is other tenants' too."""
        key = bearer_key(request)
        if key is not None and self.tenants.is_admin(key):
            return True
        if self.owners.get(parse_name(name)[0]) != self.tenant_for(request):  # tenant_for: 401 without a valid key
            raise AdapterNotFoundError(f"adapter {name!r} does not exist", param="model")
        return False

    def require_metrics(self, request: web.Request) -> None:
        """``/metrics`` names every tenant: it takes the admin key or a ``[metrics]`` key."""
        key = bearer_key(request)
        if key is None:
            raise AuthenticationError(
                "/metrics needs a key: send the admin key or a [metrics] key as 'Authorization: Bearer <key>'"
            )
        if self.tenants.may_scrape(key):
            return
        self._refuse_known(key, "/metrics needs the admin key or a [metrics] key")

    def _refuse_known(self, key: str, why: str) -> None:
        """403 for a key the file knows (it is valid, just not here), 401 for any other."""
        if self.tenants.authenticate(key) is not None or self.tenants.may_scrape(key):
            raise PermissionDeniedError(f"{why}; this key cannot use it")
        raise AuthenticationError("incorrect API key provided")

    def is_tenant(self, name: str) -> bool:
        return name in self.tenants.tenants

    def may_use(self, tenant: str, adapter: str) -> bool:
        """An adapter with an owner: only its owner. One without: the tenants whose ``adapters``
        list names it or holds ``"*"``."""
        owner = self.owners.get(adapter)
        if owner is not None:
            return owner == tenant
        config = self.tenants.tenants.get(tenant)
        return config is not None and (adapter in config.adapters or SHARED in config.adapters)

    def sole_user(self, tenant: str, adapter: str) -> bool:
        """Whether ``tenant`` is the only tenant that may use ``adapter`` (its owner, or an adapter
        without an owner that no other tenant's list opens): only then may it see where the
        adapter is (``x-adapter-tier``), which would otherwise tell it of another tenant's use."""
        owner = self.owners.get(adapter)
        if owner is not None:
            return owner == tenant
        return self.may_use(tenant, adapter) and not self.tenants.others_may_use_unowned(tenant, adapter)

    def default_max_tokens(self, tenant: str) -> int | None:
        """What a request of ``tenant`` without max_tokens reserves from its TPM up front (None:
        the whole budget, for a tenant the tenants file does not name)."""
        config = self.tenants.tenants.get(tenant)
        return config.default_max_tokens if config is not None else None

    def prefix_group(self, tenant: str) -> str | None:
        """The group whose tenants share ``tenant``'s cached prompt prefixes (None: only its own)."""
        config = self.tenants.tenants.get(tenant)
        return config.prefix_cache_group if config is not None else None
