"""The version index: the registry's ids, versions, aliases and channels held in memory.

Both front ends keep one over the same SQLite :class:`~lorapage.registry.store.Registry`:
``lorapage serve``'s :class:`~lorapage.registry.catalog.AdapterCatalog` (in front of the adapter
cache) and the fleet ingress's :class:`~lorapage.fleet.registry.FleetRegistry` (mirrored by its
replicas). It answers which version a name (``id``, ``id@N``, ``id@channel``) names, who owns an
id and what a delete would remove, and applies each change *after* its owner committed it to the
registry (commit first, then show), so that what it shows survives a restart. It writes nothing
itself and knows nothing of the cache or of replicas.

Every change it applies counts: :attr:`VersionIndex.generation` grows by one, and
:attr:`VersionIndex.changed` marks the id at that generation when what a mirror copies changed
(owner, alias, versions, pins: a channel move is not mirrored). A change made elsewhere that
readers must see (the fleet's unload of a version) is counted with :meth:`VersionIndex.count`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from lorapage.adapters.names import parse_name, version_key
from lorapage.errors import AdapterNotFoundError, ConflictError
from lorapage.registry.audit import channel_name
from lorapage.registry.store import Registry, VersionRow, removable_keys


@dataclass
class IdVersions:
    """One adapter id as the index holds it. Read it freely; change it only through the index."""

    owner: str | None  # the tenant that first registered it (None: no tenant, or no versions left)
    current: int | None  # the version its alias points at
    versions: dict[int, VersionRow] = field(default_factory=dict)  # in the order they were shown
    channels: dict[str, int] = field(default_factory=dict)  # named channel (id@prod) -> version


class VersionReads(Protocol):
    """What a store's readers ask its index (:attr:`VersionStore.index`): the reads alone; the
    store that owns the index applies every change, after its commit."""

    def row(self, name: str) -> VersionRow | None: ...
    def ids(self) -> list[str]: ...
    def owner(self, adapter_id: str) -> str | None: ...
    def current(self, adapter_id: str) -> int | None: ...
    def serving(self, adapter_id: str) -> int | None: ...
    def versions(self, adapter_id: str) -> list[VersionRow]: ...
    def channels(self, adapter_id: str) -> dict[str, int]: ...
    def removable(self, name: str) -> list[str]: ...
    def check_owner(self, adapter_id: str, owner: str | None) -> None: ...
    def stored(self) -> list[tuple[str, str | None, int | None, list[VersionRow]]]: ...


class VersionIndex:
    """The live view of a registry's ids and versions (see the module's docstring)."""

    def __init__(self, *, generation: int = 0) -> None:
        self.generation = generation  # grows at every change applied (or counted)
        self.changed: dict[str, int] = {}  # id -> generation of its last change a mirror copies
        # (id, version on another base) -> its migration onto the running base: an alias or a
        # channel pointing at the former serves the latter (lorapage serve's; the fleet routes
        # across its bases instead and leaves it empty).
        self.migrations: dict[tuple[str, int], int] = {}
        self._ids: dict[str, IdVersions] = {}

    @classmethod
    def load(cls, registry: Registry, rows: list[VersionRow] | None = None, *, generation: int = 0) -> VersionIndex:
        """The index of what ``registry`` stores (a blocking read); ``rows``: its versions as the
        caller already read them (and perhaps amended), else read here. Every id counts as
        changed at ``generation``."""
        index = cls(generation=generation)
        index._ids = {a.adapter_id: IdVersions(a.owner, a.current) for a in registry.adapters()}
        for row in registry.versions() if rows is None else rows:
            index._ids[row.adapter_id].versions[row.version] = row
        for adapter_id, channel, version in registry.channels():
            index._ids[adapter_id].channels[channel] = version
        index.changed = dict.fromkeys(index._ids, generation)
        return index

    # -- reads ----------------------------------------------------------------------------------

    def require(self, adapter_id: str) -> IdVersions:
        """``adapter_id``'s entry; 404 unless it has versions (a name with a version is no id)."""
        entry = self._ids.get(adapter_id)
        if entry is None or not entry.versions:
            raise AdapterNotFoundError(f"adapter {adapter_id!r} does not exist; name the id, not a version", param="id")
        return entry

    def lookup(self, name: str) -> tuple[VersionRow | None, IdVersions | None]:
        """The version ``name`` (``id``: its current one, ``id@N``, or ``id@channel``: the one the
        channel points at) names, or None, and its id's entry, with or without versions (None
        when the index never had the id). An alias or channel at a version with a migration
        (:attr:`migrations`) names the migration."""
        adapter_id, version = parse_name(name)
        entry = self._ids.get(adapter_id)
        if entry is None:
            return None, None
        channel = channel_name(name) if version == -1 else None
        number = entry.current if version is None else entry.channels.get(channel) if channel else version
        if number is not None and (version is None or channel):
            number = self.migrations.get((adapter_id, number), number)
        return (entry.versions.get(number) if number is not None else None), entry

    def row(self, name: str) -> VersionRow | None:
        """The version ``name`` names (see :meth:`lookup`), or None."""
        return self.lookup(name)[0]

    def version(self, adapter_id: str, version: int | None) -> VersionRow | None:
        """Version ``version`` of ``adapter_id`` exactly (no alias, no channel), or None."""
        entry = self._ids.get(adapter_id)
        return entry.versions.get(version) if entry is not None and version is not None else None

    def existing(self, adapter_id: str, version: int) -> VersionRow:
        """Version ``version`` of ``adapter_id``, which a deploy, rollback or channel names; 404 when none."""
        row = self.version(adapter_id, version)
        if row is None:
            raise AdapterNotFoundError(f"adapter {version_key(adapter_id, version)!r} does not exist", param="version")
        return row

    def find(self, adapter_id: str, match: Callable[[VersionRow], bool]) -> VersionRow | None:
        """The first version of ``adapter_id`` that ``match`` accepts (the same content: no new version)."""
        entry = self._ids.get(adapter_id)
        return next((r for r in entry.versions.values() if match(r)), None) if entry is not None else None

    def ids(self) -> list[str]:
        """The ids with versions, in the order they were first shown."""
        return [i for i, e in self._ids.items() if e.versions]

    def owner(self, adapter_id: str) -> str | None:
        entry = self._ids.get(adapter_id)
        return entry.owner if entry is not None else None

    def current(self, adapter_id: str) -> int | None:
        entry = self._ids.get(adapter_id)
        return entry.current if entry is not None else None

    def serving(self, adapter_id: str) -> int | None:
        """The version ``adapter_id``'s alias serves: its current one, or that one's migration
        (None when that is no version the index holds)."""
        current = self.current(adapter_id)
        serving = self.migrations.get((adapter_id, current or 0), current)
        return serving if self.version(adapter_id, serving) is not None else None

    def versions(self, adapter_id: str) -> list[VersionRow]:
        """``adapter_id``'s versions, oldest first (none for an unknown id)."""
        entry = self._ids.get(adapter_id)
        return sorted(entry.versions.values(), key=lambda r: r.version) if entry is not None else []

    def channels(self, adapter_id: str) -> dict[str, int]:
        """``adapter_id``'s named channels and the versions they point at (a copy; none for an unknown id)."""
        entry = self._ids.get(adapter_id)
        return dict(entry.channels) if entry is not None else {}

    def at(self, adapter_id: str, channel: str) -> int:
        """The version ``adapter_id``'s alias (``channel`` ""), or its named ``channel``, points
        at: where a rollback starts; 404 when it points nowhere (check the id with :meth:`require` first)."""
        entry = self._ids.get(adapter_id)
        at = None if entry is None else entry.channels.get(channel) if channel else entry.current
        if at is None:
            raise AdapterNotFoundError(f"adapter {adapter_id!r} has no channel {channel!r}", param="channel")
        return at

    def check_owner(self, adapter_id: str, owner: str | None) -> None:
        """An id with versions belongs to the tenant that first registered it (409 for another)."""
        entry = self._ids.get(adapter_id)
        if entry is not None and entry.versions and entry.owner != owner:
            raise ConflictError(f"adapter id {adapter_id!r} belongs to another tenant; choose another id", param="id")

    def removable(self, name: str) -> list[str]:
        """The version keys deleting ``name`` removes (see :func:`~lorapage.registry.store.removable_keys`);
        a version a named channel points at is refused (409) as the current one is, while the id has others."""
        entry = self._ids.get(parse_name(name)[0])
        if entry is None:
            return removable_keys(name, (), None)
        return removable_keys(name, entry.versions, entry.current, entry.channels)

    def current_without(self, adapter_id: str, version: int) -> int | None:
        """Where ``adapter_id``'s alias points once ``version`` is deleted: where it did, or the
        newest remaining version if it pointed at that one (None when none remains)."""
        entry = self._ids[adapter_id]
        rest = [v for v in entry.versions if v != version]
        return entry.current if entry.current != version else (max(rest) if rest else None)

    def stored(self) -> list[tuple[str, str | None, int | None, list[VersionRow]]]:
        """Every id with versions: its owner, its alias and its versions' rows (what a mirror copies)."""
        return [(i, e.owner, e.current, list(e.versions.values())) for i, e in self._ids.items() if e.versions]

    # -- changes, each applied after its commit ---------------------------------------------------

    def count(self, adapter_id: str | None = None) -> None:
        """Count a change: the generation grows; ``adapter_id`` (when given) is marked changed at it."""
        self.generation += 1
        if adapter_id is not None:
            self.changed[adapter_id] = self.generation

    def add(self, row: VersionRow, owner: str | None, *, activate: bool) -> IdVersions:
        """Show a new version ``row`` of its id, registered by ``owner`` (the id's owner when it
        had no versions); the alias points at it when ``activate`` or when it pointed nowhere."""
        entry = self._ids.setdefault(row.adapter_id, IdVersions(owner, None))
        if not entry.versions:
            entry.owner = owner
        entry.versions[row.version] = row
        if activate or entry.current is None:
            entry.current = row.version
        self.count(row.adapter_id)
        return entry

    def put(self, row: VersionRow) -> None:
        """Show ``row`` as its version of a known id: a version stored beside the others (a
        migration's) or one whose row changed (its source, its pin)."""
        self._ids[row.adapter_id].versions[row.version] = row
        self.count(row.adapter_id)

    def set_pinned(self, adapter_id: str, version: int, pinned: bool) -> None:
        """Show version ``version`` of ``adapter_id`` pinned (or not)."""
        self.put(dataclasses.replace(self._ids[adapter_id].versions[version], pinned=pinned))

    def set_current(self, adapter_id: str, version: int) -> None:
        """Show ``adapter_id``'s alias at ``version`` (a deploy, a rollback, known content registered again)."""
        self._ids[adapter_id].current = version
        self.count(adapter_id)

    def set_channel(self, adapter_id: str, channel: str, version: int | None) -> None:
        """Show ``adapter_id``'s named ``channel`` at ``version``, or gone (None). Mirrors copy no
        channels, so the id is not marked changed."""
        channels = self._ids[adapter_id].channels
        if version is None:
            del channels[channel]
        else:
            channels[channel] = version
        self.count()

    def remove(self, adapter_id: str, version: int) -> None:
        """Forget version ``version`` of ``adapter_id`` and the channels at it; the alias moves as
        :meth:`current_without` says; an id left with no versions keeps no owner."""
        entry = self._ids[adapter_id]
        new_current = self.current_without(adapter_id, version)
        del entry.versions[version]
        entry.channels = {c: v for c, v in entry.channels.items() if v != version}
        entry.current = new_current
        if not entry.versions:
            entry.owner = None
        self.count(adapter_id)

    def mirror(
        self, adapter_id: str, owner: str | None, current: int | None, rows: list[VersionRow], keep: set[int]
    ) -> None:
        """Make ``adapter_id`` what a registry held elsewhere says: these versions (``keep``: and
        these of its own, still in use), this owner and this alias; an id left with no versions is
        forgotten. Its channels stay as they were (mirrors copy none)."""
        entry = self._ids.setdefault(adapter_id, IdVersions(owner, current))
        wanted = {row.version for row in rows} | keep
        for version in [v for v in entry.versions if v not in wanted]:
            del entry.versions[version]
        for row in rows:
            entry.versions[row.version] = row
        entry.owner, entry.current = owner, current
        if not entry.versions:
            del self._ids[adapter_id]
        self.count(adapter_id)
