"""Adapter administration: the one typed interface front ends manage an engine's adapters through.

Register and prepare versions, deploy and roll back aliases and channels, remove and drain them,
pin, load and unload, and the read-only views a server needs (info, versions, owners, traffic,
history, the audit trail). An :class:`~lorapage.engine.engine.Engine` holds one as ``engine.admin``;
front ends (``lorapage.server``, ``lorapage.fleet``, ``lorapage.bases``) never reach into the
engine's catalog, cache or policy. Every call that changes something is audited as ``actor``'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

from lorapage.adapters.cache import AdapterCache, AdapterInfo
from lorapage.adapters.digest import normalize_digest
from lorapage.adapters.names import parse_name
from lorapage.engine.tiering import TierKeeper
from lorapage.errors import InvalidRequestError, LorapageError
from lorapage.registry.audit import DEFAULT_CHANNEL, AliasMove, AuditEntry, AuditQuery
from lorapage.registry.catalog import (
    REGISTRATION_TIMEOUT_S,
    AdapterCatalog,
    PreparedVersion,
    VersionInfo,
    spec_from_json,
    spec_to_json,
)
from lorapage.registry.store import Registry, TrafficRow, VersionRow
from lorapage.sources import AdapterRoots, AdapterSources, FileSource, Source, parse_source

# Opens a stored version's files: (source, digest, owner) -> its directory, checked as it is read.
Locate = Callable[[str, str, str | None], AbstractAsyncContextManager[Path]]


class AdapterAdmin:
    """An engine's adapter versions, aliases, channels, pins and residency, managed by name
    (``id``, ``id@N`` or ``id@channel``). Errors are :class:`~lorapage.errors.LorapageError`:
    a server answers them as they are (404 unknown, 409 busy or refused, 400 bad input)."""

    def __init__(
        self,
        catalog: AdapterCatalog,
        cache: AdapterCache,
        registry: Registry,
        tiers: TierKeeper,
        sources: AdapterSources,
        *,
        roots: AdapterRoots,
        download_cache: str | None,
        io_executor: Executor,
        base_digest: Callable[[], str],
        locate: Locate,
        check_open: Callable[[], None],
        bind: Callable[[], None],
        wall_clock: Callable[[], float],
    ) -> None:
        """The engine's parts it manages; ``locate`` opens a stored version's files (checked),
        ``check_open`` refuses once the engine is closed, ``bind`` starts the step loop on the
        running event loop (loads need it)."""
        self._catalog = catalog
        self._cache = cache
        self._tiers = tiers
        self._sources = sources
        self._download_cache = download_cache  # where remote sources land (None: directories only)
        self._io = io_executor
        self._base_digest = base_digest
        self._locate = locate
        self._check_open = check_open
        self._bind = bind
        self.wall_clock = wall_clock
        """Unix seconds by the engine's clock: the hours traffic and usage are counted in."""
        self.roots = roots
        """The directories each owner's versions may be read from."""
        self.registry = registry
        """The durable record (SQLite): check prompts, sampled prompts and base-migration states
        are read and written through it, in a worker thread."""

    def add(
        self, name: str, path: str | Path, *, owner: str | None = None, expected_base_digest: str | None = None
    ) -> AdapterInfo:
        """Register a PEFT LoRA directory as a new version of ``name`` (the alias then points at
        it); it is validated now (read whole, in the calling thread), committed to the registry
        and loaded lazily. It must have been trained on this base: ``expected_base_digest`` when
        given, else its ``base_model_name_or_path`` says so (:mod:`lorapage.adapters.binding`).
        The directory must be one ``owner``'s versions may be read from (see :attr:`roots`).
        From a running event loop use :meth:`register`."""
        self.roots.check(Path(path), owner)
        version = self._catalog.register_now(name, Path(path), owner=owner, expected_base_digest=expected_base_digest)
        return self.info(version.key)

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
    ) -> AdapterInfo:
        """:meth:`add` without holding the event loop, from a directory or a source URI
        (``file://``, ``https://``, ``s3://``, ``hf://``; see :mod:`lorapage.sources`):
        fetched and verified against ``sha256`` when given, read and checked in a worker thread
        (refused past ``timeout_s``), and committed (audited as ``actor``'s) before this returns.
        Content equal to an existing version of ``name`` returns that version (``created`` False)."""
        self._check_open()
        src = await self._source(source, sha256, owner)
        async with self._sources.use(src, normalize_digest(sha256) if sha256 else None, owner) as path:
            version, created = await self._catalog.register(
                name,
                path,
                source=src.uri,
                owner=owner,
                sha256=sha256,
                expected_base_digest=expected_base_digest,
                activate=activate,
                timeout_s=timeout_s,
                actor=actor,
            )
        return dataclasses.replace(self.info(version.key), created=created)

    async def prepare(
        self,
        source: str | Path,
        *,
        sha256: str | None = None,
        expected_base_digest: str | None = None,
        timeout_s: float = REGISTRATION_TIMEOUT_S,
        owner: str | None = None,
        envelope: bool = True,
    ) -> PreparedVersion:
        """Fetch and check an adapter as :meth:`register` does (for ``owner``),
        committing it nowhere: the version a registry held elsewhere (a fleet's) stores and this
        engine then mirrors (:meth:`mirror`). ``envelope`` False: one outside the shared
        envelope is prepared too (tier ``dedicated``: a fleet serves it once promoted; this
        engine refuses its requests with the envelope's 400)."""
        self._check_open()
        src = await self._source(source, sha256, owner)
        async with self._sources.use(src, normalize_digest(sha256) if sha256 else None, owner) as path:
            spec, _, digest = await self._catalog.prepare_in_worker(
                src.uri, path, sha256=sha256, expected_base_digest=expected_base_digest, timeout_s=timeout_s,
                envelope=envelope,
            )  # fmt: skip
        return PreparedVersion(
            source=src.uri,
            digest=digest,
            base_digest=self._base_digest(),
            spec=spec_to_json(spec),
            rank=spec.max_rank,
            target_modules=spec.target_modules,
            size_bytes=spec.size_bytes,
            projected_cost_pct=self._cache.checks.envelope.cost(spec.ranks).projected_cost_pct,
        )

    async def add_prepared(
        self,
        name: str,
        prepared: PreparedVersion,
        *,
        owner: str | None = None,
        activate: bool = True,
        actor: str | None = None,
    ) -> tuple[VersionInfo, bool]:
        """Commit (audited as ``actor``'s) a version of ``name`` that an engine on another base
        prepared (:meth:`prepare`), bound to that base: listed here, served by that engine (a server
        running both bases, :mod:`lorapage.serve.engines`). Returns it and whether it is new."""
        self._check_open()
        return await self._catalog.add_prepared(name, prepared, owner=owner, activate=activate, actor=actor)

    async def register_checked(self, name: str, path: Path, *, expected_base_digest: str) -> AdapterInfo:
        """Register the files of a version the caller opened and verified already (a stored
        version's, :meth:`version_files`), as trained on this base (``expected_base_digest``, which
        must be its digest): no source is parsed and no root applies. What a base upgrade's check
        does on an engine already serving the new base; :meth:`remove` it afterwards."""
        self._check_open()
        version, _ = await self._catalog.register(name, path, expected_base_digest=expected_base_digest)
        return self.info(version.key)

    async def _source(self, source: str | Path, sha256: str | None, owner: str | None) -> Source:
        """``source`` parsed for a version of ``owner`` (off the loop: a directory is looked at)."""
        src = await asyncio.to_thread(parse_source, str(source), sha256=sha256, roots=self.roots, owner=owner)
        if not isinstance(src, FileSource) and self._download_cache is None:
            raise InvalidRequestError(
                f"adapter source {src.uri}: this engine has no disk cache for downloads; start the server with "
                "--state-dir or --adapter-cache-dir (EngineConfig.state_dir / adapter_cache_dir)",
                param="source",
            )
        return src

    @asynccontextmanager
    async def version_files(self, name: str) -> AsyncIterator[Path]:
        """The files of the version ``name`` names (``id@N``), from its stored source, as a load
        reads them (a base upgrade's check registers them on the candidate base)."""
        row = self._catalog.row(name)
        async with self._locate(row.source, row.digest, self._catalog.owner(row.adapter_id)) as path:
            yield path

    def resolve(self, name: str) -> str:
        """The version key (``id@N``) that ``name`` (``id`` or ``id@N``) is served by now."""
        return self._catalog.resolve(name)

    async def deploy(
        self, adapter_id: str, version: int, *, channel: str = DEFAULT_CHANNEL, actor: str | None = None
    ) -> AdapterInfo:
        """Point ``adapter_id`` (or its named ``channel``: ``id@channel``) at ``version`` (a
        deploy); requests in flight finish on the version they started with."""
        info = await self._catalog.set_current(adapter_id, version, channel=channel, actor=actor)
        return self.info(info.key)

    async def rollback(
        self, adapter_id: str, version: int | None = None, *, channel: str = DEFAULT_CHANNEL, actor: str | None = None
    ) -> AdapterInfo:
        """Point ``adapter_id`` (or its ``channel``) back at ``version``, or without one at the
        version it served before its last deploy (:meth:`AdapterCatalog.rollback`)."""
        info = await self._catalog.rollback(adapter_id, version, channel=channel, actor=actor)
        return self.info(info.key)

    def remove(self, name: str, *, actor: str | None = None) -> None:
        """Remove version ``id@N``, or every version of ``id``; refused (409) while any of them
        has requests queued or running, and then nothing is removed."""
        self._catalog.remove(name, actor=actor)

    async def audit(self, query: AuditQuery) -> list[AuditEntry]:
        """The registry's audit rows ``query`` selects, newest first (read in a worker thread)."""
        return await asyncio.get_running_loop().run_in_executor(self._io, self.registry.audit, query)

    async def record(
        self, action: str, adapter_id: str | None, *, actor: str | None, after: dict | None = None, outcome: str = "ok"
    ) -> None:
        """Audit an admin action that changes nothing in the registry (load, unload, a tenants
        reload), committed in a worker thread."""
        owner = self._catalog.owner(adapter_id) if adapter_id is not None else None
        await asyncio.get_running_loop().run_in_executor(
            self._io,
            lambda: self.registry.record(action, adapter_id, actor=actor, tenant=owner, after=after, outcome=outcome),
        )

    def dedicated_info(self, name: str) -> AdapterInfo:
        """What a version outside the shared envelope is (tier ``dedicated``: its requests are
        refused here), described from its stored spec; 404 when ``name`` names none."""
        row = self._catalog.row(name)
        return dataclasses.replace(
            self._cache.checks.spec_info(row.key, spec_from_json(row.spec)),
            adapter_id=row.adapter_id,
            version=row.version,
            digest=row.digest,
            source=row.source,
            current=self._catalog.version_info(row.key).current,
        )

    def info(self, name: str) -> AdapterInfo:
        """What ``name`` (``id`` or ``id@N``) is served by now."""
        key = self._catalog.resolve(name)
        version = self._catalog.version_info(key)
        return dataclasses.replace(
            self._cache.info(key),
            traffic_tier=self._tiers.tier(key).value,
            adapter_id=version.adapter_id,
            version=version.version,
            digest=version.digest,
            source=version.source,
            current=version.current,
        )

    async def refresh_tiers(self) -> dict[str, str]:
        """Write the traffic counted since the last time to the registry and judge every version's
        traffic tier now (the engine does this every ``tier_interval_s``): hot versions are kept
        resident, warm ones read into host RAM. Returns the versions not cold, with their tier."""
        self._check_open()
        self._bind()
        states = await self._tiers.refresh()
        return {key: state.tier.value for key, state in states.items()}

    async def traffic(self, adapter_id: str, hours: int = 25) -> list[TrafficRow]:
        """``adapter_id``'s traffic rows of the last ``hours`` hours (the one in progress
        included), per version and hour, counts not yet written included."""
        self._check_open()
        return await self._tiers.recent(adapter_id, hours)

    def versions(self, adapter_id: str | None = None) -> list[VersionInfo]:
        """Every version (of ``adapter_id``, or of all ids), servable here or not."""
        return self._catalog.versions(adapter_id)

    def ids(self) -> list[str]:
        """Every adapter id with a version, servable here or not."""
        return self._catalog.ids()

    def add_migrated_version(self, row: VersionRow) -> None:
        """Show a version a base migration just stored (bound to the new base: listed, served once
        this engine runs that base, or by an engine on it beside this one) in the live view."""
        self._catalog.add_migrated(row)

    def row(self, name: str) -> VersionRow:
        """The stored version ``name`` (``id``, ``id@N`` or ``id@channel``) names, on this base or
        another (404 when there is none): where a front end serving several bases routes it."""
        return self._catalog.row(name)

    def stored(self) -> list[tuple[str, str | None, int | None, list[VersionRow]]]:
        """Every id with its owner, alias and stored versions, on every base (what an engine on
        another base beside this one mirrors, :meth:`mirror`)."""
        return self._catalog.stored()

    def owners(self) -> dict[str, str]:
        """The owner of each id that has one (registered with it; restored after a restart)."""
        return {i: owner for i in self._catalog.ids() if (owner := self._catalog.owner(i)) is not None}

    @property
    def generation(self) -> int:
        """A number that grows at every change of the adapters' ids, versions, aliases, channels
        or owners: what a view of them (``/v1/models``) is cached under."""
        return self._catalog.generation

    def has_version(self, key: str) -> bool:
        """Whether version ``key`` (``id@N``) is registered in this engine (a mirror may lack it yet)."""
        return key in self._cache.entries

    def removable_versions(self, name: str) -> list[str]:
        """The version keys deleting ``name`` (``id@N`` or ``id``) would remove, removing nothing:
        404 when unknown, 409 for a version the alias or a channel serves while the id has others."""
        return self._catalog.removable(name)

    def channels(self, adapter_id: str) -> dict[str, int]:
        """``adapter_id``'s named channels and the versions they point at (404 for an unknown id)."""
        return self._catalog.channels(adapter_id)

    async def history(self, adapter_id: str, limit: int | None = None) -> list[AliasMove]:
        """``adapter_id``'s alias moves (every channel), newest first (404 for an unknown id)."""
        return await self._catalog.history(adapter_id, limit)

    async def remove_channel(self, adapter_id: str, channel: str, *, actor: str | None = None) -> None:
        """Forget ``adapter_id``'s named ``channel`` (``id@channel`` names nothing from then on), audited."""
        await self._catalog.remove_channel(adapter_id, channel, actor=actor)

    def mirror(self, adapter_id: str, owner: str | None, current: int | None, versions: list[VersionRow]) -> list[str]:
        """Make ``adapter_id`` what a registry held elsewhere (a fleet's) says: these versions
        (none: the id is gone), this alias and these pins, committing nothing here. Returns the
        versions to drop that still have requests (call again later for them)."""
        return self._catalog.mirror(adapter_id, owner, current, versions)

    def served(self) -> list[AdapterInfo]:
        """The versions the aliases point at, one per id."""
        return [self.info(v.key) for v in self._catalog.versions() if v.current and v.servable]

    async def load(self, name: str, *, actor: str | None = None) -> None:
        """Make ``name`` resident in the pool now (pre-warm); audited once it is."""
        self._check_open()
        self._bind()
        key = self._catalog.resolve(name)
        await self._cache.wait_resident(key)
        await self.record("load", parse_name(key)[0], actor=actor, after={"version": parse_name(key)[1]})

    async def unload(self, name: str, *, actor: str | None = None) -> bool:
        """Drop ``name`` from the pool (its host-RAM copy stays), audited when it was resident.
        Refused while it is running or pinned."""
        self._check_open()
        self._bind()
        key = self._catalog.resolve(name)
        dropped = self._cache.unload(key)
        if dropped:
            await self.record("unload", parse_name(key)[0], actor=actor, after={"version": parse_name(key)[1]})
        return dropped

    async def pin(self, name: str, *, actor: str | None = None) -> AdapterInfo:
        """Pin the version ``name`` names (``id``: its current one, or ``id@N``) resident: it is
        loaded now, never evicted nor made to yield, and pinned again after a restart. The pin is
        on the version: after a deploy, pin the new one. Refused (409 ``PinLimitError``, with the
        numbers) past ``max_pinned_fraction`` of the pool. If the load fails the pin is undone
        and the load's error raised."""
        self._check_open()
        key = self._catalog.resolve(name)
        self._bind()
        await self._catalog.set_pinned(key, True, actor=actor)
        try:
            await self._cache.wait_resident(key)
        except LorapageError as exc:
            if key in self._cache.entries:
                await self._catalog.set_pinned(
                    key, False, actor=actor, outcome=f"pin undone: its load failed ({exc.code})"
                )
            raise
        return self.info(key)

    async def unpin(self, name: str, *, actor: str | None = None) -> AdapterInfo:
        """Undo :meth:`pin`: the version stays resident, evictable by value again."""
        self._check_open()
        key = self._catalog.resolve(name)
        await self._catalog.set_pinned(key, False, actor=actor)
        return self.info(key)

    def check_pin(self, name: str) -> None:
        """Refuse (409 ``PinLimitError``, with the numbers) pinning ``name`` (``id`` or ``id@N``)
        past ``max_pinned_fraction`` of the pool; pins nothing."""
        self._cache.residency.pins.check(self._catalog.resolve(name))

    def pins_to_load(self) -> list[str]:
        """Pinned versions not resident yet (:meth:`restore_pins` starts their loads)."""
        return self._cache.residency.pins.to_load()

    async def restore_pins(self) -> list[str]:
        """Start loading every pinned version that is not resident (returns at once, with their
        keys). Pins restored from the registry load when the step loop first binds to an event
        loop: the first request or admin call, or this, which a server calls at startup."""
        self._check_open()
        self._bind()
        return self._cache.restore_pins()
