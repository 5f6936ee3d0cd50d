"""The fleet's adapter registry: one SQLite registry at the ingress, mirrored by every replica.

The ingress is the fleet's one writer. It keeps the registry of ``lorapage serve``
(:class:`~lorapage.adapters.registry.Registry`: ids, immutable versions, aliases, owners, pins;
``STATE_DIR/registry.sqlite3`` on the ingress's node) and a live view of it here. Every change is
committed first, then shown, then counted: the view's *generation* grows by one and the id is
marked changed at it. Engine replicas mirror the view (``AdapterCatalog.mirror``): each heartbeat
names the generation a replica has, and the reply carries the ids changed since (every id for a
replica that has none, or that counted in another ingress process: ``epoch``). The ingress
resolves every request to ``id@N`` before it sends it, and a replica that meets a version it does
not know yet syncs before it answers, so a version is servable fleet-wide the moment its
registration is answered.

Every write is audited in the registry's own transaction (:mod:`lorapage.adapters.audit`), as
the admin key's id (``actor``) the admin routes pass; :meth:`record` audits what changes nothing
stored (a pre-warm, an unload, a tenants reload) and :meth:`audit` reads the rows back.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections import deque
from dataclasses import dataclass, field

from lorapage.adapters.audit import OK, AliasMove, AuditEntry, AuditQuery, channel_name, check_channel, rollback_version
from lorapage.adapters.binding import mismatch_message
from lorapage.adapters.catalog import PreparedVersion
from lorapage.adapters.drift_state import MigrationRow
from lorapage.adapters.registry import Registry, VersionRow, parse_name, removable_keys, version_key
from lorapage.errors import AdapterBaseMismatchError, AdapterNotFoundError, ConflictError
from lorapage.fleet.messages import IdState, SyncReply

MAX_UNLOADS = 1024  # admin unloads remembered for replicas that have not synced since


@dataclass
class _Id:
    owner: str | None
    current: int | None
    versions: dict[int, VersionRow] = field(default_factory=dict)
    channels: dict[str, int] = field(default_factory=dict)  # named channels (id@prod) -> version


class FleetRegistry:
    """The live view of the fleet's registry and what each replica needs to catch up. Its
    writes are blocking SQLite commits: the ingress runs them in a worker, one at a time."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.epoch = secrets.token_hex(8)  # this process's count of generations
        self.generation = 1
        self._ids: dict[str, _Id] = {a.adapter_id: _Id(a.owner, a.current) for a in registry.adapters()}
        for row in registry.versions():
            self._ids[row.adapter_id].versions[row.version] = row
        for adapter_id, channel, version in registry.channels():
            self._ids[adapter_id].channels[channel] = version
        self._changed = dict.fromkeys(self._ids, 1)  # id -> generation of its last change
        self._unloads: deque[tuple[int, str]] = deque(maxlen=MAX_UNLOADS)

    # -- reads ----------------------------------------------------------------------------------

    def row(self, name: str) -> VersionRow | None:
        """The version ``name`` (``id``: its current one, ``id@N``, or ``id@channel``: the one the
        channel points at) names. The ingress resolves every request to ``id@N`` before a replica
        sees it, so replicas never need the channels."""
        adapter_id, version = parse_name(name)
        entry = self._ids.get(adapter_id)
        if entry is None:
            return None
        channel = channel_name(name) if version == -1 else None
        number = entry.current if version is None else entry.channels.get(channel) if channel else version
        return entry.versions.get(number) if number is not None else None

    def channels(self, adapter_id: str) -> dict[str, int]:
        entry = self._ids.get(adapter_id)
        return dict(entry.channels) if entry is not None else {}

    def history(self, adapter_id: str, limit: int | None = None) -> list[AliasMove]:
        """``adapter_id``'s alias moves, every channel, newest first (a blocking read: run it in a worker)."""
        return self.registry.alias_history(adapter_id, limit)

    def resolve(self, name: str, base_digest: str) -> str:
        """The version key ``name`` serves now; 404 when none, 409 when it was trained on another
        base than the replicas run (both digests and the migration route)."""
        row = self.row(name)
        if row is None:
            raise AdapterNotFoundError(f"adapter {name!r} does not exist", param="model")
        if row.base_digest != base_digest:
            raise AdapterBaseMismatchError(
                mismatch_message(f"adapter {row.key}", row.base_digest, base_digest, server="fleet"), param="model"
            )
        return row.key

    def ids(self) -> list[str]:
        return [i for i, e in self._ids.items() if e.versions]

    def owner(self, adapter_id: str) -> str | None:
        entry = self._ids.get(adapter_id)
        return entry.owner if entry is not None else None

    def current(self, adapter_id: str) -> int | None:
        entry = self._ids.get(adapter_id)
        return entry.current if entry is not None else None

    def versions(self, adapter_id: str) -> list[VersionRow]:
        entry = self._ids.get(adapter_id)
        return sorted(entry.versions.values(), key=lambda r: r.version) if entry is not None else []

    def removable(self, name: str) -> list[str]:
        entry = self._ids.get(parse_name(name)[0])
        if entry is None:
            return removable_keys(name, (), None)
        return removable_keys(name, entry.versions, entry.current, entry.channels)

    def audit(self, query: AuditQuery) -> list[AuditEntry]:
        """The audit rows ``query`` selects, newest first (a blocking read: run it in a worker)."""
        return self.registry.audit(query)

    # -- writes (each committed, then shown, then counted) --------------------------------------

    def check_owner(self, adapter_id: str, owner: str | None) -> None:
        entry = self._ids.get(adapter_id)
        if entry is not None and entry.versions and entry.owner != owner:
            raise ConflictError(f"adapter id {adapter_id!r} belongs to another tenant; choose another id", param="id")

    def add(
        self, adapter_id: str, owner: str | None, prepared: PreparedVersion, *, activate: bool, actor: str | None = None
    ) -> tuple[VersionRow, bool]:
        """A new version of ``adapter_id`` from ``prepared``, or the version that already has its
        content (made current when ``activate``); and whether it was created."""
        self.check_owner(adapter_id, owner)
        entry = self._ids.get(adapter_id)
        same = next((r for r in entry.versions.values() if r.digest == prepared.digest), None) if entry else None
        if same is not None:
            if activate and entry is not None and entry.current != same.version:
                self.set_current(adapter_id, same.version, action="register", actor=actor)
            return same, False
        row = prepared.store(self.registry, adapter_id, owner, activate=activate, actor=actor)
        entry = self._ids.setdefault(adapter_id, _Id(owner, None))
        if not entry.versions:
            entry.owner = owner
        entry.versions[row.version] = row
        if activate or entry.current is None:
            entry.current = row.version
        self._touch(adapter_id)
        return row, True

    def set_current(
        self, adapter_id: str, version: int, *, action: str = "deploy", actor: str | None = None
    ) -> VersionRow:
        """Point ``adapter_id``'s alias at ``version`` (``action``: deploy, or register for known content)."""
        entry = self._ids.get(adapter_id)
        if entry is None or version not in entry.versions:
            raise AdapterNotFoundError(f"adapter {version_key(adapter_id, version)!r} does not exist", param="version")
        self.registry.set_current(adapter_id, version, action=action, actor=actor)
        entry.current = version
        self._touch(adapter_id)
        return entry.versions[version]

    def set_channel(
        self, adapter_id: str, channel: str, version: int | None, *, action: str = "deploy", actor: str | None = None
    ) -> None:
        """Point ``adapter_id``'s named ``channel`` at ``version`` (created on first use), or forget
        it (None); the id's own alias stays where it is."""
        entry = self._ids.get(adapter_id)
        if entry is None or not entry.versions:
            raise AdapterNotFoundError(f"adapter {adapter_id!r} does not exist; name the id, not a version", param="id")
        check_channel(channel)
        if version is None and channel not in entry.channels:
            raise AdapterNotFoundError(f"adapter {adapter_id!r} has no channel {channel!r}", param="channel")
        if version is not None and version not in entry.versions:
            raise AdapterNotFoundError(f"adapter {version_key(adapter_id, version)!r} does not exist", param="version")
        self.registry.set_channel(adapter_id, channel, version, action=action, actor=actor)
        if version is None:
            del entry.channels[channel]
        else:
            entry.channels[channel] = version
        self.generation += 1  # what /v1/models shows may change; replicas mirror no channels

    def rollback(
        self, adapter_id: str, version: int | None, channel: str, servable: set[int], *, actor: str | None = None
    ) -> VersionRow:
        """Point ``adapter_id`` (or its ``channel``) back at ``version``, or without one at the version
        before its last deploy (:func:`~lorapage.adapters.audit.rollback_target`, over the versions
        in ``servable``: those this fleet's bases run), as ``lorapage serve`` does; 409 when none is left."""
        entry = self._ids.get(adapter_id)
        if entry is None or not entry.versions:
            raise AdapterNotFoundError(f"adapter {adapter_id!r} does not exist; name the id, not a version", param="id")
        check_channel(channel)
        at = entry.channels.get(channel) if channel else entry.current
        if at is None:
            raise AdapterNotFoundError(f"adapter {adapter_id!r} has no channel {channel!r}", param="channel")
        if version is None:
            moves = [m for m in self.registry.alias_history(adapter_id) if m.channel == channel]
            version = rollback_version(moves, at, servable, f"{adapter_id}@{channel}" if channel else adapter_id)
        if channel:
            self.set_channel(adapter_id, channel, version, action="rollback", actor=actor)
            return entry.versions[version]
        return self.set_current(adapter_id, version, action="rollback", actor=actor)

    def set_pinned(self, key: str, pinned: bool, *, actor: str | None = None, outcome: str = OK) -> None:
        """Pin version ``key`` resident on every replica, or unpin it (``outcome``: why, when not ``ok``)."""
        adapter_id, version = parse_name(key)
        entry = self._ids.get(adapter_id)
        if entry is None or version is None or version not in entry.versions:
            raise AdapterNotFoundError(f"adapter {key!r} does not exist", param="id")
        self.registry.set_pinned(adapter_id, version, pinned, actor=actor, outcome=outcome)
        entry.versions[version] = dataclasses.replace(entry.versions[version], pinned=pinned)
        self._touch(adapter_id)

    def remove(self, keys: list[str], *, actor: str | None = None) -> None:
        """Forget versions ``keys`` (from :meth:`removable`); the alias moves to the newest
        remaining version if it pointed at one of them."""
        for key in keys:
            adapter_id, version = parse_name(key)
            entry = self._ids[adapter_id]
            assert version is not None and version in entry.versions, key
            rest = [v for v in entry.versions if v != version]
            new_current = entry.current if entry.current != version else (max(rest) if rest else None)
            self.registry.delete_version(adapter_id, version, new_current, actor=actor)
            del entry.versions[version]
            entry.channels = {c: v for c, v in entry.channels.items() if v != version}  # deleted with it
            entry.current = new_current
            if not entry.versions:
                entry.owner = None
            self._touch(adapter_id)

    def unload(self, key: str, *, actor: str | None = None) -> None:
        """Ask every replica to drop version ``key`` from its pool (an admin's unload), audited."""
        adapter_id, version = parse_name(key)
        self.record("unload", adapter_id, actor=actor, after={"version": version})
        self.generation += 1
        self._unloads.append((self.generation, key))

    def record(
        self, action: str, adapter_id: str | None, *, actor: str | None, after: dict | None = None, outcome: str = OK
    ) -> None:
        """Audit an action that changes nothing stored (``load``, ``unload``, ``tenants_reload``)."""
        tenant = self.owner(adapter_id) if adapter_id is not None else None
        self.registry.record(action, adapter_id, actor=actor, tenant=tenant, after=after, outcome=outcome)

    def migrate(self, state: MigrationRow, *, actor: str | None = None) -> VersionRow:
        """Version ``state.key``, whose drift check passed, stored again bound to ``state.target``
        (:meth:`Registry.migrate_version`: the alias stays, the migration ``migrated``, audited),
        then shown and counted: replicas mirror it, the ingress routes the id to it."""
        row = self.registry.migrate_version(state, actor=actor)
        entry = self._ids[row.adapter_id]
        entry.versions[row.version] = row
        self._touch(row.adapter_id)
        return row

    def _touch(self, adapter_id: str) -> None:
        self.generation += 1
        self._changed[adapter_id] = self.generation

    # -- what a replica needs -------------------------------------------------------------------

    def changes_since(self, epoch: str, generation: int, tenant_weights: dict[str, float]) -> SyncReply:
        """The reply to a replica that has mirrored ``generation`` of ``epoch``."""
        full = epoch != self.epoch or generation <= 0
        since = 0 if full else generation
        changed = [i for i, g in self._changed.items() if g > since]
        states = tuple(self._state(i) for i in changed if not (full and not self._ids[i].versions))
        unloads = () if full else tuple(k for g, k in self._unloads if g > since)
        return SyncReply(self.epoch, self.generation, full, states, unloads, tenant_weights)

    def _state(self, adapter_id: str) -> IdState:
        entry = self._ids[adapter_id]
        return IdState(adapter_id, entry.owner, entry.current, tuple(self.versions(adapter_id)))
