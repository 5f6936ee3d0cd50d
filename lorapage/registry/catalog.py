"""An engine's adapter catalog: ids, versions, aliases, channels, pins, check prompts and
migration states, over the SQLite registry it alone holds (``engine.admin.catalog``).

A registration of new content under an id makes an immutable version ``id@N`` in one path:
prepare (fetch the files from a source an owner may read), check (read them whole against this
engine: :mod:`lorapage.registry.prepare`), store (commit to the registry, in a worker thread) and
announce (show it in the live view and give it its cache entry). The id itself is an alias for one
version (the current), re-pointed atomically by a move (:meth:`AdapterCatalog.move`: a deploy, or
a rollback the admin chose). A request names ``id``, ``id@N`` or ``id@channel`` (a named
channel, e.g. ``prod``: a second alias a deploy moves on its own; a lowercase letter first, so it
never reads as a version) and is resolved to one version when it is submitted
(:meth:`AdapterCatalog.resolve_version`): it runs on that version to its end, whatever the
aliases do meanwhile. The adapter cache serves each version under its key ``id@N``
and knows nothing of aliases.

Every change is committed to the :class:`~lorapage.registry.store.Registry` before the live
view shows it, so what a caller was told exists survives a restart; the same transaction appends
its audit row, as the ``actor`` the caller names (a key id over HTTP), and each alias move to the
alias history a rollback walks back (:mod:`lorapage.registry.audit`). Each version records the
digest of the base it was trained on, which registration requires to be the running one
(:mod:`lorapage.adapters.binding`); on a restart over another base those versions are kept but
refused (:class:`~lorapage.errors.AdapterBaseMismatchError`), unless a base migration
(:mod:`lorapage.registry.drift_state`) stored a version of the same content bound to the running
base: the id's alias and channels, pointing at the old version, then serve that one.

A pin is decided here and committed; the residency applies it. A restart marks the pinned
versions pinned as it restores them (their loads start when the engine's step loop first binds to
an event loop); a pin that no longer fits is logged, not applied, and kept for a later start.
Errors are :class:`~lorapage.errors.LorapageError` (404 unknown, 409 busy or refused, 400 bad input).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from lorapage.adapters.binding import mismatch_message
from lorapage.adapters.cache import AdapterCache
from lorapage.adapters.loader import Origin
from lorapage.adapters.names import parse_name, version_key
from lorapage.errors import AdapterBaseMismatchError, AdapterFormatError, AdapterNotFoundError, PinLimitError
from lorapage.registry.audit import AliasMove, AuditEntry, AuditQuery, Choose, check_channel
from lorapage.registry.drift_state import MIGRATED, DriftRecord, MigrationRow
from lorapage.registry.prepare import (
    REGISTRATION_TIMEOUT_S,
    Checked,
    PreparedVersion,
    VersionPreparer,
    spec_from_json,
    spec_to_json,
)
from lorapage.registry.store import Registry, VersionRow
from lorapage.registry.version_index import VersionIndex, VersionReads

log = logging.getLogger("lorapage.adapters")
T = TypeVar("T")

# Opens a stored version's files: (source, digest, owner) -> its directory, checked as it is read.
Locate = Callable[[str, str, str | None], AbstractAsyncContextManager[Path]]


@dataclass(frozen=True)
class VersionInfo:
    """One version as callers see it (admin routes, ``engine.admin.versions``)."""

    adapter_id: str
    version: int
    key: str  # id@N: what the adapter cache and every request run on
    digest: str
    source: str
    base_digest: str
    created: float
    current: bool
    servable: bool  # False: trained on another base than the one running
    projected_cost_pct: float | None = None  # as stored (lorapage.adapters.cost); None: on another base, never costed


class AdapterCatalog:
    """An engine's adapter versions, aliases, channels and pins, managed by name (``id``,
    ``id@N`` or ``id@channel``): a live view (:class:`~lorapage.registry.version_index.VersionIndex`)
    in front of the cache's entries, written through to the registry it alone holds."""

    def __init__(
        self,
        cache: AdapterCache,
        registry: Registry,
        preparer: VersionPreparer,
        *,
        base_digest: Callable[[], str],
        io_executor: Executor,
        locate: Locate,
        check_open: Callable[[], None],
    ) -> None:
        """``base_digest``: the running base's (computed when first needed); ``locate`` opens a
        stored version's files (checked), ``check_open`` refuses once the engine is closed."""
        self._cache, self._registry = cache, registry
        self.preparer = preparer
        """The first two steps of a registration (fetch, check); ``preparer.prepare`` makes a
        version a registry held elsewhere (a fleet's, or another base's engine's) stores."""
        self._base_digest, self._io, self._locate = base_digest, io_executor, locate
        self._check_open = check_open
        self.roots = preparer.roots
        """The directories each owner's versions may be read from."""
        self.drift_record: DriftRecord = registry
        """Check prompts, sampled prompts and base-migration states (blocking: use it in a worker)."""
        self._unfit: dict[str, AdapterFormatError] = {}  # restored versions this configuration cannot serve
        self._lock = asyncio.Lock()  # one registration or alias change of the live view at a time
        # Refuses a version too far behind its id's current (a pushed id's staleness bound: 409).
        self.freshness: Callable[[VersionRow], None] = lambda row: None
        self._index = self._restore()

    @property
    def generation(self) -> int:
        """Grows at every change of the live view (ids, versions, aliases, channels, owners, pins):
        what a view of them (``/v1/models``) is cached under."""
        return self._index.generation

    @property
    def index(self) -> VersionReads:
        """The live view's reads: ids, owners, aliases (``serving``: on a new base, the migration
        of the version the alias points at), versions, channels, what a delete removes (404 when
        unknown, 409 for a version the alias or a named channel serves while the id has others),
        and every id as stored (what an engine serving another base beside this one mirrors)."""
        return self._index

    # -- restart --------------------------------------------------------------------------------

    def _restore(self) -> VersionIndex:
        """Rebuild the live view and the cache's entries from the registry, reading no weights."""
        rows = self._registry.versions()
        base = self._base_digest() if rows else ""
        rows = _costed(rows, base, self._cache, self._registry)
        index = VersionIndex.load(self._registry, rows)
        for row in rows:
            self._serve_stored(row, base, index.owner(row.adapter_id))
        if rows:  # an alias at a version of another base serves its migration onto this one
            index.migrations = {
                (m.adapter_id, m.version): m.new_version
                for m in self._registry.migration_states(target=base)
                if m.state == MIGRATED and m.new_version is not None
            }
        # The pinned versions, oldest registration first while the bounds allow (entries exist by now).
        for row in sorted((r for r in rows if r.pinned and r.key in self._cache.entries), key=lambda r: r.created):
            self._apply_pin(row.key, True, "on this start")
        return index

    def _serve_stored(self, row: VersionRow, base: str, owner: str | None) -> None:
        """Give a stored version its cache entry (reading no weights), unless it was validated
        against another base (kept, and refused by :meth:`resolve_version`) or this configuration
        cannot serve it: its pool, its max_lora_rank or its shared envelope (never shared
        silently: refused with the envelope's 400)."""
        if row.base_digest != base:
            return
        spec = spec_from_json(row.spec, self._cache.checks.model)
        try:
            self._cache.checks.check_envelope(spec)
            self._cache.add(row.key, spec, self._cache.checks.plan(spec), row.digest, Origin(row.source, owner))
        except AdapterFormatError as exc:
            self._unfit[row.key] = exc

    # -- names and views ------------------------------------------------------------------------

    def resolve_version(self, name: str) -> str:
        """The version key ``name`` (``id``, ``id@N`` or ``id@channel``) serves now; 404 when
        there is none, 409 when the version was trained on another base (both digests and the
        migration route)."""
        row = self.row(name)
        self.freshness(row)
        if row.key in self._unfit:
            raise self._unfit[row.key]
        if row.key not in self._cache.entries:
            raise AdapterBaseMismatchError(
                mismatch_message(f"adapter {row.key}", row.base_digest, self._base_digest()), param="model"
            )
        return row.key

    def row(self, name: str) -> VersionRow:
        """The stored version ``name`` names, on this base or another (404 when there is none):
        where a front end serving several bases routes it."""
        row = self._index.row(name)
        if row is None:
            raise AdapterNotFoundError(f"adapter {name!r} does not exist", param="model")
        return row

    def version(self, name: str) -> VersionInfo:
        """The version ``name`` names, described (one on another base is described, not refused)."""
        return self._info(self.row(name))

    def owners(self) -> dict[str, str]:
        """The owner of each id that has one (registered with it; restored after a restart)."""
        return {i: owner for i in self._index.ids() if (owner := self._index.owner(i)) is not None}

    def versions(self, adapter_id: str | None = None) -> list[VersionInfo]:
        """Every version (of ``adapter_id``, or of all ids), servable here or not."""
        chosen = [adapter_id] if adapter_id is not None else self._index.ids()
        return [self._info(row) for i in chosen for row in self._index.versions(i)]

    def _info(self, row: VersionRow) -> VersionInfo:
        return VersionInfo(
            adapter_id=row.adapter_id,
            version=row.version,
            key=row.key,
            digest=row.digest,
            source=row.source,
            base_digest=row.base_digest,
            created=row.created,
            # On a new base, the alias serves the migration of the version it points at.
            current=self._index.serving(row.adapter_id) == row.version,
            servable=row.key in self._cache.entries,
            projected_cost_pct=row.projected_cost_pct,
        )

    def has_version(self, key: str) -> bool:
        """Whether version ``key`` (``id@N``) is served by this engine (a mirror may lack it yet)."""
        return key in self._cache.entries

    def current_costs(self) -> dict[str, float]:
        """Each id's current version's projected cost, for those this engine serves (metrics)."""
        out = {}
        for adapter_id in self._index.ids():
            row = self._index.version(adapter_id, self._index.current(adapter_id))
            if row is not None and row.projected_cost_pct is not None and row.key in self._cache.entries:
                out[adapter_id] = row.projected_cost_pct
        return out

    # -- registration: prepare -> check -> store -> announce ------------------------------------

    async def register(
        self,
        name: str,
        source: str | Path,
        *,
        owner: str | None = None,
        sha256: str | None = None,
        expected_base_digest: str | None = None,
        activate: bool = True,
        timeout_s: float = REGISTRATION_TIMEOUT_S,
        actor: str | None = None,
        envelope: bool = True,
    ) -> tuple[VersionInfo, bool]:
        """A new version of ``name`` from a directory or a source URI (``file://``, ``https://``,
        ``s3://``, ``hf://``): fetched and verified against ``sha256`` when given, read and checked
        in a worker thread (refused past ``timeout_s``), and committed (audited as ``actor``'s)
        before this returns; the alias then points at it when ``activate``. It must have been
        trained on this base: ``expected_base_digest`` when given, else its
        ``base_model_name_or_path`` says so (:mod:`lorapage.adapters.binding`). Content equal to an
        existing version of ``name`` returns that version (``created`` False). ``envelope`` False:
        one outside the shared envelope is stored too (tier ``dedicated``: its requests here are
        refused with the envelope's 400; ``lorapage serve``'s dedicated tier serves it merged)."""
        self._check_open()
        async with self.preparer.fetched(source, sha256, owner) as (uri, path):
            self._index.check_owner(name, owner)
            checked = await self.preparer.check_in_worker(
                name, path, sha256=sha256, expected_base_digest=expected_base_digest, timeout_s=timeout_s,
                envelope=envelope,
            )  # fmt: skip
            return await self._store(name, checked, uri, owner=owner, activate=activate, actor=actor)

    async def register_checked(
        self, name: str, path: Path, *, expected_base_digest: str | None, owner: str | None = None,
        activate: bool = True, actor: str | None = None,
    ) -> VersionInfo:  # fmt: skip
        """Register the files of a version the caller opened and verified already (a stored
        version's, :meth:`version_files`; a pushed version's, :mod:`lorapage.registry.push`), as
        trained on this base (``expected_base_digest``, which must be its digest; None: its
        metadata says): no source is parsed and no root applies. What a base upgrade's check
        does on an engine already serving the new base (:meth:`remove` it afterwards)."""
        self._check_open()
        checked = await self.preparer.check_in_worker(name, path, expected_base_digest=expected_base_digest)
        source = path.resolve().as_uri()
        version, _ = await self._store(name, checked, source, owner=owner, activate=activate, actor=actor)
        return version

    def add(
        self,
        name: str,
        path: str | Path,
        *,
        owner: str | None = None,
        expected_base_digest: str | None = None,
        checked: Checked | None = None,
    ) -> VersionInfo:
        """:meth:`register` of a directory in the calling thread (scripts with no event loop
        running). ``checked``: what ``preparer.check`` read of that directory already (many ids
        over one directory, benchmarks of thousands of adapters, read it once)."""
        path = Path(path)
        self.roots.check(path, owner)
        self._index.check_owner(name, owner)
        checked = checked or self.preparer.check(path, expected_base_digest=expected_base_digest)
        source = path.resolve().as_uri()
        same = self._index.find(name, lambda r: r.digest == checked.digest and r.key in self._cache.entries)
        row, created = self._write(name, checked, source, same, owner, True, None)
        return self._announce(row, created, checked, source, owner, True)

    async def _store(
        self, name: str, checked: Checked, source: str, *, owner: str | None, activate: bool, actor: str | None
    ) -> tuple[VersionInfo, bool]:
        """Store (committed in a worker) and announce a checked version, one registration at a time."""
        async with self._lock:
            self._index.check_owner(name, owner)  # again: another registration may have taken the id
            same = self._index.find(name, lambda r: r.digest == checked.digest and r.key in self._cache.entries)
            row, created = await _blocking(
                self._io, lambda: self._write(name, checked, source, same, owner, activate, actor)
            )
            return self._announce(row, created, checked, source, owner, activate), created

    def _write(
        self,
        adapter_id: str,
        checked: Checked,
        source: str,
        same: VersionRow | None,
        owner: str | None,
        activate: bool,
        actor: str | None,
    ) -> tuple[VersionRow, bool]:
        """The commits of a registration (blocking): a new version, or ``same`` (the version with
        its content) read from ``source`` from now on and made current when ``activate``."""
        if same is None:
            spec = checked.spec
            row = self._registry.add_version(
                adapter_id,
                owner,
                digest=checked.digest,
                source=source,
                base_digest=self._base_digest(),
                spec=spec_to_json(spec),
                activate=activate,
                projected_cost_pct=self._cache.checks.cost_of(spec).projected_cost_pct,
                actor=actor,
            )
            return row, True
        if same.source != source:
            self._registry.set_source(same.adapter_id, same.version, source, actor=actor)
        if activate and self._index.current(adapter_id) != same.version:
            self._registry.set_current(adapter_id, same.version, action="register", actor=actor)
        return same, False

    def _announce(
        self, row: VersionRow, created: bool, checked: Checked, source: str, owner: str | None, activate: bool
    ) -> VersionInfo:
        """Show a stored registration in the live view, and a new version in the cache."""
        if created:
            entry = self._index.add(row, owner, activate=activate)
            try:
                self._cache.checks.check_envelope(checked.spec)
            except AdapterFormatError as exc:  # registered for the dedicated tier (envelope False): refused here
                self._unfit[row.key] = exc
                return self._info(row)
            self._cache.add(row.key, checked.spec, checked.layout, row.digest, Origin(row.source, entry.owner))
            return self._info(row)
        if row.source != source:  # the files moved, or their old place is gone: later loads read from here
            self._cache.set_source(row.key, source)
            row = dataclasses.replace(row, source=source)
            self._index.put(row)
        if activate and self._index.current(row.adapter_id) != row.version:
            self._index.set_current(row.adapter_id, row.version)
        return self._info(row)

    async def add_prepared(
        self, name: str, prepared: PreparedVersion, *, owner: str | None = None, activate: bool = True,
        actor: str | None = None,
    ) -> tuple[VersionInfo, bool]:  # fmt: skip
        """Store (audited as ``actor``'s) a version of ``name`` an engine on another base prepared
        (:meth:`prepare`), bound to that base: listed here, served by that engine. Content already
        stored on that base makes no new version (it is made current when ``activate``). Returns
        the version and whether it was created."""
        self._check_open()
        self._index.check_owner(name, owner)
        async with self._lock:
            self._index.check_owner(name, owner)
            same = self._index.find(
                name, lambda r: r.digest == prepared.digest and r.base_digest == prepared.base_digest
            )
            if same is None:
                row = await _blocking(
                    self._io, lambda: prepared.store(self._registry, name, owner, activate=activate, actor=actor)
                )
                self._index.add(row, owner, activate=activate)
                return self._info(row), True
            if activate and self._index.current(name) != same.version:
                await _blocking(
                    self._io, lambda: self._registry.set_current(name, same.version, action="register", actor=actor)
                )
                self._index.set_current(name, same.version)
            return self._info(same), False

    @asynccontextmanager
    async def version_files(self, name: str) -> AsyncIterator[Path]:
        """The files of the version ``name`` names (``id@N``), from its stored source, as a load
        reads them (a base upgrade's check registers them on the candidate base)."""
        row = self.row(name)
        async with self._locate(row.source, row.digest, self._index.owner(row.adapter_id)) as path:
            yield path

    # -- a registry held elsewhere ---------------------------------------------------------------

    def mirror(self, adapter_id: str, owner: str | None, current: int | None, rows: list[VersionRow]) -> list[str]:
        """Make ``adapter_id``'s live view what a registry held elsewhere (the fleet's, or the
        primary engine's) says: these versions (none: the id is gone), this alias and these pins.
        Writes nothing to this catalog's own registry and reads no weights. A version to drop that
        still has requests queued or running stays until a later call; returns those keys."""
        entry = self._index.lookup(adapter_id)[1]
        had, had_owner = (entry.versions, entry.owner) if entry is not None else ({}, owner)
        wanted = {row.version for row in rows}
        busy: dict[int, str] = {}
        for version in [v for v in had if v not in wanted]:
            key = version_key(adapter_id, version)
            served = key in self._cache.entries
            if served and self._cache.residency.is_busy(key):
                busy[version] = key
                continue
            if served:
                self._cache.unregister(key)
            self._unfit.pop(key, None)
        base = self._base_digest()
        for row in rows:
            if row.version not in had:
                self._serve_stored(row, base, owner)
            elif row.key in self._cache.entries and had_owner != owner:
                self._cache.set_owner(row.key, owner)
            if row.key in self._cache.entries and self._cache.residency.get(row.key).pinned != row.pinned:
                self._apply_pin(row.key, row.pinned, "here")
        self._index.mirror(adapter_id, owner, current, rows, keep=set(busy))
        return list(busy.values())

    # -- aliases and channels -------------------------------------------------------------------

    async def move(
        self, adapter_id: str, to: int | Choose, *, channel: str = "", action: str = "deploy", actor: str | None = None
    ) -> VersionInfo:
        """Point ``adapter_id`` (or its named ``channel``, created on first use: ``id@channel``) at
        version ``to``, or at the one ``to`` chooses (a rollback's :data:`~lorapage.registry.audit.Choose`)
        from the alias's moves, where it points and the versions served here, under one lock. Committed
        (audited as ``action``) before the live view shows it; submitted requests keep their version."""
        entry = self._index.require(adapter_id)
        check_channel(channel)
        async with self._lock:
            if isinstance(to, int):
                version = to
            else:
                at = self._index.at(adapter_id, channel)
                history = await _blocking(self._io, lambda: self._registry.alias_history(adapter_id))
                servable = [v for v, row in entry.versions.items() if row.key in self._cache.entries]
                version = to([m for m in history if m.channel == channel], at, servable)
            row = self._index.existing(adapter_id, version)
            if row.key not in self._cache.entries:
                self.resolve_version(row.key)  # raises the base mismatch
            if channel:
                await _blocking(
                    self._io,
                    lambda: self._registry.set_channel(adapter_id, channel, version, action=action, actor=actor),
                )
                self._index.set_channel(adapter_id, channel, version)
            else:
                await _blocking(
                    self._io, lambda: self._registry.set_current(adapter_id, version, action=action, actor=actor)
                )
                self._index.set_current(adapter_id, version)
            return self._info(row)

    async def remove_channel(self, adapter_id: str, channel: str, *, actor: str | None = None) -> None:
        """Forget ``adapter_id``'s named ``channel`` (``id@channel`` then names nothing), audited."""
        entry = self._index.require(adapter_id)
        async with self._lock:
            if channel not in entry.channels:
                raise AdapterNotFoundError(f"adapter {adapter_id!r} has no channel {channel!r}", param="channel")
            await _blocking(
                self._io, lambda: self._registry.set_channel(adapter_id, channel, None, action="channel", actor=actor)
            )
            self._index.set_channel(adapter_id, channel, None)

    async def history(self, adapter_id: str, limit: int | None = None) -> list[AliasMove]:
        """``adapter_id``'s alias moves (every channel), newest first (404 for an unknown id)."""
        self._index.require(adapter_id)
        return await _blocking(self._io, lambda: self._registry.alias_history(adapter_id, limit))

    # -- pins and residency ---------------------------------------------------------------------

    async def set_pinned(self, key: str, pinned: bool, *, actor: str | None = None, outcome: str = "ok") -> None:
        """Pin version ``key`` resident, or unpin it, committed before the residency applies it; a
        pin past the bounds is refused (PinLimitError) before anything is written. ``outcome``
        marks the audit row of a pin undone (its load failed)."""
        adapter_id, version = parse_name(key)
        async with self._lock:  # no other pin can take the room between the check and the pin
            row = self._index.version(adapter_id, version)
            if row is None or key not in self._cache.entries:
                raise AdapterNotFoundError(f"adapter {key!r} does not exist", param="id")  # deleted meanwhile
            if pinned:
                self._cache.residency.pins.check(key)
            await _blocking(
                self._io,
                lambda: self._registry.set_pinned(adapter_id, row.version, pinned, actor=actor, outcome=outcome),
            )
            self._index.set_pinned(adapter_id, row.version, pinned)
            self._apply_pin(key, pinned, "")

    def _apply_pin(self, key: str, pinned: bool, where: str) -> None:
        """The residency applies a pin decided here; one past its bounds is logged (``where``) and
        left unapplied when restored or mirrored, raised when an admin asked (``where`` empty)."""
        if not pinned:
            self._cache.unpin(key)
            return
        try:
            self._cache.pin(key)
        except PinLimitError as exc:
            if not where:
                raise
            log.warning("adapter %s stays unpinned %s: %s", key, where, exc.message)

    # -- deletion -------------------------------------------------------------------------------

    def remove(self, name: str, *, actor: str | None = None) -> list[str]:
        """Remove version ``id@N``, or every version of ``id`` (see ``index.removable``); refused
        (409) while any of them has requests queued or running, and then nothing is removed. The
        alias moves to the newest remaining version if it pointed at one removed. Returns the keys."""
        keys = self._index.removable(name)
        for key in keys:
            if key in self._cache.entries:
                self._cache.residency.check_removable(key)
        for key in keys:
            adapter_id, version = parse_name(key)
            assert version is not None
            current = self._index.current_without(adapter_id, version)
            self._registry.delete_version(adapter_id, version, current, actor=actor)
            if key in self._cache.entries:
                self._cache.unregister(key)
            self._index.remove(adapter_id, version)
        return keys

    # -- the record: audit, traffic, check prompts, migration states ----------------------------

    async def audit(self, query: AuditQuery) -> list[AuditEntry]:
        """The audit rows ``query`` selects, newest first (read in a worker thread)."""
        return await _blocking(self._io, lambda: self._registry.audit(query))

    async def record(
        self, action: str, adapter_id: str | None, *, actor: str | None, after: dict | None = None, outcome: str = "ok"
    ) -> None:
        """Audit an admin action that changes nothing stored (load, unload, a tenants reload)."""
        owner = self._index.owner(adapter_id) if adapter_id is not None else None
        await _blocking(
            self._io,
            lambda: self._registry.record(action, adapter_id, actor=actor, tenant=owner, after=after, outcome=outcome),
        )

    async def migrate_version(self, state: MigrationRow, *, actor: str | None = None) -> VersionRow:
        """Version ``state.key``, whose drift check passed, stored again bound to ``state.target``
        (:meth:`Registry.migrate_version`: the alias stays, the migration ``migrated``, audited) and
        shown in the live view: listed, served once this engine runs that base, or by an engine
        on it beside this one."""
        row = await asyncio.to_thread(self._registry.migrate_version, state, actor=actor)
        known = self._index.lookup(row.adapter_id)[1] is not None
        if known and self._index.version(row.adapter_id, row.version) is None:
            self._index.put(row)
        return row

    def close(self) -> None:
        self._registry.close()  # the registry this catalog alone holds (after the tiers' last write)


async def _blocking(io: Executor, work: Callable[[], T]) -> T:
    """``work`` (a blocking registry read or commit) in the engine's I/O thread."""
    return await asyncio.get_running_loop().run_in_executor(io, work)


def _costed(rows: list[VersionRow], base: str, cache: AdapterCache, registry: Registry) -> list[VersionRow]:
    """``rows``, each version on ``base`` with its projected cost as this configuration
    computes it; stored first where the registry holds none (a migrated file) or another (a
    new reference batch or adapter dtype). Versions on other bases keep theirs."""
    changed = {}
    for row in rows:
        if row.base_digest == base:
            pct = cache.checks.cost_of(spec_from_json(row.spec)).projected_cost_pct
            if row.projected_cost_pct is None or abs(row.projected_cost_pct - pct) > 1e-9 * max(1.0, pct):
                changed[(row.adapter_id, row.version)] = pct
    if changed:
        registry.set_projected_costs(changed)
    return [
        dataclasses.replace(r, projected_cost_pct=changed[(r.adapter_id, r.version)])
        if (r.adapter_id, r.version) in changed
        else r
        for r in rows
    ]
