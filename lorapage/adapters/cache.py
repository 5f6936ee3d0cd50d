"""The tiered adapter cache: registered versions, and their loads carried out without blocking the step loop.

Every method runs on the engine's event loop, which owns this state. Where a version lives and
what leaves is decided by the residency rules (:class:`~lorapage.adapters.residency.Residency`,
shared with the simulator), which readers ask directly; this module registers versions (once
:class:`~lorapage.adapters.checks.AdapterChecks` accepted them) and carries the rules' decisions
out: file reads and parsing in an I/O thread pool, copies into pool pages on the device's thread
(:class:`~lorapage.adapters.loader.AdapterLoader`), each reported back to the rules when done.
A request for a non-resident version only starts (or joins) a load; the scheduler admits it once
:meth:`~lorapage.adapters.residency.Residency.is_ready` says so.

A load that fails fails the requests waiting for it with an error of its kind but no detail
(paths, source URIs and digests are the operator's: the log has them); an admin's load or pin
gets the detail.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lorapage.adapters.checks import AdapterChecks, AdapterInfo
from lorapage.adapters.decisions import Cancel, Decision, DropHost, Evict, Load, Prefetch, Read, Ready, Release, Yield
from lorapage.adapters.envelope import Envelope
from lorapage.adapters.layout import AdapterLayout
from lorapage.adapters.loader import AdapterLoader, Origin
from lorapage.adapters.metrics import AdapterMetrics
from lorapage.adapters.peft_format import AdapterSpec
from lorapage.adapters.residency import Residency
from lorapage.adapters.value import LoadTier
from lorapage.errors import AdapterLoadError, AdapterNotFoundError, ConflictError, LorapageError
from lorapage.memory.pool import PagePool
from lorapage.model.config import ModelConfig

MIN_RECHECK_S = 0.001  # a timer for a waiting load never fires sooner than this

log = logging.getLogger("lorapage.adapters")


@dataclass(eq=False)
class AdapterEntry:
    """One registered version: what it is and where its files come from (where it is lives in
    :class:`~lorapage.adapters.residency.Residency`)."""

    name: str
    spec: AdapterSpec
    layout: AdapterLayout
    digest: str = ""  # content digest the files must match when read ("" : not checked)
    origin: Origin = field(default_factory=Origin)
    error: LorapageError | None = None  # the last load failure, with the detail (for an admin)
    # This registration's identity in prefix-cache keys: a new registration under the same name
    # (other weights) never reuses the old one's cached KV blocks.
    cache_id: bytes = field(default_factory=lambda: uuid.uuid4().bytes)


class AdapterCache:
    """Registered versions, their host-RAM copies and the loads the residency rules decide.
    Only versions inside the shared serving ``envelope`` are registered; ``landed(digest)`` says
    whether a remote source's files are in the disk cache."""

    def __init__(
        self,
        model: ModelConfig,
        pool: PagePool,
        residency: Residency,
        loader: AdapterLoader,
        *,
        max_lora_rank: int,
        envelope: Envelope,
        on_ready: Callable[[], None],
        clock: Callable[[], float],
        sequence_pages: int = 0,
        metrics: AdapterMetrics | None = None,
        landed: Callable[[str], bool] = lambda digest: False,
        timer: Callable[[], float] = time.perf_counter,
        layout_model: ModelConfig | None = None,
    ) -> None:
        """``layout_model``: the model an adapter's pages are laid out for (a tensor-parallel
        rank's shard, :func:`lorapage.parallel.shard_config`); None: ``model``."""
        self.model, self.pool, self.residency, self.loader = model, pool, residency, loader
        self.checks = AdapterChecks(model, pool, loader, max_lora_rank, envelope, sequence_pages, layout_model)
        self.costs = loader.costs
        self._on_ready, self._clock, self._landed, self._timer = on_ready, clock, landed, timer
        self.metrics = metrics or AdapterMetrics()
        self.entries: dict[str, AdapterEntry] = {}
        self._host: dict[str, torch.Tensor] = {}  # key -> packed [L, pages * adapter_page_size] (the rules' LRU)
        self._staged: dict[str, torch.Tensor] = {}  # packed copies of loads waiting for room (kept off the LRU)
        self._load_meta: dict[str, tuple[LoadTier, float]] = {}  # key -> (tier its load started from, read s)
        self._reads: dict[str, asyncio.Task[None]] = {}
        self._prefetches: dict[str, asyncio.Task[None]] = {}
        self._copies: set[asyncio.Task[None]] = set()  # held here: the loop keeps only weak references
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}  # admin loads waiting for residency
        self._failed: dict[str, LorapageError] = {}  # loads that failed since the engine last looked
        self._rechecks = Rechecks(residency, clock, self._apply)

    # -- registry -------------------------------------------------------------------------------

    def add(
        self, name: str, spec: AdapterSpec, layout: AdapterLayout, digest: str = "", origin: Origin | None = None
    ) -> AdapterInfo:
        """Register a version :meth:`AdapterChecks.validate` accepted; its files are held to ``digest`` (its
        content digest, when known) at every read, and read from ``origin`` (default: the
        directory its spec names)."""
        if name in self.entries:
            raise ConflictError(f"adapter {name!r} is already registered", param="name")
        origin = origin or Origin()
        remote = bool(origin.source) and not origin.source.startswith("file:") and not self._landed(digest)
        # Its packed host copy is its pages' bytes: [layers, pages x adapter page] of the adapters' dtype.
        host_bytes = self.model.num_layers * layout.num_pages * self.pool.page_size * self.pool.storage.element_size()
        self.residency.add(name, layout.num_pages, LoadTier.REMOTE if remote else LoadTier.DISK, host_bytes)
        self.entries[name] = AdapterEntry(name, spec, layout, digest=digest, origin=origin)
        return self.info(name)

    def drop_host_copies(self) -> None:
        """Let go of every packed copy (the engine closed): their buffers go back to the process's
        host arena (:mod:`lorapage.memory.host`) now, not when a garbage collection finds this engine."""
        self._host.clear()
        self._staged.clear()

    def set_owner(self, name: str, owner: str | None) -> None:
        """Version ``name``'s id changed hands: its reads go through ``owner``'s roots and slots."""
        entry = self.get(name)
        entry.origin = Origin(entry.origin.source, owner)

    def set_source(self, name: str, source: str) -> None:
        """Version ``name``'s content was registered again from ``source``: its reads go there."""
        entry = self.get(name)
        entry.origin = Origin(source, entry.origin.owner)

    def unregister(self, name: str) -> None:
        """Forget an adapter. Refused while requests for it are queued or running."""
        self.get(name)
        self._apply(self.residency.remove(name, self._clock()))
        del self.entries[name]
        self._staged.pop(name, None)  # a load that waited for room
        self._load_meta.pop(name, None)
        self.metrics.forget_load(name)
        self._fail_waiters(name, AdapterNotFoundError(f"adapter {name!r} was removed", param="model"))
        self._rechecks.soon()

    def get(self, name: str) -> AdapterEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise AdapterNotFoundError(f"adapter {name!r} does not exist", param="model") from None

    def info(self, name: str) -> AdapterInfo:
        e = self.get(name)
        return dataclasses.replace(
            self.checks.spec_info(name, e.spec),
            num_pages=e.layout.num_pages,
            tier=self.residency.tier(name),
            pinned=self.residency.get(name).pinned,
            status=self.status(name),
            kept_hot=self.residency.get(name).hot,
        )

    def status(self, name: str) -> str:
        """``resident`` (in the pool), ``loading``, ``failed`` (its last load; a request retries)
        or ``available`` (loads on demand)."""
        if self.residency.is_resident(name):
            return "resident"
        if name in self.residency.loads:
            return "loading"
        return "failed" if self.get(name).error is not None else "available"

    # -- the requests a version serves (the step planner's calls) -----------------------------

    def enqueue(self, name: str, now: float, tenant: str | None = None) -> None:
        """A request for ``name`` (from ``tenant``) arrived: its load starts now, so fetching
        overlaps queueing, and the tenant's other recent versions are prefetched into host RAM."""
        self.metrics.record_request(name, self.residency.tier(name), now, tenant)
        self._apply(self.residency.enqueue(name, now, tenant))
        self._rechecks.soon()  # a pre-warm waiting for a slot is demand now

    def dequeue(self, name: str) -> None:
        """A queued request for ``name`` left without running (aborted, or its load failed)."""
        self.residency.dequeue(name)
        self._rechecks.soon()  # the version may now be evictable for a waiting load

    def admit(self, name: str, now: float) -> int:
        """A queued request for ``name`` is admitted at ``now``: its lora slot. The first since
        the version became resident starts its turn, the time from which it may be made to yield."""
        started = self.residency.get(name).turn_since is None
        slot = self.residency.admit(name, now)
        if started:
            self._rechecks.soon()  # a starving load may wait on this turn's end: arm its timer
        return slot

    def finish(self, name: str | None) -> None:
        """An admitted request (of ``name``, or of the base) ended: its pages are free."""
        if name is not None:
            self.residency.finish(name)
        self._rechecks.soon()

    def requeue(self, name: str) -> None:
        """An admitted request for ``name`` goes back to the queue (preempted, or its admission undone)."""
        self.residency.requeue(name)
        self._rechecks.soon()

    def memory_freed(self) -> None:
        """KV pages went back to the pool: a load waiting for room looks again."""
        self._rechecks.soon()

    def room_for_kv(self, pages_needed: int, *, reserve: bool = True) -> bool:
        """Whether ``pages_needed`` KV pages can be had now, giving back idle cached blocks and
        idle adapters (one ranking) when the free pages fall short; with ``reserve``, beyond the
        pages kept for the loads waiting on memory (:meth:`~lorapage.adapters.loads.Loads.pending_pages`)."""
        need = pages_needed + (self.residency.loads.pending_pages() if reserve else 0)
        if self.pool.num_free >= need:
            return True
        self._apply(self.residency.reclaim(need, self._clock()))
        return self.pool.num_free >= need

    def take_failed(self) -> dict[str, LorapageError]:
        """Adapters whose load failed since the last call, with the error (their queued requests
        get it; a later request retries the load)."""
        failed, self._failed = self._failed, {}
        return failed

    # -- admin ----------------------------------------------------------------------------------

    def ensure(self, name: str) -> None:
        """Start making ``name`` resident if it is not (returns at once)."""
        self.get(name)
        self._apply(self.residency.ensure(name))
        self._rechecks.soon()

    async def wait_resident(self, name: str) -> None:
        """Load ``name`` and wait until it is resident (admin pre-warm); its load's error if it fails."""
        self.ensure(name)
        if self.residency.is_resident(name):
            return
        done = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(name, []).append(done)
        try:
            await done
        finally:
            if done in self._waiters.get(name, ()):
                self._waiters[name].remove(done)

    def unload(self, name: str) -> bool:
        """Drop ``name`` from the pool if no request is running on it; True if it was resident."""
        self.get(name)
        decisions = self.residency.unload(name, self._clock())
        self._apply(decisions)
        self._rechecks.soon()
        return any(isinstance(d, Evict) for d in decisions)

    def pin(self, name: str) -> None:
        """An admin pins ``name`` resident: never evicted nor made to yield from now on. This does
        not start its load: the caller does (:meth:`ensure`) on the engine's loop, and
        :meth:`rebind_loop` does for every pinned version when the engine starts on a loop."""
        self._apply(self.residency.pin(name))
        self._rechecks.soon()

    def unpin(self, name: str) -> None:
        """Undo :meth:`pin`: ``name`` stays where it is, evictable by value again."""
        self.residency.unpin(name)
        self._rechecks.soon()  # it may be the idle adapter a waiting load needs

    def set_hot(self, names: list[str]) -> None:
        """The traffic tiers' hot versions, most requested first: kept resident within the pins'
        bounds (:meth:`Residency.set_hot`); their loads start."""
        self._apply(self.residency.set_hot(names))
        self._rechecks.soon()

    def prewarm(self, names: list[str]) -> None:
        """The traffic tiers' warm versions, most requested first: read into host RAM ahead of
        their requests (:meth:`Residency.prewarm`)."""
        self._apply(self.residency.prewarm(names))

    def restore_pins(self) -> list[str]:
        """Start loading every pinned version that is not resident; every pinned version's key."""
        pinned = self.residency.pins.pinned()
        for name in pinned:
            self.ensure(name)
        return pinned

    def rebind_loop(self) -> None:
        """The engine moved to a new event loop (or starts on its first): loads and prefetches
        started on the old one died with it, and the pinned adapters are loaded on this one."""
        self._reads.clear()
        self._prefetches.clear()
        self._copies.clear()
        self._staged.clear()
        self._waiters.clear()
        self._rechecks.forget()
        self._apply(self.residency.reset())

    # -- carrying out the rules' decisions ------------------------------------------------------

    def _apply(self, decisions: list[Decision]) -> None:
        for d in decisions:
            match d:
                case Read():
                    self._start_read(d)
                case Prefetch():
                    self._start_prefetch(d)
                case DropHost():
                    self._host.pop(d.key, None)
                case Load():
                    self._start_copy(d)
                case Evict():
                    self.loader.tables.clear_slot(d.slot)
                    self.metrics.record_eviction(d.key)
                case Release():
                    self.loader.tables.clear_slot(d.slot)
                case Ready():
                    self._ready(d.key)
                case Cancel():
                    self._cancel(d.key)
                case Yield():
                    pass  # it stops admitting: is_ready says so

    def _start_read(self, d: Read) -> None:
        entry = self.entries[d.key]
        entry.error = None
        self._failed.pop(d.key, None)  # a retry: the last failure no longer speaks for it
        packed = self._host.get(d.key)  # taken now: the LRU may drop it before the task runs
        self._reads[d.key] = asyncio.get_running_loop().create_task(self._read_for_load(entry, d.tier, packed))

    async def _read_for_load(self, entry: AdapterEntry, tier: LoadTier, packed: torch.Tensor | None) -> None:
        name, error = entry.name, None
        started = self._timer()
        try:
            if packed is None:
                packed = await self.loader.read(entry, tier, lambda: self.residency.downloaded(name))
        except LorapageError as e:
            error = e
        except Exception as e:  # a bad file must fail its own requests, not the engine
            error = AdapterLoadError(f"adapter {name!r} failed to load: {e}")
        if self._reads.get(name) is not asyncio.current_task():
            return  # unregistered meanwhile, or its event loop was left
        del self._reads[name]
        if error is not None or packed is None:
            self._load_failed(entry, error or AdapterLoadError(f"adapter {name!r} failed to load"))
            return
        self._host[name] = self._staged[name] = packed
        self._load_meta[name] = (tier, self._timer() - started)
        self._apply(self.residency.read_done(name, self._clock()))
        self._rechecks.arm()

    def _start_prefetch(self, d: Prefetch) -> None:
        task = asyncio.get_running_loop().create_task(self._prefetch(self.entries[d.key]))
        self._prefetches[d.key] = task

    async def _prefetch(self, entry: AdapterEntry) -> None:
        """Read and pack ``entry`` into host RAM (a failure is counted; a load that joined the
        prefetch then reads for itself and reports the error)."""
        packed = None
        try:
            packed = await self.loader.read(entry, LoadTier.DISK)
        except asyncio.CancelledError:
            raise
        except Exception:
            pass
        finally:
            mine = self._prefetches.get(entry.name) is asyncio.current_task()
            if mine:
                del self._prefetches[entry.name]
        if not mine:
            return
        if packed is not None and self.entries.get(entry.name) is entry:
            self._host[entry.name] = packed
        self._apply(self.residency.prefetch_done(entry.name, packed is not None))

    def _start_copy(self, d: Load) -> None:
        entry = self.entries[d.key]
        packed = self._staged.pop(d.key)
        task = asyncio.get_running_loop().create_task(self._copy(entry, packed, d.slot, list(d.pages)))
        self._copies.add(task)
        task.add_done_callback(self._copies.discard)

    async def _copy(self, entry: AdapterEntry, packed: torch.Tensor, slot: int, pages: list[int]) -> None:
        """The copy into the pool. Never cancelled: its slot and pages go back only once it is
        done (earlier, it could overwrite pages already handed to someone else)."""
        name, error = entry.name, None
        try:
            copy_s = await self.loader.copy_in(entry.layout, packed, slot, pages)
        except LorapageError as e:
            error = e
        except Exception as e:
            error = AdapterLoadError(f"adapter {name!r} failed to load: {e}")
        now = self._clock()
        decisions = self.residency.copy_done(name, slot, error is None, now)
        if error is None and self.entries.get(name) is entry:
            tier, read_s = self._load_meta.pop(name, (LoadTier.RAM, 0.0))
            nbytes = packed.numel() * packed.element_size()
            self.metrics.record_load(name, tier.value, read_s + copy_s, nbytes, now)
        self._apply(decisions)
        if error is not None and self.entries.get(name) is entry:
            self._fail(entry, error)
        self._on_ready()
        self._rechecks.soon()  # a new resident adapter may yield to a starving load

    def _load_failed(self, entry: AdapterEntry, error: LorapageError) -> None:
        self._apply(self.residency.load_failed(entry.name))
        self._fail(entry, error)
        self._on_ready()

    def _fail(self, entry: AdapterEntry, error: LorapageError) -> None:
        """Record a failed load: the detail for the log and an admin waiting on it, the kind alone
        for the requests that needed it."""
        log.warning("adapter %s failed to load: %s", entry.name, error.message)
        entry.error = error
        self._staged.pop(entry.name, None)
        self._load_meta.pop(entry.name, None)
        self.metrics.forget_load(entry.name)  # the next load is charged to whoever asks for it then
        self._failed[entry.name] = for_requests(entry.name, error)
        self._fail_waiters(entry.name, error)

    def _ready(self, name: str) -> None:
        for done in self._waiters.pop(name, ()):
            if not done.done():
                done.set_result(None)
        self._on_ready()

    def _fail_waiters(self, name: str, error: LorapageError) -> None:
        for done in self._waiters.pop(name, ()):
            if not done.done():
                done.set_exception(error)

    def _cancel(self, name: str) -> None:
        for tasks in (self._reads, self._prefetches):
            task = tasks.pop(name, None)
            if task is not None:
                task.cancel()
        self._staged.pop(name, None)


