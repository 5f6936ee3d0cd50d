"""The engine replica: one :class:`~lorapage.Engine` in one Ray Serve replica.

It does no HTTP and no auth: the ingress sends it checked, tokenized :class:`EngineJob` records
and it streams back the engine's outputs. Its adapters are a mirror of the fleet's registry (held
by the ingress, :mod:`lorapage.fleet.registry`): every ``sync_period_s`` it sends a
:class:`Heartbeat` (the generation it has, its stats and engine series) and applies the reply
(ids changed, admin unloads, tenant shares, pre-warms); a job for a version it does not know yet makes it
sync first. Ray Serve calls :meth:`EngineReplica.record_routing_stats` every
``request_routing_stats_period_s``; what it returns (adapters by tier, requests in flight, batch
capacity) reaches the ingress's request router as ``RunningReplica.routing_stats``.

Downloads land in a disk cache of the replica's own (a fresh directory, removed when the replica
stops): two engines never share one, whose eviction each would make behind the other's back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from ray import serve
from ray.serve.handle import DeploymentHandle

from lorapage.adapters.cache import AdapterInfo
from lorapage.adapters.names import parse_name
from lorapage.bases.check import Reference, candidate_drifts, references
from lorapage.bases.drift import PromptDrift
from lorapage.bases.validation import drop_check_version
from lorapage.config import EngineConfig
from lorapage.engine import Engine
from lorapage.errors import (
    AdapterEnvelopeError,
    AdapterNotFoundError,
    AdapterTokensOverSharedLimitError,
    LorapageError,
)
from lorapage.fleet.config import APP_NAME, INGRESS_DEPLOYMENT
from lorapage.fleet.messages import EngineJob, EngineProfile, Heartbeat, IdState, ReplicaStart, SyncReply
from lorapage.frontend.metrics import register_engine_collectors
from lorapage.registry.prepare import PreparedVersion
from lorapage.request import RequestOutput
from lorapage.sources import AdapterRoots
from lorapage.usage.ledger import Key, Usage

log = logging.getLogger("lorapage.fleet")


class EngineReplica:
    """An engine mirroring the fleet's adapters, serving :class:`EngineJob` streams."""

    def __init__(
        self, config: EngineConfig, sync_period_s: float = 1.0, adapter_roots: AdapterRoots | None = None
    ) -> None:
        self._cache_dir = tempfile.mkdtemp(prefix="lorapage-replica-cache-")
        self.engine = Engine(
            dataclasses.replace(config, state_dir=None, adapter_cache_dir=config.adapter_cache_dir or self._cache_dir),
            adapter_roots=adapter_roots,
        )
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._tiers = self.engine.admin.tiers
        self._tiers.follow()  # the ingress judges the fleet's tiers from every replica's counts
        self.in_flight = 0
        self.sync_period_s = sync_period_s
        self._metrics = CollectorRegistry()
        seen = self.engine.metrics()
        register_engine_collectors(self._metrics, seen.stats, seen.scheduler, seen.vtc_counters, seen.adapters)
        self._epoch, self._generation = "", 0
        self._deferred: dict[str, IdState] = {}  # ids whose busy versions could not be dropped yet
        self._weights: dict[str, float] = {}
        self._sync_lock = asyncio.Lock()
        self._syncing: asyncio.Task | None = None
        self._prewarming: set[asyncio.Task] = set()  # pre-warm loads under way (held so they are not collected)
        self._prewarms_settled = 0  # pre-warm loads done or failed: a joining replica takes traffic after them
        self._ingress: DeploymentHandle | None = None

    def __del__(self) -> None:
        shutil.rmtree(getattr(self, "_cache_dir", ""), ignore_errors=True)

    def profile(self) -> EngineProfile:
        return EngineProfile(
            self.engine.base_name, self.engine.max_model_len, self.engine.model_config.vocab_size, self.engine.digest
        )

    # -- requests ---------------------------------------------------------------------------------

    async def generate(self, job: EngineJob) -> AsyncIterator[ReplicaStart | RequestOutput | LorapageError]:
        """:class:`ReplicaStart`, then the engine's outputs; a refusal is yielded (not raised) so it
        reaches the ingress as the error it is rather than wrapped in Ray's task error. Cancelling
        the stream (the client went away) closes the engine's generator, which aborts the request."""
        try:
            # The ingress resolved the version (id@N); one the mirror lacks was registered since its last sync.
            key = await self._serving_key(job.adapter) if job.adapter is not None else None
        except LorapageError as exc:
            yield ReplicaStart(self.replica_id)
            yield _in_fleet(exc, job.adapter)
            return
        yield ReplicaStart(self.replica_id, parse_name(key)[1] if key is not None else None)
        self.in_flight += 1
        try:
            outputs = self.engine.generate(
                job.prompt,
                key,
                job.sampling,
                tenant=job.tenant,
                request_id=job.request_id,
                prefix_group=job.prefix_group,
            )
            async for out in outputs:
                yield out
        except LorapageError as exc:
            yield _in_fleet(exc, job.adapter)
        finally:
            self.in_flight -= 1

    async def _serving_key(self, name: str) -> str:
        self._start_syncing()
        try:
            return self.engine.admin.catalog.resolve_version(name)
        except AdapterNotFoundError:
            await self.sync()
            return self.engine.admin.catalog.resolve_version(name)

    # -- admin work the ingress hands one replica -------------------------------------------------

    async def prepare_adapter(
        self,
        source: str,
        sha256: str | None,
        expected_base_digest: str | None,
        owner: str | None = None,
        envelope: bool = True,
    ) -> PreparedVersion | LorapageError:
        """Fetch and check an adapter for the fleet's registry, for ``owner`` (the error is
        returned, not raised); ``envelope`` False: one outside the shared envelope too (tier
        ``dedicated``, served once promoted)."""
        self._start_syncing()
        try:
            return await self.engine.admin.catalog.preparer.prepare(
                source, sha256=sha256, expected_base_digest=expected_base_digest, owner=owner, envelope=envelope
            )
        except LorapageError as exc:
            return exc

    async def describe(self, keys: list[str]) -> list[AdapterInfo | LorapageError]:
        """What this replica's engine knows of versions ``keys`` (syncing first when it lacks one)."""
        self._start_syncing()
        if not all(self.engine.admin.has_version(k) for k in keys):
            await self.sync()
        return [self._info(k) for k in keys]

    def _info(self, key: str) -> AdapterInfo | LorapageError:
        try:
            return self.engine.admin.info(key)
        except AdapterEnvelopeError:  # tier dedicated: refused here, served by its dedicated deployment
            return self.engine.admin.dedicated_info(key)
        except LorapageError as exc:
            return exc

    async def load_adapter(self, key: str) -> AdapterInfo | LorapageError:
        """Pre-warm version ``key`` into this replica's pool (the router sent it to an owner)."""
        try:
            await self._serving_key(key)
            await self.engine.admin.load(key)
        except LorapageError as exc:
            return exc
        return self._info(key)

    async def check_pin(self, key: str) -> LorapageError | None:
        """Whether pinning ``key`` fits (every replica has the same pool, pins and adapters)."""
        try:
            await self._serving_key(key)
            self.engine.admin.check_pin(key)
        except LorapageError as exc:
            return exc
        return None

    # -- a base upgrade's drift check (lorapage.fleet.upgrades) -----------------------------------

    async def drift_references(self, key: str, prompts: list[str], max_tokens: int) -> list[Reference] | LorapageError:
        """The check's first half on this replica's (running) base: version ``key`` greedy on each prompt."""
        try:
            await self._serving_key(key)
            return await references(self.engine, key, prompts, max_tokens=max_tokens)
        except LorapageError as exc:
            return exc

    async def drift_candidate(
        self, key: str, name: str, target: str, refs: list[Reference]
    ) -> list[PromptDrift] | LorapageError:
        """The check's second half on this replica's (new) base ``target``: version ``key``'s files
        registered here as ``name``, bound to this base for the check alone, and removed after it."""
        self._start_syncing()
        try:
            try:
                self.engine.admin.catalog.row(key)
            except AdapterNotFoundError:  # registered since this replica's last heartbeat
                await self.sync()
            async with self.engine.admin.catalog.version_files(key) as path:
                await self.engine.admin.catalog.register_checked(name, path, expected_base_digest=target)
            try:
                return await candidate_drifts(self.engine, name, refs)
            finally:
                drop_check_version(self.engine, name)
        except LorapageError as exc:
            return exc

    # -- the mirror -------------------------------------------------------------------------------

    def _start_syncing(self) -> None:
        if self._syncing is None or self._syncing.done():
            self._syncing = asyncio.get_running_loop().create_task(self._sync_forever())

    async def _sync_forever(self) -> None:
        while True:
            try:
                await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the ingress is (re)starting: keep serving the mirror as it is
                log.warning("replica %s could not sync with the ingress: %s", self.replica_id, exc)
            await asyncio.sleep(self.sync_period_s)

    async def sync(self) -> None:
        """One heartbeat to the ingress, and its reply applied."""
        async with self._sync_lock:
            beat = Heartbeat(
                self.replica_id,
                self._epoch,
                self._generation,
                self.engine.stats(),
                generate_latest(self._metrics),
                self.engine.digest,
                traffic=self._tiers.usage.take_traffic(),
                tiers_judged=self._tiers.judged,
            )
            if self._ingress is None:
                self._ingress = serve.get_deployment_handle(INGRESS_DEPLOYMENT, app_name=APP_NAME)
            try:
                reply: SyncReply = await self._ingress.sync.remote(beat)
            except BaseException:  # not counted at the ingress: the next heartbeat reports them
                self._tiers.usage.restore_traffic(beat.traffic)
                raise
            await self._apply(reply)

    async def _apply(self, reply: SyncReply) -> None:
        if reply.full:
            listed = {s.adapter_id for s in reply.ids}
            gone = [IdState(i, None, None, ()) for i in self.engine.admin.catalog.index.ids() if i not in listed]
            self._deferred.clear()
        else:
            gone = []
        for state in self._mirror([*self._deferred.values(), *reply.ids, *gone]):
            self._deferred[state.adapter_id] = state
        self._epoch, self._generation = reply.epoch, reply.generation
        if self.engine.admin.pins_to_load():
            await self.engine.admin.restore_pins()  # start the loads of new pins
        for key in reply.unloads:
            try:
                await self.engine.admin.unload(key)
            except LorapageError as exc:
                log.info("replica %s kept %s resident: %s", self.replica_id, key, exc.message)
        for key in reply.prewarms:  # not awaited: a load may take seconds, and the heartbeat goes on
            task = asyncio.get_running_loop().create_task(self._prewarm(key))
            self._prewarming.add(task)
            task.add_done_callback(self._prewarming.discard)
        if reply.tiers is not None:  # the fleet's tiers, judged at the ingress: hot kept resident, warm read in
            self._tiers.apply(reply.tiers)
            self._tiers.judged = reply.tiers_judged
        if reply.tenant_weights != self._weights:
            self._weights = dict(reply.tenant_weights)
            self.engine.set_tenant_weights(self._weights)

    async def _prewarm(self, key: str) -> None:
        """Load ``key`` into the pool ahead of its requests: the router made this replica one of its owners."""
        try:
            await self.engine.admin.load(key)
        except LorapageError as exc:
            log.info("replica %s did not pre-warm %s: %s", self.replica_id, key, exc.message)
        finally:
            self._prewarms_settled += 1

    def _mirror(self, states: Iterable[IdState]) -> list[IdState]:
        """Apply ``states`` (later ones win); the ones whose busy versions must be dropped later."""
        latest = {s.adapter_id: s for s in states}
        deferred = []
        for state in latest.values():
            self._deferred.pop(state.adapter_id, None)
            busy = self.engine.admin.catalog.mirror(state.adapter_id, state.owner, state.current, list(state.versions))
            if busy:
                deferred.append(state)
        return deferred

    async def usage_rows(self, since_hour: int | None) -> list[tuple[Key, Usage]]:
        """This replica's usage ledger (``Engine.usage_rows``), which the ingress sums over the
        replicas for ``GET /v1/usage``; the ingress routes the call here by replica id. Async, so
        it reads the ledger on the loop that owns it."""
        return self.engine.usage_rows(since_hour=since_hour)

    # -- what routing reads -----------------------------------------------------------------------

    async def record_routing_stats(self) -> dict[str, object]:
        """Adapters by tier (pool pages, host RAM, only on disk), requests in flight, batch capacity,
        tokens in flight, KV headroom and held adapter bytes. Async, so it reads the engine on the loop that owns it."""
        self._start_syncing()
        stats = self.engine.stats()
        pool = self._names(stats.resident_adapters)
        host = self._names(stats.host_ram_adapters) - pool
        disk = self._names(v.key for v in self.engine.admin.catalog.versions() if v.servable) - pool - host
        return {
            "pool": sorted(pool),
            "host": sorted(host),
            "disk": sorted(disk),
            "in_flight": self.in_flight,
            "capacity": self.engine.config.max_num_seqs,
            # The load that matters (affinity_load): work in tokens, KV headroom, held adapter bytes.
            "tokens_in_flight": stats.tokens_in_flight,
            "kv_free": stats.pool_pages_free / max(stats.pool_pages_total, 1),
            # Held of the lora slots' room (the simulator's held adapters over its slots), not of the
            # whole pool: KV pages are never adapter room, so the guard could not fire that way.
            "pinned_bytes": stats.adapter_held_pages * stats.pool_page_bytes,
            "adapter_room_bytes": stats.adapter_room_pages * stats.pool_page_bytes,
            # and of its lora slots: a slot fits a max-rank adapter, so slots can run out first.
            "held_slots": stats.adapter_held_slots,
            "slots": stats.adapter_slots,
            # The join sequence (lorapage.fleet.prewarm.JoinGate): traffic once its pre-warms settled.
            "prewarms_settled": self._prewarms_settled,
        }

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom metrics for :class:`~lorapage.fleet.autoscale.RayAutoscalingPolicy`:
        queue depth, tokens in flight and free KV fraction (``autoscale.METRICS``)."""
        stats = self.engine.stats()
        return {
            "queue_depth": float(stats.queue_depth),
            "tokens_in_flight": float(stats.tokens_in_flight),
            "kv_free": stats.pool_pages_free / max(stats.pool_pages_total, 1),
        }

    def _names(self, keys: Iterable[str]) -> set[str]:
        """Version keys as requests name them: ``id@N``, and ``id`` too for the current version."""
        names = set()
        for key in keys:
            names.add(key)
            adapter_id, _ = parse_name(key)
            try:
                if self.engine.admin.catalog.resolve_version(adapter_id) == key:
                    names.add(adapter_id)
            except LorapageError:
                pass
        return names


def _in_fleet(exc: LorapageError, adapter: str | None) -> LorapageError:
    """A refusal that sends an adapter to its dedicated tier (outside the envelope, or a long
    generation) names how this fleet gives it one; any other refusal as it is."""
    if adapter is None or not isinstance(exc, (AdapterEnvelopeError, AdapterTokensOverSharedLimitError)):
        return exc
    adapter_id = parse_name(adapter)[0]
    return type(exc)(
        f"{exc.message}. In this fleet an admin promotes it to a dedicated deployment: "
        f"POST /v1/adapters/{adapter_id}/promote",
        param=exc.param,
    )
