"""Adapter ids, versions and aliases: the registry's live view, in front of the adapter cache.

A registration of new content under an id makes an immutable version ``id@N``; the id itself is
an alias for one of them (the current), re-pointed atomically by a deploy or a rollback. A
request names ``id``, ``id@N`` or ``id@channel`` (a named channel, e.g. ``prod``: a second alias
a deploy moves on its own; a lowercase letter first, so it never reads as a version) and is
resolved to one version when it is submitted: it runs on that version to its end, whatever the
aliases do meanwhile, so no step ever mixes two versions of one request. The adapter cache
serves each version under its key ``id@N`` and knows nothing of aliases.

Every change is committed to the :class:`~lorapage.registry.store.Registry` (in a worker
thread) before the live view shows it, so what a caller was told exists survives a restart; the
same transaction appends its audit row, as the ``actor`` the caller names (a key id over HTTP),
and each alias move to the alias history a rollback walks back (:mod:`lorapage.registry.audit`).
Each version records the digest of the base it was trained on, which registration requires to be
the running one (:mod:`lorapage.adapters.binding`); on a restart over another base those versions
are kept but refused (:class:`~lorapage.errors.AdapterBaseMismatchError`), unless a base migration
(:mod:`lorapage.registry.drift_state`) stored a version of the same content bound to the running
base: the id's alias and channels, pointing at the old version, then serve that one.

Admin pins are written through the same way (:meth:`AdapterCatalog.set_pinned`). A restart marks
the pinned versions in the cache as it restores them, reading nothing; their loads start when the
engine's step loop first binds to an event loop (``AdapterCache.rebind_loop``), since a load is a
task on that loop. A pin that no longer fits (a smaller pool, a lower ``max_pinned_fraction``) is
logged and not applied, and kept in the registry for a later start that has the room.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from lorapage.adapters.binding import BaseBinding, mismatch_message
from lorapage.adapters.cache import AdapterCache
from lorapage.adapters.digest import digest_param
from lorapage.adapters.layout import AdapterLayout
from lorapage.adapters.loader import Origin
from lorapage.adapters.names import parse_name, version_key
from lorapage.adapters.peft_format import AdapterSpec
from lorapage.errors import (
    AdapterBaseMismatchError,
    AdapterFormatError,
    AdapterIntegrityError,
    AdapterNotFoundError,
    PinLimitError,
)
from lorapage.registry.audit import DEFAULT_CHANNEL, AliasMove, check_channel, rollback_version
from lorapage.registry.drift_state import MIGRATED
from lorapage.registry.store import Registry, VersionRow
from lorapage.registry.version_index import VersionIndex

log = logging.getLogger("lorapage.adapters")

REGISTRATION_TIMEOUT_S = 30.0  # reading and checking one adapter may take this long


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


@dataclass(frozen=True)
class PreparedVersion:
    """An adapter fetched, checked and digested, committed nowhere yet: what a registry held
    elsewhere (the fleet's, :mod:`lorapage.fleet.registry`) stores as a version."""

    source: str  # canonical source URI
    digest: str
    base_digest: str
    spec: str  # spec_to_json
    rank: int
    target_modules: tuple[str, ...]
    size_bytes: int
    projected_cost_pct: float  # at the preparing engine's reference batch

    def store(
        self, registry: Registry, adapter_id: str, owner: str | None, *, activate: bool, actor: str | None
    ) -> VersionRow:
        """Commit it to ``registry`` as a new version of ``adapter_id`` (a blocking SQLite write)."""
        return registry.add_version(
            adapter_id,
            owner,
            digest=self.digest,
            source=self.source,
            base_digest=self.base_digest,
            spec=self.spec,
            activate=activate,
            projected_cost_pct=self.projected_cost_pct,
            actor=actor,
        )


class AdapterCatalog:
    """The live registry: ids -> versions (a :class:`~lorapage.registry.version_index.VersionIndex`)
    -> the cache's entries, written through to SQLite."""

    def __init__(
        self,
        cache: AdapterCache,
        registry: Registry,
        *,
        base_digest: Callable[[], str],
        binding: BaseBinding,
        io_executor: Executor,
    ) -> None:
        """``base_digest``: the running base's (computed when first needed); ``binding``: how
        registration tells the base an adapter was trained on."""
        self.cache, self.registry = cache, registry
        self._base_digest, self.binding, self._io = base_digest, binding, io_executor
        self._unfit: dict[str, AdapterFormatError] = {}  # restored versions this configuration cannot serve
        self._lock = asyncio.Lock()  # one registration or alias change of the live view at a time
        self._index = self._restore()

    @property
    def generation(self) -> int:
        """Grows at every change of the live view (ids, versions, aliases, channels, owners, pins)."""
        return self._index.generation

    # -- restart --------------------------------------------------------------------------------

    def _restore(self) -> VersionIndex:
        """Rebuild the live view and the cache's entries from the registry, reading no weights."""
        rows = self.registry.versions()
        base = self._base_digest() if rows else ""
        rows = self._costed(rows, base)
        index = VersionIndex.load(self.registry, rows)
        for row in rows:
            self._serve_stored(row, base, index.owner(row.adapter_id))
        if rows:  # an alias at a version of another base serves its migration onto this one
            index.migrations = {
                (m.adapter_id, m.version): m.new_version
                for m in self.registry.migration_states(target=base)
                if m.state == MIGRATED and m.new_version is not None
            }
        self._restore_pins(rows)
        return index

    def _costed(self, rows: list[VersionRow], base: str) -> list[VersionRow]:
        """``rows``, each version on ``base`` with its projected cost as this configuration
        computes it; stored first where the registry holds none (a migrated file) or another (a
        new reference batch or adapter dtype). Versions on other bases keep theirs."""
        changed = {}
        for row in rows:
            if row.base_digest == base:
                pct = self.cache.checks.envelope.cost(spec_from_json(row.spec).ranks).projected_cost_pct
                if row.projected_cost_pct is None or abs(row.projected_cost_pct - pct) > 1e-9 * max(1.0, pct):
                    changed[(row.adapter_id, row.version)] = pct
        if changed:
            self.registry.set_projected_costs(changed)
        return [
            dataclasses.replace(r, projected_cost_pct=changed[(r.adapter_id, r.version)])
            if (r.adapter_id, r.version) in changed
            else r
            for r in rows
        ]

    def _serve_stored(self, row: VersionRow, base: str, owner: str | None) -> None:
        """Give a stored version its cache entry (reading no weights), unless it was validated
        against another base (kept, and refused by resolve) or this configuration cannot serve it:
        its pool, its max_lora_rank or its shared envelope (never shared silently: refused by
        resolve with the envelope's 400)."""
        if row.base_digest != base:
            return
        spec = spec_from_json(row.spec)
        try:
            self.cache.checks.check_envelope(spec)
            self.cache.add(row.key, spec, self.cache.checks.plan(spec), row.digest, Origin(row.source, owner))
        except AdapterFormatError as exc:
            self._unfit[row.key] = exc

    def _restore_pins(self, rows: list[VersionRow]) -> None:
        """Mark the pinned versions pinned in the cache (their entries exist by now), oldest
        registration first while the bounds allow."""
        for row in sorted((r for r in rows if r.pinned and r.key in self.cache.entries), key=lambda r: r.created):
            try:
                self.cache.pin(row.key)
            except PinLimitError as exc:
                log.warning("adapter %s stays unpinned on this start: %s", row.key, exc.message)

    # -- names ----------------------------------------------------------------------------------

    def resolve(self, name: str) -> str:
        """The version key ``name`` (``id``, ``id@N`` or ``id@channel``) serves now; 404 when
        there is none, 409 when the version was trained on another base (both digests and the
        migration route)."""
        row = self._index.row(name)
        if row is None:
            raise AdapterNotFoundError(f"adapter {name!r} does not exist", param="model")
        if row.key in self._unfit:
            raise self._unfit[row.key]
        if row.key not in self.cache.entries:
            raise AdapterBaseMismatchError(
                mismatch_message(f"adapter {row.key}", row.base_digest, self._base_digest()), param="model"
            )
        return row.key

    def row(self, name: str) -> VersionRow:
        """The stored version ``name`` names, on this base or not (404 when there is none)."""
        row = self._index.row(name)
        if row is None:
            raise AdapterNotFoundError(f"adapter {name!r} does not exist", param="model")
        return row

    def owner(self, adapter_id: str) -> str | None:
        return self._index.owner(adapter_id)

    def ids(self) -> list[str]:
        return self._index.ids()

    def versions(self, adapter_id: str | None = None) -> list[VersionInfo]:
        chosen = [adapter_id] if adapter_id is not None else self._index.ids()
        out: list[VersionInfo] = []
        for i in chosen:
            entry = self._index.get(i)
            if entry is not None:
                out.extend(self._info(row) for row in entry.versions.values())
        return out

    def version_info(self, name: str) -> VersionInfo:
        """The version ``name`` names; a version on another base is described, not refused."""
        row = self._index.row(name)
        if row is None:
            raise AdapterNotFoundError(f"adapter {name!r} does not exist", param="model")
        return self._info(row)

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
            servable=row.key in self.cache.entries,
            projected_cost_pct=row.projected_cost_pct,
        )

    def current_costs(self) -> dict[str, float]:
        """Each id's current version's projected cost, for those this engine serves (metrics)."""
        out = {}
        for adapter_id in self._index.ids():
            row = self._index.version(adapter_id, self._index.current(adapter_id))
            if row is not None and row.projected_cost_pct is not None and row.key in self.cache.entries:
                out[adapter_id] = row.projected_cost_pct
        return out

    def add_migrated(self, row: VersionRow) -> None:
        """Show a version a base migration stored (:meth:`Registry.migrate_version`, bound to
        another base: listed, not served here) in the live view."""
        if self._index.get(row.adapter_id) is not None and self._index.version(row.adapter_id, row.version) is None:
            self._index.put(row)

    def stored(self) -> list[tuple[str, str | None, int | None, list[VersionRow]]]:
        """Every id as stored: its owner, its alias (current version) and its versions' rows, on
        any base: what an engine serving another base beside this one mirrors
        (:meth:`mirror`; :mod:`lorapage.serve.engines`)."""
        return self._index.stored()

    # -- registration ---------------------------------------------------------------------------

    def check_owner(self, adapter_id: str, owner: str | None) -> None:
        """An id with versions belongs to the tenant that first registered it."""
        self._index.check_owner(adapter_id, owner)

    def prepare(
        self, path: Path, *, sha256: str | None, expected_base_digest: str | None, envelope: bool = True
    ) -> tuple[AdapterSpec, AdapterLayout, str]:
        """Read and check an adapter directory (any thread): spec, layout and content digest;
        refuses a digest other than ``sha256``, an adapter not trained on the running base
        (``expected_base_digest``, else its metadata: see :class:`BaseBinding`) and, unless
        ``envelope`` is False, one outside the shared envelope."""
        running = self._base_digest()
        if expected_base_digest is not None:  # the caller's word: refused before any weight is read
            self.binding.bind(running, expected=expected_base_digest, trained_on=None)
        spec, layout, digest = self.cache.checks.validate(str(path), envelope=envelope)
        if sha256 is not None and digest_param(sha256, "sha256") != digest:
            raise AdapterIntegrityError(
                f"adapter at {path} has content digest {digest}, not the sha256 given ({sha256})", param="sha256"
            )
        self.binding.bind(running, expected=expected_base_digest, trained_on=spec.trained_on)
        return spec, layout, digest

    async def prepare_in_worker(
        self,
        adapter_id: str,
        path: Path,
        *,
        sha256: str | None,
        expected_base_digest: str | None,
        timeout_s: float = REGISTRATION_TIMEOUT_S,
        envelope: bool = True,
    ) -> tuple[AdapterSpec, AdapterLayout, str]:
        """:meth:`prepare` in a worker thread, refused past ``timeout_s``."""
        work = asyncio.get_running_loop().run_in_executor(
            self._io,
            lambda: self.prepare(path, sha256=sha256, expected_base_digest=expected_base_digest, envelope=envelope),
        )
        try:
            return await asyncio.wait_for(work, timeout_s)
        except TimeoutError:
            raise AdapterFormatError(
                f"adapter {adapter_id!r} could not be read and checked within {timeout_s:g}s", param="path"
            ) from None

    async def register(
        self,
        adapter_id: str,
        path: Path,
        *,
        source: str | None = None,
        owner: str | None = None,
        sha256: str | None = None,
        expected_base_digest: str | None = None,
        activate: bool = True,
        timeout_s: float = REGISTRATION_TIMEOUT_S,
        actor: str | None = None,
    ) -> tuple[VersionInfo, bool]:
        """Register the adapter in ``path`` as a new version of ``adapter_id`` (read and checked
        in a worker, within ``timeout_s``), committed before it is returned. Content equal to an
        existing version makes no new one: that version is returned (and made current when
        ``activate``). Returns the version and whether it was created."""
        self.check_owner(adapter_id, owner)
        loop = asyncio.get_running_loop()
        spec, layout, digest = await self.prepare_in_worker(
            adapter_id, path, sha256=sha256, expected_base_digest=expected_base_digest, timeout_s=timeout_s
        )
        async with self._lock:
            self.check_owner(adapter_id, owner)  # again: another registration may have taken the id
            same = self._same_content(adapter_id, digest)
            if same is not None:
                moved_to = source or path.resolve().as_uri()
                if same.source != moved_to:
                    row = same
                    await loop.run_in_executor(
                        self._io, lambda: self.registry.set_source(row.adapter_id, row.version, moved_to, actor=actor)
                    )
                    same = self._moved(same, moved_to)
                if activate and self._index.current(adapter_id) != same.version:
                    await loop.run_in_executor(
                        self._io,
                        lambda: self.registry.set_current(adapter_id, same.version, action="register", actor=actor),
                    )
                    self._index.set_current(adapter_id, same.version)
                return self._info(same), False
            row = await loop.run_in_executor(
                self._io,
                lambda: self._commit(
                    adapter_id, owner, spec, digest, source or path.resolve().as_uri(), activate, actor
                ),
            )
            return self._add_live(row, owner, spec, layout, activate), True

    async def add_prepared(
        self, adapter_id: str, prepared: PreparedVersion, *, owner: str | None, activate: bool, actor: str | None
    ) -> tuple[VersionInfo, bool]:
        """Commit a version an engine on another base prepared (bound to that base: listed here,
        served there): registering, on a server running both, an adapter trained on the other
        one. Content already stored on that base makes no new version (it is made current when
        ``activate``). Returns the version and whether it was created."""
        self.check_owner(adapter_id, owner)
        loop = asyncio.get_running_loop()
        async with self._lock:
            self.check_owner(adapter_id, owner)
            same = self._index.find(
                adapter_id, lambda r: r.digest == prepared.digest and r.base_digest == prepared.base_digest
            )
            if same is not None:
                if activate and self._index.current(adapter_id) != same.version:
                    await loop.run_in_executor(
                        self._io,
                        lambda: self.registry.set_current(adapter_id, same.version, action="register", actor=actor),
                    )
                    self._index.set_current(adapter_id, same.version)
                return self._info(same), False
            row = await loop.run_in_executor(
                self._io,
                lambda: prepared.store(self.registry, adapter_id, owner, activate=activate, actor=actor),
            )
            self._index.add(row, owner, activate=activate)
            return self._info(row), True

    def register_now(
        self, adapter_id: str, path: Path, *, owner: str | None = None, expected_base_digest: str | None = None
    ) -> VersionInfo:
        """:meth:`register` in the calling thread (for scripts with no event loop running)."""
        self.check_owner(adapter_id, owner)
        prepared = self.prepare(path, sha256=None, expected_base_digest=expected_base_digest)
        return self.register_prepared(adapter_id, path, prepared, owner=owner)

    def register_prepared(
        self,
        adapter_id: str,
        path: Path,
        prepared: tuple[AdapterSpec, AdapterLayout, str],
        *,
        owner: str | None = None,
    ) -> VersionInfo:
        """:meth:`register_now` of a directory :meth:`prepare` already read and checked: many ids
        over one directory (benchmarks of thousands of adapters) read it once."""
        self.check_owner(adapter_id, owner)
        spec, layout, digest = prepared
        same = self._same_content(adapter_id, digest)
        if same is not None:
            if same.source != path.resolve().as_uri():
                self.registry.set_source(same.adapter_id, same.version, path.resolve().as_uri())
                same = self._moved(same, path.resolve().as_uri())
            if self._index.current(adapter_id) != same.version:
                self.registry.set_current(adapter_id, same.version, action="register")
                self._index.set_current(adapter_id, same.version)
            return self._info(same)
        row = self._commit(adapter_id, owner, spec, digest, path.resolve().as_uri(), True)
        return self._add_live(row, owner, spec, layout, True)

    def _moved(self, row: VersionRow, source: str) -> VersionRow:
        """``row``'s content was just read again from ``source`` (same digest) and the registry
        says so: later loads read from there (the files moved, or their old place is gone)."""
        self.cache.set_source(row.key, source)
        moved = dataclasses.replace(row, source=source)
        self._index.put(moved)
        return moved

    def _same_content(self, adapter_id: str, digest: str) -> VersionRow | None:
        return self._index.find(adapter_id, lambda r: r.digest == digest and r.key in self.cache.entries)

    def _commit(
        self,
        adapter_id: str,
        owner: str | None,
        spec: AdapterSpec,
        digest: str,
        source: str,
        activate: bool,
        actor: str | None = None,
    ) -> VersionRow:
        return self.registry.add_version(
            adapter_id,
            owner,
            digest=digest,
            source=source,
            base_digest=self._base_digest(),
            spec=spec_to_json(spec),
            activate=activate,
            projected_cost_pct=self.cache.checks.envelope.cost(spec.ranks).projected_cost_pct,
            actor=actor,
        )

    def _add_live(
        self, row: VersionRow, owner: str | None, spec: AdapterSpec, layout: AdapterLayout, activate: bool
    ) -> VersionInfo:
        entry = self._index.add(row, owner, activate=activate)
        self.cache.add(row.key, spec, layout, row.digest, Origin(row.source, entry.owner))
        return self._info(row)

    # -- a registry held elsewhere ---------------------------------------------------------------

    def mirror(self, adapter_id: str, owner: str | None, current: int | None, rows: list[VersionRow]) -> list[str]:
        """Make ``adapter_id``'s live view what a registry held elsewhere (the fleet's) says:
        these versions (none: the id is gone), this alias and these pins. Writes nothing to this
        catalog's own registry and reads no weights. A version to drop that still has requests
        queued or running stays until a later call; returns those keys."""
        entry = self._index.get(adapter_id)
        had, had_owner = (entry.versions, entry.owner) if entry is not None else ({}, owner)
        wanted = {row.version for row in rows}
        busy: dict[int, str] = {}
        for version in [v for v in had if v not in wanted]:
            key = version_key(adapter_id, version)
            served = key in self.cache.entries
            if served and self.cache.residency.is_busy(key):
                busy[version] = key
                continue
            if served:
                self.cache.unregister(key)
            self._unfit.pop(key, None)
        base = self._base_digest()
        for row in rows:
            if row.version not in had:
                self._serve_stored(row, base, owner)
            elif row.key in self.cache.entries and had_owner != owner:
                self.cache.set_owner(row.key, owner)
            self._mirror_pin(row)
        self._index.mirror(adapter_id, owner, current, rows, keep=set(busy))
        return list(busy.values())

    def _mirror_pin(self, row: VersionRow) -> None:
        if row.key not in self.cache.entries or self.cache.residency.get(row.key).pinned == row.pinned:
            return
        if not row.pinned:
            self.cache.unpin(row.key)
            return
        try:
            self.cache.pin(row.key)
        except PinLimitError as exc:
            log.warning("adapter %s stays unpinned here: %s", row.key, exc.message)

    # -- aliases and deletion -------------------------------------------------------------------

    async def set_current(
        self, adapter_id: str, version: int, *, channel: str = DEFAULT_CHANNEL, actor: str | None = None
    ) -> VersionInfo:
        """Point ``adapter_id`` (or its named ``channel``, created on first use) at ``version``:
        a deploy. Requests already submitted keep the version they were resolved to."""
        self._index.require(adapter_id)
        check_channel(channel)
        async with self._lock:
            return await self._move(adapter_id, version, channel, "deploy", actor)

    async def rollback(
        self, adapter_id: str, version: int | None = None, *, channel: str = DEFAULT_CHANNEL, actor: str | None = None
    ) -> VersionInfo:
        """Point ``adapter_id`` (or its ``channel``) back at ``version``, or without one at the
        version before its last deploy (:func:`~lorapage.registry.audit.rollback_target`: rolling
        back again goes one deploy further back); 409 when there is none."""
        entry = self._index.require(adapter_id)
        check_channel(channel)
        async with self._lock:  # no other move between reading the history and this one
            at = self._index.at(adapter_id, channel)
            if version is None:
                history = await asyncio.get_running_loop().run_in_executor(
                    self._io, self.registry.alias_history, adapter_id
                )
                servable = [v for v, row in entry.versions.items() if row.key in self.cache.entries]
                moves = [m for m in history if m.channel == channel]
                version = rollback_version(moves, at, servable, _alias_name(adapter_id, channel))
            return await self._move(adapter_id, version, channel, "rollback", actor)

    async def remove_channel(self, adapter_id: str, channel: str, *, actor: str | None = None) -> None:
        """Forget ``adapter_id``'s named ``channel`` (``id@channel`` then names nothing)."""
        entry = self._index.require(adapter_id)
        async with self._lock:
            if channel not in entry.channels:
                raise AdapterNotFoundError(f"adapter {adapter_id!r} has no channel {channel!r}", param="channel")
            await asyncio.get_running_loop().run_in_executor(
                self._io, lambda: self.registry.set_channel(adapter_id, channel, None, action="channel", actor=actor)
            )
            self._index.set_channel(adapter_id, channel, None)

    def channels(self, adapter_id: str) -> dict[str, int]:
        """``adapter_id``'s named channels and the versions they point at."""
        return dict(self._index.require(adapter_id).channels)

    async def history(self, adapter_id: str, limit: int | None = None) -> list[AliasMove]:
        """``adapter_id``'s alias moves (every channel), newest first, read in a worker thread."""
        self._index.require(adapter_id)
        return await asyncio.get_running_loop().run_in_executor(
            self._io, self.registry.alias_history, adapter_id, limit
        )

    async def _move(self, adapter_id: str, version: int, channel: str, action: str, actor: str | None) -> VersionInfo:
        """Move the alias (or ``channel``) to ``version``, committed first (the caller holds the lock)."""
        row = self._index.existing(adapter_id, version)
        if row.key not in self.cache.entries:
            self.resolve(row.key)  # raises the base mismatch
        loop = asyncio.get_running_loop()
        if channel:
            await loop.run_in_executor(
                self._io, lambda: self.registry.set_channel(adapter_id, channel, version, action=action, actor=actor)
            )
            self._index.set_channel(adapter_id, channel, version)
        else:
            await loop.run_in_executor(
                self._io, lambda: self.registry.set_current(adapter_id, version, action=action, actor=actor)
            )
            self._index.set_current(adapter_id, version)
        return self._info(row)

    async def set_pinned(self, key: str, pinned: bool, *, actor: str | None = None, outcome: str | None = None) -> None:
        """Pin version ``key`` resident, or unpin it, committed before the cache applies it;
        a pin past the bounds is refused (PinLimitError) before anything is written. ``outcome``
        marks the audit row of a pin undone by its caller (its load failed)."""
        adapter_id, version = parse_name(key)
        async with self._lock:  # no other pin can take the room between the check and the pin
            row = self._index.version(adapter_id, version)
            if row is None or key not in self.cache.entries:
                raise AdapterNotFoundError(f"adapter {key!r} does not exist", param="id")  # deleted meanwhile
            if pinned:
                self.cache.residency.pins.check(key)
            await asyncio.get_running_loop().run_in_executor(
                self._io,
                lambda: self.registry.set_pinned(adapter_id, row.version, pinned, actor=actor, outcome=outcome or "ok"),
            )
            self._index.set_pinned(adapter_id, row.version, pinned)
            if pinned:
                self.cache.pin(key)
            else:
                self.cache.unpin(key)

    def removable(self, name: str) -> list[str]:
        """The version keys deleting ``name`` removes (see :func:`~lorapage.registry.store.removable_keys`);
        a version a named channel points at is refused (409) as the current one is, while the id has others."""
        return self._index.removable(name)

    def remove(self, name: str, *, actor: str | None = None) -> list[str]:
        """Remove version ``id@N``, or every version of ``id`` (see :meth:`removable`); refused
        (409) while any of them has requests queued or running, and then nothing is removed.
        Returns the keys removed."""
        keys = self.removable(name)
        for key in keys:
            if key in self.cache.entries:
                self.cache.residency.check_removable(key)
        for key in keys:
            self._remove_version(key, actor)
        return keys

    def _remove_version(self, key: str, actor: str | None = None) -> None:
        """Forget one idle version, committed first. The alias moves to the newest remaining
        version if it pointed here."""
        adapter_id, version = parse_name(key)
        assert version is not None
        self.registry.delete_version(adapter_id, version, self._index.current_without(adapter_id, version), actor=actor)
        if key in self.cache.entries:
            self.cache.unregister(key)
        self._index.remove(adapter_id, version)


def _alias_name(adapter_id: str, channel: str) -> str:
    return f"{adapter_id}@{channel}" if channel else adapter_id


def spec_to_json(spec: AdapterSpec) -> str:
    """The spec as stored in the registry: enough to serve the version without re-reading it."""
    return json.dumps(
        {
            "path": str(spec.path),
            "weights_file": spec.weights_file.name,
            "modules": [
                [layer, module, spec.ranks[(layer, module)], spec.scales[(layer, module)]]
                for (layer, module) in sorted(spec.ranks)
            ],
            "target_modules": list(spec.target_modules),
            "max_rank": spec.max_rank,
            "size_bytes": spec.size_bytes,
        }
    )


def spec_from_json(text: str) -> AdapterSpec:
    data = json.loads(text)
    path = Path(data["path"])
    return AdapterSpec(
        path=path,
        weights_file=path / data["weights_file"],
        ranks={(layer, module): rank for layer, module, rank, _ in data["modules"]},
        scales={(layer, module): scale for layer, module, _, scale in data["modules"]},
        target_modules=tuple(data["target_modules"]),
        max_rank=data["max_rank"],
        size_bytes=data["size_bytes"],
    )