class Rechecks:
    """When the residency rules look again at the loads waiting for room: soon after anything
    that may have made room, and when a waiting load's patience runs out (or a busy adapter may
    yield). ``apply`` carries out what the rules then decide."""

    def __init__(
        self, residency: Residency, clock: Callable[[], float], apply: Callable[[list[Decision]], None]
    ) -> None:
        self._residency, self._clock, self._apply = residency, clock, apply
        self._soon: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None

    def soon(self) -> None:
        """Something may have made room: the rules look at the waiting loads once this call's work
        is done (a preemption that freed pages for a decode must not see them taken first)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop yet: rebind_loop looks when the engine starts on one
            return
        if self._soon is None and self._residency.loads.loading():
            self._soon = loop.call_soon(self._look)

    def arm(self) -> None:
        """Look again when a waiting load's patience runs out (or a busy adapter may yield)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        now = self._clock()
        at = self._residency.loads.next_check(now)
        if at is not None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(max(at - now, MIN_RECHECK_S), self._look)

    def forget(self) -> None:
        """The event loop the looks were on is gone (and its handles with it)."""
        self._soon = self._timer = None

    def _look(self) -> None:
        self._soon = None
        self._apply(self._residency.tick(self._clock()))
        self.arm()


def for_requests(name: str, error: LorapageError) -> LorapageError:
    """What a request that needed version ``name`` is told of its failed load: the same kind of
    error (status and code), without the paths, source URIs and digests its message holds, which
    are the operator's (the original is its ``__cause__``, and in the log)."""
    public = copy.copy(error)
    public.message = f"adapter {name} could not be loaded ({error.code}); the server's log has the detail"
    public.args = (public.message,)
    public.param = "model"
    public.__cause__ = error
    return public
