"""What the admin routes do to adapters: one :class:`Admin` over a :class:`VersionStore` and a
:class:`Deployment`.

The routes (:mod:`lorapage.frontend.admin`, :mod:`lorapage.frontend.audit_route`) check the key, read
and decode the body, apply the rules every side shares and answer; they read the store (ids,
channels, removable versions, the audit trail, the alias history) and the deployment's views
(describe, list, traffic, versions, state) directly. What a change does is the :class:`Admin`'s:
a change of the durable record is the store's (an engine's
:class:`~lorapage.registry.catalog.AdapterCatalog` for ``lorapage serve``, the ingress's
:class:`~lorapage.fleet.registry.FleetRegistry` in a fleet), what happens where versions run is
the deployment's (:class:`lorapage.serve.local_admin.LocalDeployment`: this process's engines,
one per base; :class:`lorapage.fleet.admin.FleetDeployment`: the replicas, fanned out). Every
change is audited as ``actor`` (the admin key's id).
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from typing import Any, Protocol

from aiohttp import web

from lorapage.adapters.names import parse_name
from lorapage.errors import AdapterNotFoundError, LorapageError
from lorapage.frontend.check_prompts import store_check_prompts
from lorapage.frontend.registration import Registration
from lorapage.frontend.responses import AdapterOut, AdapterVersionOut, TrafficOut
from lorapage.registry.audit import AliasMove, AuditEntry, AuditQuery, Choose, rollback_version
from lorapage.registry.drift_state import CheckPrompts, DriftRecord
from lorapage.registry.version_index import VersionReads
from lorapage.sources import AdapterRoots


class Keyed(Protocol):
    """A version as a store's change returns it."""

    @property
    def key(self) -> str: ...  # id@N


class VersionStore(Protocol):
    """The durable record of adapter versions an admin changes: ids, aliases, channels, pins,
    deletion, the audit trail and the drift record. Every change is committed before it shows."""

    @property
    def drift_record(self) -> DriftRecord: ...

    def resolve_version(self, name: str) -> str:
        """The version key ``name`` (``id``, ``id@N``, ``id@channel``) serves now (404, 409)."""
        ...

    @property
    def index(self) -> VersionReads:
        """The live view's reads (ids, aliases, channels, what a delete removes): readers ask it."""
        ...

    def remove(self, name: str, *, actor: str | None = None) -> list[str]: ...

    async def move(
        self, adapter_id: str, to: int | Choose, *, channel: str = "", action: str = "deploy", actor: str | None = None
    ) -> Keyed:
        """Point the alias (or its named ``channel``) at version ``to``, or at the one ``to`` chooses
        from the alias's moves, where it points and the versions servable, all read and moved under
        the store's one lock; committed and audited as ``action``."""
        ...

    async def remove_channel(self, adapter_id: str, channel: str, *, actor: str | None = None) -> None: ...

    async def set_pinned(self, key: str, pinned: bool, *, actor: str | None = None, outcome: str = "ok") -> None: ...

    async def record(
        self, action: str, adapter_id: str | None, *, actor: str | None, after: dict | None = None, outcome: str = "ok"
    ) -> None: ...

    async def audit(self, query: AuditQuery) -> list[AuditEntry]: ...

    async def history(self, adapter_id: str, limit: int | None = None) -> list[AliasMove]: ...


class Deployment(Protocol):
    """Where versions run, and what an admin change does there: ``lorapage serve``'s engines or
    a fleet's replicas. The views the routes answer with are its own."""

    base_name: str  # the primary base's name (what a registration's ``parent`` must name)
    roots: AdapterRoots  # where registration may read adapter directories from
    samples_traffic: bool  # whether check prompts may be sampled from an adapter's traffic here

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

    def internal_state(self) -> dict[str, Any]:
        """``GET /internal/state``'s body."""
        ...

    async def add_version(self, reg: Registration, source: str, actor: str) -> tuple[str, bool]:
        """A version of ``reg.id`` from ``source`` (checked against the roots) fetched and checked
        where it will run, stored: its key and whether it is new."""
        ...

    def key_for(self, name: str, action: str) -> str:
        """The version key ``name`` serves, where ``action`` (pin, load...) reaches it."""
        ...

    def check_removable(self, name: str, keys: list[str]) -> None:
        """Refuse (409) a delete of ``keys`` that what runs here forbids."""
        ...

    async def check_pin(self, key: str) -> None:
        """Refuse (409 ``PinLimitError``) a pin of ``key`` past the bounds; pins nothing."""
        ...

    async def make_resident(self, key: str) -> None:
        """Load ``key`` (where its requests go) and wait until it is resident."""
        ...

    async def drop(self, key: str, actor: str) -> None:
        """Drop ``key`` from the pool(s) where it runs, audited."""
        ...

    def check_prompts_stored(self, stored: CheckPrompts) -> None:
        """What runs here follows an adapter's new check settings (its traffic sampled or not)."""
        ...


