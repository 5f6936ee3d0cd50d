"""What the admin routes do to adapters, as a Protocol both front ends implement.

The routes (:mod:`lorapage.frontend.admin`, :mod:`lorapage.frontend.audit_route`) are one set: they
check the key, read and decode the body, apply the rules every side shares (an id, not a version,
where an id is named; a drained delete; who may read an adapter) and answer. What a change does is
this interface's: :class:`lorapage.serve.local_admin.LocalAdmin` over the engines in this process
(``lorapage serve``), :class:`lorapage.fleet.admin.FleetAdminOps` over the fleet's registry and
its replicas. Every change is audited as ``actor`` (the admin key's id).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, Protocol

from aiohttp import web

from lorapage.frontend.registration import Registration
from lorapage.frontend.responses import AdapterOut, AdapterVersionOut, TrafficOut
from lorapage.registry.audit import AliasMove, AuditEntry, AuditQuery
from lorapage.registry.drift_state import CheckPrompts
from lorapage.sources import AdapterRoots


class AdminOps(Protocol):
    """The adapter operations behind the admin routes."""

    base_name: str  # the primary base's name (what a registration's ``parent`` must name)
    roots: AdapterRoots  # where registration may read adapter directories from
    samples_traffic: bool  # whether check prompts may be sampled from an adapter's traffic here

    def ids(self) -> Collection[str]:
        """The registered adapter ids (with at least one version)."""
        ...

    def listed(self) -> list[str]:
        """The versions ``GET /v1/adapters`` describes (each id's current one, served here)."""
        ...

    async def describe(self, names: Sequence[str]) -> list[AdapterOut]:
        """Each of ``names`` (``id``: its current version, ``id@N``, ``id@channel``) as the admin
        routes show it; 404 (or the 409 of a version on a base not served) for one that is not."""
        ...

    async def traffic(self, out: AdapterOut) -> TrafficOut | None:
        """The described version's recent hourly traffic (None: not kept here)."""
        ...

    def versions(self, adapter_id: str) -> list[AdapterVersionOut]:
        """Every version of ``adapter_id``, servable here or not, oldest first ([]: none)."""
        ...

    async def register(self, reg: Registration, source: str, actor: str) -> tuple[str, bool]:
        """A version of ``reg.id`` from ``source`` (checked against the roots): its key and
        whether it is new (the same content is the same version)."""
        ...

    async def deploy(self, adapter_id: str, version: int, channel: str, actor: str) -> str:
        """Point ``adapter_id`` (or its ``channel``, created on first use) at ``version``; the
        name to describe."""
        ...

    async def rollback(self, adapter_id: str, version: int | None, channel: str, actor: str) -> str:
        """Back to ``version`` or, None, the one the alias (or channel) served before its last
        deploy; the name to describe."""
        ...

    async def remove_channel(self, adapter_id: str, channel: str, actor: str) -> None:
        """Forget a named channel."""
        ...

    def removable(self, name: str) -> list[str]:
        """The versions a delete of ``name`` removes (404 unknown; 409 where it is refused)."""
        ...

    async def remove(self, name: str, actor: str) -> None:
        """Delete ``name``'s versions (AdapterBusyError while an engine still holds requests)."""
        ...

    async def pin(self, name: str, actor: str) -> str:
        """Pin a version resident (loaded before the answer); the name to describe."""
        ...

    async def unpin(self, name: str, actor: str) -> str:
        """Undo a pin; the name to describe."""
        ...

    async def load(self, name: str, actor: str) -> str:
        """Pre-warm a version; the name to describe."""
        ...

    async def unload(self, name: str, actor: str) -> str:
        """Drop a version from the pool(s); the name to describe."""
        ...

    async def store_check_prompts(
        self, adapter_id: str, prompts: Sequence[str] | None, sample: bool | None, opt_out: bool | None, actor: str
    ) -> CheckPrompts:
        """Replace what is given of ``adapter_id``'s check prompts and choices (None: keep it)."""
        ...

    async def check_prompts(self, adapter_id: str) -> CheckPrompts:
        """``adapter_id``'s stored check prompts and choices."""
        ...

    async def audit(self, query: AuditQuery) -> list[AuditEntry]:
        """The audit trail, newest first, filtered."""
        ...

    async def history(self, adapter_id: str, limit: int) -> list[AliasMove]:
        """The id's alias and channel moves, newest first (at most ``limit``)."""
        ...

    def current(self, adapter_id: str) -> int | None:
        """The version the id's alias serves."""
        ...

    def channels(self, adapter_id: str) -> dict[str, int]:
        """The id's named channels and their versions."""
        ...

    def internal_state(self) -> dict[str, Any]:
        """``GET /internal/state``'s body."""
        ...


ADMIN = web.AppKey("lorapage_admin", AdminOps)  # the app's admin operations
