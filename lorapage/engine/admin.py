"""What an engine does with its adapters at run time, over its catalog: describe a version as it
is served (tier, residency, cost), pre-warm it and wait for its load, drop it, check a pin against
the bounds and restore pins, and read its traffic. An :class:`~lorapage.engine.engine.Engine`
holds one as ``engine.admin``; its :attr:`AdapterAdmin.catalog`
(:class:`~lorapage.registry.catalog.AdapterCatalog`) is where versions, aliases, channels, pins,
check prompts and the audit trail are kept: register, move an alias, pin (``set_pinned``: checked,
committed, applied), remove there. The admin verbs over both (a pin committed, then loaded, undone
if the load fails; a one-call rollback) are the one :class:`~lorapage.frontend.admin_ops.Admin`'s.
Every call that changes something is audited as ``actor``'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping

import torch

from lorapage.adapters.cache import AdapterCache, AdapterInfo
from lorapage.adapters.names import parse_name
from lorapage.engine.tiering import TierKeeper
from lorapage.omp_env import call_then_release
from lorapage.registry.catalog import AdapterCatalog, VersionInfo
from lorapage.registry.prepare import spec_from_json
from lorapage.registry.push import VersionPusher, config_of, encode
from lorapage.registry.store import TrafficRow


class AdapterAdmin:
    """An engine's adapters as it serves them, by name (``id``, ``id@N`` or ``id@channel``).
    Errors are :class:`~lorapage.errors.LorapageError`: a server answers them as they are (404
    unknown, 409 busy or refused, 400 bad input)."""

    def __init__(
        self,
        catalog: AdapterCatalog,
        cache: AdapterCache,
        tiers: TierKeeper,
        pusher: VersionPusher,
        *,
        check_open: Callable[[], None],
        bind: Callable[[], None],
    ) -> None:
        """``check_open`` refuses once the engine is closed, ``bind`` starts the step loop on the
        running event loop (loads need it)."""
        self.catalog = catalog
        """The engine's versions, aliases, channels, pins and their record."""
        self._cache, self._check_open, self._bind = cache, check_open, bind
        self.tiers = tiers
        """The traffic tiers (a fleet replica's follow the ingress's: :meth:`TierKeeper.follow`)."""
        self.wall_clock = tiers.wall_clock
        """Unix seconds by the engine's clock: the hours traffic and usage are counted in."""
        self.pusher = pusher
        """Versions pushed from memory: each id's staleness bound and the versions retired."""

    # -- describing -----------------------------------------------------------------------------

    def info(self, name: str) -> AdapterInfo:
        """What ``name`` (``id`` or ``id@N``) is served by now."""
        key = self.catalog.resolve_version(name)
        version = self.catalog.version(key)
        return dataclasses.replace(
            self._cache.info(key),
            traffic_tier=self.tiers.tier(key).value,
            adapter_id=version.adapter_id,
            version=version.version,
            digest=version.digest,
            source=version.source,
            current=version.current,
        )

    def dedicated_info(self, name: str) -> AdapterInfo:
        """What a version outside the shared envelope is (tier ``dedicated``: its requests are
        refused here), described from its stored spec; 404 when ``name`` names none."""
        row = self.catalog.row(name)
        return dataclasses.replace(
            self._cache.checks.spec_info(row.key, spec_from_json(row.spec)),
            adapter_id=row.adapter_id,
            version=row.version,
            digest=row.digest,
            source=row.source,
            current=self.catalog.version(row.key).current,
        )

    def served(self) -> list[AdapterInfo]:
        """The versions the aliases point at, one per id."""
        return [self.info(v.key) for v in self.catalog.versions() if v.current and v.servable]

    def has_version(self, key: str) -> bool:
        """Whether version ``key`` (``id@N``) is served by this engine (a mirror may lack it yet)."""
        return key in self._cache.entries

    async def traffic(self, adapter_id: str, hours: int = 25) -> list[TrafficRow]:
        """``adapter_id``'s traffic rows of the last ``hours`` hours (the one in progress
        included), per version and hour, counts not yet written included."""
        self._check_open()
        return await self.tiers.recent(adapter_id, hours)

    async def refresh_tiers(self) -> dict[str, str]:
        """Write the traffic counted since the last time and judge every version's traffic tier
        now (the engine does this every ``tier_interval_s``): hot versions are kept resident, warm
        ones read into host RAM. Returns the versions not cold, with their tier."""
        self._check_open()
        self._bind()
        states = await self.tiers.refresh()
        return {key: state.tier.value for key, state in states.items()}

    # -- pushed versions ---------------------------------------------------------------------------

    async def push(
        self,
        name: str,
        tensors: Mapping[str, torch.Tensor] | bytes,
        config: Mapping | None = None,
        *,
        max_staleness: int | None = None,
        owner: str | None = None,
        expected_base_digest: str | None = None,
        activate: bool = True,
        actor: str | None = None,
    ) -> VersionInfo:
        """A new version of ``name`` from memory: ``tensors`` (PEFT key naming, or safetensors
        bytes whose ``__metadata__`` may carry ``config``) and ``config`` (the adapter_config.json
        object), checked as a directory is, stored (:mod:`lorapage.registry.push`), loaded into
        the pool, then made current when ``activate``, atomically: requests already submitted keep
        the version they resolved, new ones get this one; nothing pauses. ``max_staleness`` k
        (kept for the id): requests naming a version older than current - k are refused (409), and
        older versions no request holds are retired. The same content is the same version."""
        self._check_open()
        self._bind()
        if isinstance(tensors, bytes):
            weights, config = tensors, config if config is not None else config_of(tensors)
        elif config is None:
            raise TypeError("push: give the adapter config with the tensors")
        else:
            # At a trainer's step rate: the default pool's thread keeps no OpenMP team (lorapage.omp_env).
            weights = await asyncio.to_thread(call_then_release, encode, tensors, config)
        adapter_id = parse_name(name)[0]
        if max_staleness is not None:
            self.pusher.set_staleness(adapter_id, max_staleness)
        async with self.pusher.serial(adapter_id):
            info = await self.pusher.store(
                name, weights, config, owner=owner, expected_base_digest=expected_base_digest, actor=actor
            )
            await self._cache.wait_resident(info.key)  # staged before it is current: no rollout waits for its load
            if activate and not info.current:
                info = await self.catalog.move(adapter_id, info.version, actor=actor)
            self.pusher.retire(adapter_id)
        return info

    # -- residency ------------------------------------------------------------------------------

    async def make_resident(self, key: str) -> None:
        """Load version ``key`` now and wait until it is resident (its load's error if it fails)."""
        self._check_open()
        self._bind()
        await self._cache.wait_resident(key)

    async def load(self, name: str, *, actor: str | None = None) -> str:
        """Make ``name`` resident in the pool now (pre-warm); audited once it is. Its version key."""
        self._check_open()
        key = self.catalog.resolve_version(name)
        await self.make_resident(key)
        await self.catalog.record("load", parse_name(key)[0], actor=actor, after={"version": parse_name(key)[1]})
        return key

    async def unload(self, name: str, *, actor: str | None = None) -> bool:
        """Drop ``name`` from the pool (its host-RAM copy stays), audited when it was resident.
        Refused while it is running or pinned."""
        self._check_open()
        self._bind()
        key = self.catalog.resolve_version(name)
        dropped = self._cache.unload(key)
        if dropped:
            await self.catalog.record("unload", parse_name(key)[0], actor=actor, after={"version": parse_name(key)[1]})
        return dropped

    def check_pin(self, name: str) -> None:
        """Refuse (409 ``PinLimitError``, with the numbers) pinning ``name`` (``id`` or ``id@N``)
        past ``max_pinned_fraction`` of the pool; pins nothing."""
        self._cache.residency.pins.check(self.catalog.resolve_version(name))

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