class Admin:
    """The admin operations: changes of ``store`` and what they do where ``deployment`` runs versions."""

    def __init__(self, store: VersionStore, deployment: Deployment) -> None:
        self.store, self.deployment = store, deployment

    async def register(self, reg: Registration, source: str, actor: str) -> tuple[str, bool]:
        """A version of ``reg.id`` from ``source``: its key and whether it is new (the same
        content is the same version)."""
        return await self.deployment.add_version(reg, source, actor)

    async def deploy(self, adapter_id: str, version: int, channel: str, actor: str) -> str:
        """Point ``adapter_id`` (or its ``channel``, created on first use) at ``version``; the
        name to describe. Requests in flight finish on the version they started with."""
        moved = await self.store.move(adapter_id, version, channel=channel, action="deploy", actor=actor)
        return f"{adapter_id}@{channel}" if channel else moved.key

    async def rollback(self, adapter_id: str, version: int | None, channel: str, actor: str) -> str:
        """Back to ``version`` or, None, the one the alias (or channel) served before its last
        deploy (:func:`~lorapage.registry.audit.rollback_version`: rolling back again goes one
        deploy further back; 409 when none is left), chosen under the store's lock from the alias
        history and the versions servable there; the name to describe."""
        alias = f"{adapter_id}@{channel}" if channel else adapter_id

        def back(moves: Sequence[AliasMove], at: int, servable: Collection[int]) -> int:
            return rollback_version(moves, at, servable, alias)

        to = back if version is None else version
        moved = await self.store.move(adapter_id, to, channel=channel, action="rollback", actor=actor)
        return alias if channel else moved.key

    def removable(self, name: str) -> list[str]:
        """The versions a delete of ``name`` removes (404 unknown; 409 where it is refused)."""
        keys = self.store.index.removable(name)
        self.deployment.check_removable(name, keys)
        return keys

    async def pin(self, name: str, actor: str) -> str:
        """Pin a version resident: checked against the bounds, committed, and loaded before the
        answer (undone, and the load's error raised, when the load fails); its key."""
        key = self.deployment.key_for(name, "pin")
        await self.deployment.check_pin(key)
        await self.store.set_pinned(key, True, actor=actor)
        try:
            await self.deployment.make_resident(key)
        except LorapageError as exc:
            undone = f"pin undone: its load failed ({exc.code})"
            try:
                await self.store.set_pinned(key, False, actor=actor, outcome=undone)
            except AdapterNotFoundError:  # deleted meanwhile: nothing to undo
                pass
            raise
        return key

    async def unpin(self, name: str, actor: str) -> str:
        """Undo a pin (the version stays resident, evictable again); its key."""
        key = self.deployment.key_for(name, "unpin")
        await self.store.set_pinned(key, False, actor=actor)
        return key

    async def load(self, name: str, actor: str) -> str:
        """Pre-warm a version where its requests go; audited once it is resident. Its key."""
        key = self.deployment.key_for(name, "load")
        await self.deployment.make_resident(key)
        adapter_id, version = parse_name(key)
        await self.store.record("load", adapter_id, actor=actor, after={"version": version})
        return key

    async def unload(self, name: str, actor: str) -> str:
        """Drop a version from the pool(s) (not while it runs, nor if pinned); its key."""
        key = self.deployment.key_for(name, "unload")
        await self.deployment.drop(key, actor)
        return key

    async def store_check_prompts(
        self, adapter_id: str, prompts: Sequence[str] | None, sample: bool | None, opt_out: bool | None, actor: str
    ) -> CheckPrompts:
        """Replace what is given of ``adapter_id``'s check prompts and choices (None: keep it)."""
        stored = await store_check_prompts(self.store.drift_record, adapter_id, prompts, sample, opt_out, actor)
        self.deployment.check_prompts_stored(stored)
        return stored

    async def check_prompts(self, adapter_id: str) -> CheckPrompts:
        """``adapter_id``'s stored check prompts and choices."""
        return await asyncio.to_thread(self.store.drift_record.check_prompts, adapter_id)


ADMIN = web.AppKey("lorapage_admin", Admin)  # the app's admin operations
