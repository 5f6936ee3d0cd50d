"""The fleet's adapter registry: one SQLite registry at the ingress, mirrored by every replica.

The ingress is the fleet's one writer. It keeps the registry of ``lorapage serve``
(:class:`~lorapage.registry.store.Registry`: ids, immutable versions, aliases, owners, pins;
``STATE_DIR/registry.sqlite3`` on the ingress's node) and a live view of it here. Every change is
committed first, then shown, then counted: the view's *generation* grows by one and the id is
marked changed at it. Engine replicas mirror the view (``AdapterCatalog.mirror``): each heartbeat
names the generation a replica has, and the reply carries the ids changed since (every id for a
replica that has none, or that counted in another ingress process: ``epoch``). The ingress
resolves every request to ``id@N`` before it sends it, and a replica that meets a version it does
not know yet syncs before it answers, so a version is servable fleet-wide the moment its
registration is answered. The view is ``lorapage serve``'s own
(:class:`~lorapage.registry.version_index.VersionIndex`), which counts the generations.

Every write is audited in the registry's own transaction (:mod:`lorapage.registry.audit`), as
the admin key's id (``actor``) the admin routes pass; :meth:`record` audits what changes nothing
stored (a pre-warm, an unload, a tenants reload) and :meth:`audit` reads the rows back.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from lorapage.adapters.binding import mismatch_message
from lorapage.adapters.names import parse_name
from lorapage.errors import AdapterBaseMismatchError, AdapterNotFoundError
from lorapage.fleet.messages import IdState, SyncReply
from lorapage.registry.audit import OK, AliasMove, AuditEntry, AuditQuery, Choose, check_channel
from lorapage.registry.drift_state import DriftRecord, MigrationRow
from lorapage.registry.prepare import PreparedVersion
from lorapage.registry.store import Registry, VersionRow
from lorapage.registry.version_index import VersionIndex, VersionReads

T = TypeVar("T")
MAX_UNLOADS = 1024  # admin unloads remembered for replicas that have not synced since


class FleetRegistry:
    """The live view of the fleet's registry and what each replica needs to catch up. Its
    writes are blocking SQLite commits: the ingress runs them in a worker, one at a time."""

    def __init__(self, registry: Registry, *, base_digest: str = "") -> None:
        """``base_digest``: the primary base's, which the replicas run (a version on another is refused)."""
        self.registry = registry
        self.base_digest = base_digest
        self.drift_record: DriftRecord = registry
        """Check prompts and base-migration states (blocking: use it in a worker)."""
        self.epoch = secrets.token_hex(8)  # this process's count of generations
        # Generation 1: every id as loaded (a replica that has 0 has nothing).
        self._index = VersionIndex.load(registry, generation=1)
        self._unloads: deque[tuple[int, str]] = deque(maxlen=MAX_UNLOADS)
        self._writes = asyncio.Lock()  # one registry change at a time, each committed in a worker

    async def write(self, change: Callable[[], T]) -> T:
        """Run ``change`` (a blocking registry commit) in a worker, one change at a time."""
        async with self._writes:
            return await asyncio.to_thread(change)

    @property
    def generation(self) -> int:
        """Grows at every change replicas or ``/v1/models`` may need to see."""
        return self._index.generation

    @property
    def index(self) -> VersionReads:
        """The live view's reads (ids, owners, aliases, versions, channels, what a delete
        removes). The ingress resolves every request to ``id@N`` (``index.row``) before a replica
        sees it, so replicas never need the channels."""
        return self._index

    # -- reads ----------------------------------------------------------------------------------

    async def history(self, adapter_id: str, limit: int | None = None) -> list[AliasMove]:
        """``adapter_id``'s alias moves, every channel, newest first (read in a worker)."""
        return await asyncio.to_thread(self.registry.alias_history, adapter_id, limit)

    def resolve_version(self, name: str) -> str:
        """The version key ``name`` serves now; 404 when none, 409 when it was trained on another
        base than the replicas run (:attr:`base_digest`; both digests and the migration route)."""
        row = self._index.row(name)
        if row is None:
            raise AdapterNotFoundError(f"adapter {name!r} does not exist", param="model")
        if row.base_digest != self.base_digest:
            raise AdapterBaseMismatchError(
                mismatch_message(f"adapter {row.key}", row.base_digest, self.base_digest, server="fleet"),
                param="model",
            )
        return row.key

    async def audit(self, query: AuditQuery) -> list[AuditEntry]:
        """The audit rows ``query`` selects, newest first (read in a worker)."""
        return await asyncio.to_thread(self.registry.audit, query)

    # -- writes (each committed, then shown, then counted) --------------------------------------

    def add(
        self, adapter_id: str, owner: str | None, prepared: PreparedVersion, *, activate: bool, actor: str | None = None
    ) -> tuple[VersionRow, bool]:
        """A new version of ``adapter_id`` from ``prepared``, or the version that already has its
        content (made current when ``activate``); and whether it was created."""
        self._index.check_owner(adapter_id, owner)
        same = self._index.find(adapter_id, lambda r: r.digest == prepared.digest)
        if same is not None:
            if activate and self._index.current(adapter_id) != same.version:
                self.set_current(adapter_id, same.version, action="register", actor=actor)
            return same, False
        row = prepared.store(self.registry, adapter_id, owner, activate=activate, actor=actor)
        self._index.add(row, owner, activate=activate)
        return row, True

    def set_current(
        self, adapter_id: str, version: int, *, action: str = "deploy", actor: str | None = None
    ) -> VersionRow:
        """Point ``adapter_id``'s alias at ``version`` (``action``: deploy, or register for known content)."""
        row = self._index.existing(adapter_id, version)
        self.registry.set_current(adapter_id, version, action=action, actor=actor)
        self._index.set_current(adapter_id, version)
        return row

    def set_channel(
        self, adapter_id: str, channel: str, version: int | None, *, action: str = "deploy", actor: str | None = None
    ) -> None:
        """Point ``adapter_id``'s named ``channel`` at ``version`` (created on first use), or forget
        it (None); the id's own alias stays where it is."""
        entry = self._index.require(adapter_id)
        check_channel(channel)
        if version is None and channel not in entry.channels:
            raise AdapterNotFoundError(f"adapter {adapter_id!r} has no channel {channel!r}", param="channel")
        if version is not None:
            self._index.existing(adapter_id, version)
        self.registry.set_channel(adapter_id, channel, version, action=action, actor=actor)
        self._index.set_channel(adapter_id, channel, version)  # counted: what /v1/models shows may change

    async def move(
        self,
        adapter_id: str,
        to: int | Choose,
        *,
        channel: str = "",
        action: str = "deploy",
        actor: str | None = None,
    ) -> VersionRow:
        """Point ``adapter_id`` (or its named ``channel``) at version ``to``, or at the one ``to``
        chooses (a rollback's) from the alias's moves, where it points and the versions on
        :attr:`base_digest`, read and moved in one write; fleet-wide at once (the ingress resolves
        every request's version), as ``lorapage serve`` does. 409 for a version on a base the
        replicas do not run."""
        if isinstance(to, int) and (row := self._index.row(f"{adapter_id}@{to}")) is not None:
            self.resolve_version(row.key)  # a version on another base: 409 before the alias (or channel) moves
        servable = {row.version for row in self._index.versions(adapter_id) if row.base_digest == self.base_digest}
        return await self.write(lambda: self._move(adapter_id, to, channel, servable, action, actor))

    def _move(
        self, adapter_id: str, to: int | Choose, channel: str, servable: set[int], action: str, actor: str | None
    ) -> VersionRow:
        self._index.require(adapter_id)
        check_channel(channel)
        if isinstance(to, int):
            version = to
        else:
            moves = [m for m in self.registry.alias_history(adapter_id) if m.channel == channel]
            version = to(moves, self._index.at(adapter_id, channel), servable)
        if channel:
            self.set_channel(adapter_id, channel, version, action=action, actor=actor)
            return self._index.existing(adapter_id, version)
        return self.set_current(adapter_id, version, action=action, actor=actor)

    async def remove_channel(self, adapter_id: str, channel: str, *, actor: str | None = None) -> None:
        """Forget ``adapter_id``'s named ``channel``."""
        await self.write(lambda: self.set_channel(adapter_id, channel, None, action="channel", actor=actor))

    async def set_pinned(self, key: str, pinned: bool, *, actor: str | None = None, outcome: str = OK) -> None:
        """Pin version ``key`` resident on every replica, or unpin it (``outcome``: why, when not ``ok``)."""
        adapter_id, version = parse_name(key)
        row = self._index.version(adapter_id, version)
        if row is None:
            raise AdapterNotFoundError(f"adapter {key!r} does not exist", param="id")
        await self.write(
            lambda: self.registry.set_pinned(adapter_id, row.version, pinned, actor=actor, outcome=outcome)
        )
        self._index.set_pinned(adapter_id, row.version, pinned)

    def remove(self, name: str, *, actor: str | None = None) -> list[str]:
        """Forget the versions deleting ``name`` removes (:meth:`removable`), dropped from every
        replica once their requests end; the alias moves to the newest remaining version if it
        pointed at one of them. Returns their keys."""
        keys = self._index.removable(name)
        for key in keys:
            adapter_id, version = parse_name(key)
            assert version is not None and self._index.version(adapter_id, version) is not None, key
            self.registry.delete_version(
                adapter_id, version, self._index.current_without(adapter_id, version), actor=actor
            )
            self._index.remove(adapter_id, version)  # its channels are deleted with it
        return keys

    def drop(self, key: str, *, actor: str | None = None) -> None:
        """Ask every replica to drop version ``key`` from its pool (an admin's unload), audited."""
        adapter_id, version = parse_name(key)
        self.note("unload", adapter_id, actor=actor, after={"version": version})
        self._index.count()
        self._unloads.append((self.generation, key))

    async def record(
        self, action: str, adapter_id: str | None, *, actor: str | None, after: dict | None = None, outcome: str = OK
    ) -> None:
        """:meth:`note`, committed in a worker in turn with the other changes."""
        await self.write(lambda: self.note(action, adapter_id, actor=actor, after=after, outcome=outcome))

    def note(
        self, action: str, adapter_id: str | None, *, actor: str | None, after: dict | None = None, outcome: str = OK
    ) -> None:
        """Audit an action that changes nothing stored (``load``, ``unload``, ``tenants_reload``; blocking)."""
        tenant = self._index.owner(adapter_id) if adapter_id is not None else None
        self.registry.record(action, adapter_id, actor=actor, tenant=tenant, after=after, outcome=outcome)

    def migrate(self, state: MigrationRow, *, actor: str | None = None) -> VersionRow:
        """Version ``state.key``, whose drift check passed, stored again bound to ``state.target``
        (:meth:`Registry.migrate_version`: the alias stays, the migration ``migrated``, audited),
        then shown and counted: replicas mirror it, the ingress routes the id to it."""
        row = self.registry.migrate_version(state, actor=actor)
        self._index.put(row)
        return row

    # -- what a replica needs -------------------------------------------------------------------

    def changes_since(self, epoch: str, generation: int, tenant_weights: dict[str, float]) -> SyncReply:
        """The reply to a replica that has mirrored ``generation`` of ``epoch``."""
        full = epoch != self.epoch or generation <= 0
        since = 0 if full else generation
        changed = [i for i, g in self._index.changed.items() if g > since]
        states = tuple(self._state(i) for i in changed if not (full and not self._index.versions(i)))
        unloads = () if full else tuple(k for g, k in self._unloads if g > since)
        return SyncReply(self.epoch, self.generation, full, states, unloads, tenant_weights)

    def _state(self, adapter_id: str) -> IdState:
        i, index = adapter_id, self._index
        return IdState(i, index.owner(i), index.current(i), tuple(index.versions(i)))
