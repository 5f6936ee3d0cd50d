"""Who calls a route a tenant key may use, with the tenant's request taken first.

Every route a tenant key reaches takes one of that tenant's requests per minute (its ``rpm``, 429
with Retry-After when it has none) before it reads the body, looks anything up or does any work;
the admin key takes none. Generation and tokenizer routes hold their reservation for the whole
request (:meth:`ServerState.admit`); the reading routes (an adapter's record, its check prompts,
``/v1/usage``, a validation's view) and an owner's writes call :func:`admin_or_tenant` here, so
a tenant with ``rpm = 1`` gets one of them a minute, whichever it picks.
"""

from __future__ import annotations

from typing import Protocol

from aiohttp import web

from lorapage.frontend.auth import Access, bearer_key
from lorapage.tenancy.quota import Reservation


class Admits(Protocol):
    """What the helpers need of the front end's state (:class:`~lorapage.frontend.state.ServerState`)."""

    access: Access

    def admit(self, tenant: str) -> Reservation: ...

    def release(self, reservation: Reservation, used_tokens: int = 0) -> None: ...


def tenant_caller(state: Admits, request: web.Request) -> str:
    """The caller's tenant (401 without a valid tenant key), one of its requests taken (429 without)."""
    tenant = state.access.tenant_for(request)
    state.release(state.admit(tenant))
    return tenant


def admin_or_tenant(state: Admits, request: web.Request) -> str | None:
    """None for the admin key; else :func:`tenant_caller`."""
    key = bearer_key(request)
    if key is not None and state.access.tenants.is_admin(key):
        return None
    return tenant_caller(state, request)


def adapter_reader(state: Admits, request: web.Request, name: str) -> bool:
    """:meth:`Access.adapter_reader` (True: the admin), a tenant's request taken first."""
    admin_or_tenant(state, request)
    return state.access.adapter_reader(request, name)
