"""The tiered adapter cache: disk -> host RAM -> pool pages, loaded without blocking the step loop.

Every method runs on the engine's event loop, which owns this state. File reads and parsing run
in an I/O thread pool; the copy into pool pages runs on the forward thread, between steps, so it
never races a forward pass. A request for a non-resident adapter only starts (or joins) a load;
the scheduler admits it once :meth:`AdapterCache.is_ready` says so.

Idle adapters and idle cached KV blocks leave the pool least valuable per page first, in one
ranking (:mod:`lorapage.adapters.value`: recent use rate x measured reload cost from the tier an
adapter would fall to / its pages, or x the cost of recomputing a block / its one page), except
those an admin pinned resident (:meth:`AdapterCache.pin_resident`), which never leave it nor
yield. A tenant's request prefetches the tenant's other recent adapters into host RAM when the
I/O pool has no load reading files (a load waiting on a download does not count), at most
:data:`PREFETCHES_PER_TENANT` of one tenant's at once.

A load that fails fails the requests waiting for it with an error of its kind but no detail
(paths, source URIs and digests are the operator's: the log has them); an admin's load or pin
gets the detail.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import torch

from lorapage.adapters.cost import AdapterCost
from lorapage.adapters.digest import bytes_digest
from lorapage.adapters.envelope import Envelope, ServingTier, describe_shape, refusal
from lorapage.adapters.layout import AdapterLayout, max_adapter_pages
from lorapage.adapters.metrics import AdapterMetrics
from lorapage.adapters.peft_format import (
    AdapterSpec,
    at_path,
    load_adapter_tensors,
    read_adapter_spec,
    read_config_bytes,
    read_weights,
)
from lorapage.adapters.safetensors_buffer import ReadBuffer
from lorapage.adapters.value import LoadTier, RecentAdapters, RecomputeCost, ReloadCosts, Stage, value_per_page
from lorapage.errors import (
    AdapterBusyError,
    AdapterFormatError,
    AdapterIntegrityError,
    AdapterLoadError,
    AdapterNotFoundError,
    ConflictError,
    LorapageError,
    PinLimitError,
)
from lorapage.memory.pool import PageKind, PagePool
from lorapage.memory.prefix_cache import HIT_HALF_LIFE_S, PrefixCache
from lorapage.model.config import ModelConfig
from lorapage.model.lora_tables import LoraTables

RATE_HALF_LIFE_S = HIT_HALF_LIFE_S  # how fast a request rate forgets: as cached blocks' (one currency)
MIN_RECHECK_S = 0.05  # a load with nothing to wait on looks again this often (adapter_wait_s may be 0)
EVICTION_WINDOW_S = 60.0  # evictions are remembered this long (for evictions per minute)
PREFETCH_QUEUE_LEN = 16  # prefetches waiting to start beyond this drop the oldest
PREFETCHES_PER_TENANT = 1  # one tenant's prefetches running at once: a slow one holds only its own

log = logging.getLogger("lorapage.adapters")


class LoadWait(Enum):
    """What a load that found no room waits for."""

    ROOM = "room"  # a lora slot is free but pages are short: until pages free
    YIELDED = "yielded"  # a busy adapter yields its slot to this load: until it is idle
    PATIENT = "patient"  # every slot busy for less than slot_wait_s: until one frees, or slot_wait_s
    STARVING = "starving"  # every slot busy for slot_wait_s, requests wait: in line to make one yield
    PREWARM = "prewarm"  # every slot busy and no request waits (a pre-warm): look again now and then


@dataclass(eq=False)
class AdapterEntry:
    """One registered adapter and where it currently is."""

    name: str
    spec: AdapterSpec
    layout: AdapterLayout
    digest: str = ""  # content digest the files must match when read ("" : not checked)
    slot: int = 0  # 0 = not resident in the pool
    pages: list[int] = field(default_factory=list)
    running: int = 0  # admitted requests using it: never evicted while > 0
    waiting: int = 0  # queued requests for it
    load_task: asyncio.Task | None = None
    error: LorapageError | None = None  # the last load failure, reported to its waiting requests
    rate: float = 0.0  # exponentially decayed request count
    rate_time: float = 0.0
    yielding: bool = False  # admits nothing new: a starving load takes its lora slot once it is idle
    pinned: bool = False  # an admin pinned it resident: never evicted, never made to yield
    resident_since: float = 0.0  # when it last became resident (it yields only after slot_wait_s)
    # This registration's identity in prefix-cache keys: a new registration under the same name
    # (other weights) never reuses the old one's cached KV blocks.
    cache_id: bytes = field(default_factory=lambda: uuid.uuid4().bytes)

    def touch(self, now: float) -> None:
        self.rate = self.rate_at(now) + 1.0
        self.rate_time = now

    def rate_at(self, now: float) -> float:
        return self.rate * math.exp2(-(now - self.rate_time) / RATE_HALF_LIFE_S)


@dataclass(frozen=True)
class AdapterInfo:
    """What callers (the server's admin routes, ``Engine.adapter_info``) see of an adapter."""

    name: str
    path: str
    rank: int
    target_modules: tuple[str, ...]
    size_bytes: int
    num_params: int
    num_pages: int
    tier: str  # gpu | ram | disk
    # The version this entry serves (filled in by the engine from the catalog).
    adapter_id: str = ""
    version: int = 0
    digest: str = ""
    source: str = ""
    current: bool = False
    created: bool = True  # False: a registration of content an existing version already had
    pinned: bool = False  # pinned resident by an admin (AdapterCache.pin_resident)
    cost: AdapterCost | None = None  # projected cost against the base (lorapage.adapters.cost)
    serving_tier: str = ServingTier.SHARED.value  # from its shape (lorapage.adapters.envelope)


class AdapterCache:
    """Registry, host-RAM LRU and pool residency of adapters, with value-per-page eviction,
    admin pins (bounded by ``max_pinned_fraction`` of the pool) and per-tenant prefetch into host
    RAM (at most ``max_prefetches`` reads at once; 0 turns it off). Only adapters inside the shared
    serving ``envelope`` are registered."""

    def __init__(
        self,
        model: ModelConfig,
        pool: PagePool,
        tables: LoraTables,
        *,
        max_loras: int,
        max_cpu_loras: int,
        max_lora_rank: int,
        slot_wait_s: float,
        dtype: torch.dtype,
        envelope: Envelope,
        io_executor: Executor,
        run_on_device: Callable[[Callable[[], None]], Awaitable[None]],
        on_ready: Callable[[], None],
        clock: Callable[[], float],
        idle_kv: PrefixCache | None = None,
        sequence_pages: int = 0,
        max_pinned_fraction: float = 0.5,
        max_prefetches: int = 1,
        metrics: AdapterMetrics | None = None,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.model, self.pool, self.tables = model, pool, tables
        self.max_cpu_loras, self.max_lora_rank, self.dtype = max_cpu_loras, max_lora_rank, dtype
        self.slot_wait_s, self.max_loras = slot_wait_s, max_loras
        self.envelope = envelope
        self._io, self._run_on_device, self._on_ready, self._clock = io_executor, run_on_device, on_ready, clock
        self._idle_kv = idle_kv  # the prefix cache, whose idle blocks compete with idle adapters for pages
        self.sequence_pages = sequence_pages  # KV pages of one full-length sequence: an adapter must fit beside it
        # Where a version's files are read from when it is not in host RAM: a block holding them
        # fetched and verified (the catalog's sources); None: the directory its spec names.
        self.locate: Callable[[str], AbstractAsyncContextManager[Path]] | None = None
        # Where a version's files come from when not in host RAM: DISK or REMOTE (a remote source
        # not in the disk cache); None: always DISK.
        self.cold_tier: Callable[[str], LoadTier] | None = None
        self.max_pinned_fraction, self.max_prefetches = max_pinned_fraction, max_prefetches
        self.metrics = metrics or AdapterMetrics()
        self._timer = timer  # wall time of loads, measured: the injected clock may be virtual
        page_bytes = pool.storage.shape[0] * pool.page_size * pool.storage.element_size()
        self.costs = ReloadCosts(page_bytes)
        # What losing an idle cached block costs (fed measured prefill timings by the engine).
        self.recompute = RecomputeCost(page_bytes, max(1, pool.page_size // (2 * model.kv_size)))
        self._max_adapter_pages = max_adapter_pages(model, max_lora_rank, pool.adapter_page_size)
        self.entries: dict[str, AdapterEntry] = {}
        # name -> packed [L, pages * adapter_page_size], in the adapters' dtype
        self._host: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._free_slots = list(range(max_loras, 0, -1))
        self._by_slot: dict[int, AdapterEntry] = {}
        self._memory_freed = asyncio.Event()
        self.evictions: deque[float] = deque()  # times of pool evictions in the last EVICTION_WINDOW_S
        self.yields = 0  # busy adapters made to yield their slot to a load that waited adapter_wait_s
        self._starving: list[AdapterEntry] = []  # loads past adapter_wait_s without a slot, in order
        self._failed: dict[str, LorapageError] = {}  # loads that failed since the engine last looked
        self._loading: set[AdapterEntry] = set()  # entries with a load task in flight
        self._recent = RecentAdapters()  # per tenant, its recent adapters: what to prefetch
        self._prefetch_queue: OrderedDict[str, str] = OrderedDict()  # names to prefetch, in order -> tenant
        self._prefetching: dict[str, asyncio.Task[torch.Tensor | None]] = {}  # name -> read to host RAM
        self._prefetch_tenants: Counter[str] = Counter()  # per tenant: its prefetches running
        self._downloading: set[str] = set()  # loads fetching from a source: they read no files meanwhile
        self.prefetches: Counter[str] = Counter()  # started, done, failed, dropped (queue full)
        self._read_buffer = ReadBuffer()  # each I/O thread's, reused by every load it reads
        self._finite_digests: set[str] = set()  # digests of bytes validate() found finite in self.dtype

    # -- registry -------------------------------------------------------------------------------

    def register(self, name: str, path: str) -> AdapterInfo:
        """Validate a PEFT directory against the base and register it (weights load lazily).
        Reads the whole adapter: use :meth:`validate` in a worker and :meth:`add` to keep the
        event loop free."""
        self.check_name_free(name)
        return self.add(name, *self.validate(path))

    def check_name_free(self, name: str) -> None:
        if name in self.entries:
            raise ConflictError(f"adapter {name!r} is already registered", param="name")

    def validate(self, path: str) -> tuple[AdapterSpec, AdapterLayout, str]:
        """Read and check an adapter directory: config, tensor names and shapes against the base,
        every weight finite, a shape inside the shared serving envelope and a size the pool can
        hold; with the content digest of the bytes checked (loads verify against it, so what they
        use is what was checked). Touches no engine state, so it may run in any thread."""
        spec = read_adapter_spec(path, self.model, self.max_lora_rank)
        self.check_envelope(spec)
        layout = self.plan(spec)
        weights = read_weights(spec)
        load_adapter_tensors(spec, self.dtype, weights)  # refuses NaN / Inf weights now, not at the first request
        digest = _digest(spec, weights)
        self._finite_digests.add(digest)
        return spec, layout, digest

    def check_envelope(self, spec: AdapterSpec) -> AdapterCost:
        """The adapter's projected cost; refused (400, with that cost and the allowed shapes) when
        its shape is outside the shared envelope. Its tier is then ``dedicated``, which only a
        dedicated deployment serves, and none exists yet: it is never shared silently."""
        cost = self.envelope.cost(spec.ranks)
        if self.envelope.tier(spec.ranks, cost) is ServingTier.DEDICATED:
            raise refusal(str(spec.path), self.envelope, spec.ranks, cost)
        return cost

    def plan(self, spec: AdapterSpec) -> AdapterLayout:
        """The adapter's page layout, refused when its pages cannot fit in the pool beside one
        full-length sequence's KV blocks: it could never serve a request here."""
        layout = AdapterLayout.plan(spec, self.model, self.pool.adapter_page_size)
        if layout.num_pages + self.sequence_pages > self.pool.capacity:
            page_bytes = self.pool.page_size * self.pool.storage.element_size()
            shape = describe_shape(spec.max_rank, spec.target_modules, self.model.num_layers)
            raise AdapterFormatError(
                f"adapter at {str(spec.path)!r} does not fit this server's pool: {shape} "
                f"(max_lora_rank {self.max_lora_rank}) needs "
                f"{layout.num_pages} pages of {page_bytes} bytes per layer; with {self.sequence_pages} pages for one "
                f"full-length sequence that is {layout.num_pages + self.sequence_pages}, and the pool has "
                f"{self.pool.capacity} pages. Use a lower rank or fewer modules, or ask the operator for a larger "
                "pool (--num-pages) or a shorter --max-model-len"
            )
        return layout

    def add(self, name: str, spec: AdapterSpec, layout: AdapterLayout, digest: str = "") -> AdapterInfo:
        """Register an adapter :meth:`validate` accepted; its files are held to ``digest`` (its
        content digest, when known) at every read."""
        self.check_name_free(name)
        self.entries[name] = AdapterEntry(name, spec, layout, digest=digest)
        return self.info(name)

    def unregister(self, name: str) -> None:
        """Forget an adapter. Refused while requests for it are queued or running."""
        entry = self.get(name)
        if entry.running or entry.waiting:
            raise AdapterBusyError(
                f"adapter {name!r} has {entry.running} running and {entry.waiting} queued requests; "
                "retry once they finish"
            )
        if entry.load_task is not None:
            entry.load_task.cancel()
        if (prefetch := self._prefetching.pop(name, None)) is not None:
            prefetch.cancel()
        self._prefetch_queue.pop(name, None)
        entry.pinned = False  # deleting a version drops its pin with it
        if entry.slot:
            self._evict(entry)
        self._host.pop(name, None)
        self._recent.forget(name)
        del self.entries[name]

    def get(self, name: str) -> AdapterEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise AdapterNotFoundError(f"adapter {name!r} does not exist", param="model") from None

    def tier(self, name: str) -> str:
        entry = self.get(name)
        return "gpu" if entry.slot else "ram" if name in self._host else "disk"

    def load_tier(self, name: str) -> LoadTier:
        """Where a load of ``name`` into the pool would start now (for a resident adapter: where
        it would fall to if evicted; its host copy stays)."""
        if name in self._host:
            return LoadTier.RAM
        return self.cold_tier(name) if self.cold_tier is not None else LoadTier.DISK

    def info(self, name: str) -> AdapterInfo:
        e = self.get(name)
        cost = self.envelope.cost(e.spec.ranks)
        return AdapterInfo(
            name=name,
            path=str(e.spec.path),
            rank=e.spec.max_rank,
            target_modules=e.spec.target_modules,
            size_bytes=e.spec.size_bytes,
            num_params=e.spec.num_params(self.model),
            num_pages=e.layout.num_pages,
            tier=self.tier(name),
            pinned=e.pinned,
            cost=cost,
            serving_tier=self.envelope.tier(e.spec.ranks, cost).value,
        )

    # -- residency ------------------------------------------------------------------------------

    def is_ready(self, name: str) -> bool:
        """Resident and taking requests (a yielding adapter takes none)."""
        entry = self.get(name)
        return entry.slot != 0 and not entry.yielding

    def ensure(self, name: str) -> None:
        """Start making ``name`` resident if it is not (returns at once)."""
        entry = self.get(name)
        if entry.slot or entry.load_task is not None:
            return
        entry.error = None
        self._failed.pop(name, None)  # a retry: the last failure no longer speaks for it
        entry.load_task = asyncio.get_running_loop().create_task(self._load(entry))
        self._loading.add(entry)

    async def wait_resident(self, name: str) -> None:
        """Load ``name`` and wait until it is resident (admin pre-warm)."""
        self.ensure(name)
        entry = self.get(name)
        if entry.load_task is not None:
            await asyncio.shield(entry.load_task)
        if entry.error is not None:
            raise entry.error

    def unload(self, name: str) -> bool:
        """Drop ``name`` from the pool if no request is running on it; True if it was resident."""
        entry = self.get(name)
        if entry.running:
            raise AdapterBusyError(f"adapter {name!r} has {entry.running} running requests")
        if entry.pinned:
            raise ConflictError(f"adapter {name!r} is pinned resident; unpin it first", param="id")
        if not entry.slot:
            return False
        self._evict(entry)
        return True

    # -- admin pins: an adapter held resident by an operator (not :meth:`pin`, which holds an
    # -- adapter for one admitted request)

    def pin_limit(self) -> int:
        """Pages admin pins may hold together: ``max_pinned_fraction`` of the pool, and never so
        many that one full-length sequence beside the largest adapter allowed no longer fits in
        the rest (requests could then wait forever for pages no one gives back)."""
        cap = self.pool.capacity
        room = cap - self.sequence_pages - self._max_adapter_pages
        return max(0, min(math.floor(self.max_pinned_fraction * cap), room))

    def pinned_pages(self) -> int:
        """Pool pages the pinned adapters take (loaded or not yet)."""
        return sum(e.layout.num_pages for e in self.entries.values() if e.pinned)

    def check_pin(self, name: str) -> None:
        """Refuse (:class:`~lorapage.errors.PinLimitError`, 409) pinning ``name`` past the
        bounds: pins hold at most :meth:`pin_limit` pages and leave one lora slot unpinned."""
        entry = self.get(name)
        if entry.pinned:
            return
        pinned = [e for e in self.entries.values() if e.pinned]
        held, asked, limit, cap = self.pinned_pages(), entry.layout.num_pages, self.pin_limit(), self.pool.capacity
        if held + asked > limit:
            raise PinLimitError(
                f"pinning {name} asks for {asked} pages; pins hold {held} pages and may hold {limit} of the "
                f"pool's {cap} (max_pinned_fraction {self.max_pinned_fraction:g} of the pool, leaving room for "
                f"one full-length sequence of {self.sequence_pages} pages beside the largest adapter, "
                f"{self._max_adapter_pages} pages); unpin an adapter or raise --max-pinned-fraction",
                param="id",
            )
        if len(pinned) + 1 >= self.max_loras:
            raise PinLimitError(
                f"pinning {name} would leave no unpinned lora slot: {len(pinned)} of the {self.max_loras} "
                "slots (--max-loras) are pinned and one must stay free for every other adapter; unpin an adapter",
                param="id",
            )

    def pin_resident(self, name: str) -> None:
        """An admin pins ``name`` resident: from now on it is never evicted nor made to yield (the
        bounds: :meth:`check_pin`). This does not start its load: the caller does
        (:meth:`ensure`) on the engine's loop, and :meth:`rebind_loop` does for every pinned
        adapter when the engine starts on a loop. Not :meth:`pin` (an admitted request's hold)."""
        self.check_pin(name)
        entry = self.get(name)
        entry.pinned = True
        if entry.yielding:  # the load it yielded to makes another adapter yield instead
            entry.yielding = False
            self.notify_memory_freed()
            self._on_ready()

    def unpin_resident(self, name: str) -> None:
        """Undo :meth:`pin_resident`: ``name`` stays where it is, evictable by value again. Not
        :meth:`unpin` (an admitted request's end)."""
        self.get(name).pinned = False
        self.notify_memory_freed()  # it may be the idle adapter a waiting load needs

    # -- the requests an adapter serves: queued (``waiting``) and admitted (``running``) -----------

    def enqueue(self, name: str, now: float, tenant: str | None = None) -> None:
        """A request for ``name`` (from ``tenant``) arrived: count it as queued, note the
        traffic, and start the load now, so fetching overlaps queueing. The tenant's other
        recent adapters are prefetched into host RAM (see :meth:`_prefetch_for`)."""
        entry = self.get(name)
        self.metrics.record_request(name, self.tier(name), now)
        entry.waiting += 1
        entry.touch(now)
        self.ensure(name)
        if tenant is not None:
            self._prefetch_for(tenant, name, now)

    def dequeue(self, name: str) -> None:
        """A queued request for ``name`` left without running (aborted, or its load failed)."""
        self.get(name).waiting -= 1
        self.notify_memory_freed()  # the adapter may now be evictable for a waiting load

    def pin(self, name: str) -> int:
        """A queued request for ``name`` is admitted: pin the adapter resident for it (it is
        never evicted while pinned) and return its lora slot."""
        entry = self.get(name)
        if not entry.slot:
            raise RuntimeError(f"adapter {name!r} admitted while not resident")  # an engine bug, never silent
        entry.running += 1
        entry.waiting -= 1
        return entry.slot

    def unpin(self, name: str) -> None:
        """An admitted request for ``name`` finished."""
        self.get(name).running -= 1

    def requeue(self, name: str) -> None:
        """An admitted request for ``name`` goes back to the queue (preempted, or its admission
        undone): unpinned, and queued again."""
        entry = self.get(name)
        entry.running -= 1
        entry.waiting += 1

    def pending_pages(self) -> int:
        """Pages to keep free for the largest load waiting on memory, so KV demand cannot starve
        it. Zero when that load could not proceed anyway (no slot to take, or more pages than
        freeing the whole KV cache would give): reserving then would only block admission."""
        waiting = [e for e in self._loading if e.waiting or e.pinned]  # a pin is demand too
        if not waiting:
            return 0
        need = max(e.layout.num_pages for e in waiting)
        # Idle adapters can be evicted now; yielding ones will be, for the load they yield to.
        freeable = self._evictable() + [e for e in self._by_slot.values() if e.yielding]
        attainable = self.pool.num_free + self.pool.used[PageKind.KV] + sum(e.layout.num_pages for e in freeable)
        return need if (self._free_slots or freeable) and need <= attainable else 0

    def take_failed(self) -> dict[str, LorapageError]:
        """Adapters whose load failed since the last call, with the error (their queued requests
        get it; a later request retries the load)."""
        failed, self._failed = self._failed, {}
        return failed

    def rebind_loop(self) -> None:
        """The engine moved to a new event loop (or starts on its first): loads and prefetches
        started on the old one died with it, and the pinned adapters are loaded on this one."""
        self._memory_freed = asyncio.Event()
        for entry in self._loading:
            entry.load_task = None
        self._loading.clear()
        self._starving.clear()
        self._prefetching.clear()
        self._prefetch_tenants.clear()
        self._prefetch_queue.clear()
        for entry in self.entries.values():  # yielding to a load that died with the old loop
            entry.yielding = False
        for entry in list(self.entries.values()):
            if entry.pinned:
                self.ensure(entry.name)

    def notify_memory_freed(self) -> None:
        self._memory_freed.set()

    def value_per_page(self, entry: AdapterEntry, now: float) -> float:
        """What ``entry``'s pool pages are worth: its recent request rate x the measured cost of
        reloading it from the tier it would fall to / its pages."""
        pages = entry.layout.num_pages
        return value_per_page(entry.rate_at(now), self.costs.reload_s(self.load_tier(entry.name), pages), pages)

    def _evictable(self) -> list[AdapterEntry]:
        """Resident adapters nobody runs or waits for and no admin pinned, least valuable per
        page first."""
        return [e for _, e in self._ranked_idle(self._clock())]

    def _ranked_idle(self, now: float) -> list[tuple[float, AdapterEntry]]:
        """:meth:`_evictable` with each one's value per page at ``now``."""
        idle = [e for e in self._by_slot.values() if e.running == 0 and e.waiting == 0 and not e.pinned]
        return sorted(((self.value_per_page(e, now), e) for e in idle), key=lambda v: v[0])

    def evict_idle(self, pages_needed: int) -> bool:
        """Free pages until ``pages_needed`` are free: idle cached KV blocks and idle adapters (no
        running or queued request) in one ranking, least valuable per page first (a block's use
        rate x its recompute seconds, an adapter's :meth:`value_per_page`); at equal value the
        blocks go first. The adapters are sorted (there are at most ``max_loras``); the blocks
        already wait in their order (:class:`~lorapage.memory.prefix_cache.PrefixCache`), so
        each run of them cheaper than the next adapter is given back in one call."""
        if self.pool.num_free >= pages_needed:
            return True
        block_s = self.recompute.block_s()
        for value, entry in [*self._ranked_idle(self._clock()), (math.inf, None)]:
            if self.pool.num_free >= pages_needed:
                break
            if self._idle_kv is not None:  # the blocks worth no more than this adapter per page
                self._idle_kv.evict(pages_needed, max_rate=value / block_s)
            if entry is not None and self.pool.num_free < pages_needed:
                self._evict(entry)
        return self.pool.num_free >= pages_needed

    def resident(self) -> list[str]:
        return [e.name for e in self._by_slot.values()]

    def resident_pages(self) -> dict[str, int]:
        """Pool pages of each resident version."""
        return {e.name: len(e.pages) for e in self._by_slot.values()}

    def in_host(self) -> list[str]:
        return list(self._host)

    # -- internals ------------------------------------------------------------------------------

    def _evict(self, entry: AdapterEntry) -> None:
        del self._by_slot[entry.slot]
        self._give_back(entry.slot, entry.pages)  # wakes loads waiting for a slot
        entry.slot, entry.pages, entry.yielding = 0, [], False
        self.metrics.record_eviction(entry.name)
        now = self._clock()
        self.evictions.append(now)
        while now - self.evictions[0] > EVICTION_WINDOW_S:
            self.evictions.popleft()
        if entry.waiting:  # queued (e.g. preempted) requests still need it: queue its reload
            self.ensure(entry.name)

    async def _load(self, entry: AdapterEntry) -> None:
        try:
            tier = self.load_tier(entry.name)
            read_s = 0.0
            packed = self._host.get(entry.name)
            if packed is None:
                started = self._timer()
                packed = await self._fetch_packed(entry, tier)
                read_s = self._timer() - started
            self._keep_in_host(entry.name, packed)
            self._start_prefetches()  # this load reads no more: queued prefetches may run
            slot, pages = await self._reserve(entry)
            copy_started = self._timer()
            copy = asyncio.ensure_future(self._run_on_device(lambda: self._copy_in(entry, packed, slot, pages)))
            try:
                await asyncio.shield(copy)
            except asyncio.CancelledError:
                # Unregistered mid-load: the copy may still be queued or running on the forward
                # thread, so its slot and pages go back only once it is done (earlier, the
                # copy could overwrite pages already handed to someone else).
                def give_back(done: asyncio.Future) -> None:
                    if not done.cancelled():
                        done.exception()  # read, so a failed copy is not logged as never retrieved
                    self._give_back(slot, pages)

                copy.add_done_callback(give_back)
                raise
            except Exception:  # the copy ran and failed
                self._give_back(slot, pages)
                raise
            copy_s = self._timer() - copy_started
            self.costs.observe(Stage.COPY, copy_s, len(pages))
            nbytes = packed.numel() * packed.element_size()
            self.metrics.record_load(entry.name, tier.value, read_s + copy_s, nbytes, self._clock())
            entry.slot, entry.pages, entry.resident_since = slot, pages, self._clock()
            self._by_slot[slot] = entry
        except LorapageError as e:
            self._fail_load(entry, e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bad file must fail its own requests, not the engine
            self._fail_load(entry, AdapterLoadError(f"adapter {entry.name!r} failed to load: {e}"))
        finally:
            entry.load_task = None
            self._loading.discard(entry)
            task = asyncio.current_task()
            if task is None or not task.cancelling():  # no new tasks from a load being torn down
                self._start_prefetches()
            self._on_ready()
            self.notify_memory_freed()  # a new resident adapter may yield to a starving load

    def _fail_load(self, entry: AdapterEntry, error: LorapageError) -> None:
        """Record a failed load: the detail for the log and an admin waiting on it, the kind alone
        for the requests that needed it."""
        log.warning("adapter %s failed to load: %s", entry.name, error.message)
        entry.error = error
        self._failed[entry.name] = for_requests(entry.name, error)

    def _give_back(self, slot: int, pages: list[int]) -> None:
        """Return a slot and its pages (an evicted adapter's, or a load's that never became one)."""
        self.tables.clear_slot(slot)
        self.pool.free(pages, PageKind.ADAPTER)
        self._free_slots.append(slot)
        self.notify_memory_freed()

    def _keep_in_host(self, name: str, packed: torch.Tensor) -> None:
        """``name``'s packed copy is the most recently used in host RAM (the LRU keeps
        ``max_cpu_loras``)."""
        self._host[name] = packed
        self._host.move_to_end(name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    async def _fetch_packed(self, entry: AdapterEntry, tier: LoadTier) -> torch.Tensor:
        """The packed copy for a load into the pool: the prefetch of it in flight if there is
        one (and it succeeds), else a read of its own."""
        prefetch = self._prefetching.get(entry.name)
        if prefetch is not None and (packed := await asyncio.shield(prefetch)) is not None:
            return packed
        return await self._read(entry, tier)

    async def _read(self, entry: AdapterEntry, tier: LoadTier) -> torch.Tensor:
        """Fetch (when a locator is set), read and pack the adapter, off the event loop; the
        stages are timed into :attr:`costs`."""
        loop = asyncio.get_running_loop()
        pages = entry.layout.num_pages
        started = self._timer()
        if self.locate is None:
            packed = await loop.run_in_executor(self._io, self._read_and_pack, entry, entry.spec)
            self.costs.observe(Stage.READ, self._timer() - started, pages)
            return packed
        async with contextlib.AsyncExitStack() as held:  # a disk cache keeps the entry while it is read
            if tier is LoadTier.REMOTE:  # no file is read until the download is done: prefetches may
                self._downloading.add(entry.name)
                self._start_prefetches()
            try:
                path = await held.enter_async_context(self.locate(entry.name))
            finally:
                self._downloading.discard(entry.name)
            located = self._timer()
            packed = await loop.run_in_executor(self._io, self._read_and_pack, entry, at_path(entry.spec, path))
        done = self._timer()
        if tier is LoadTier.REMOTE:  # located = downloaded; otherwise locating was part of reading
            self.costs.observe(Stage.DOWNLOAD, located - started, pages)
            started = located
        self.costs.observe(Stage.READ, done - started, pages)
        return packed

    # -- prefetch into host RAM -----------------------------------------------------------------

    def _prefetch_for(self, tenant: str, name: str, now: float) -> None:
        """Queue ``tenant``'s other recent adapters (:class:`RecentAdapters`: its last few within
        ten minutes) for a read into host RAM, so its next request for one skips the disk."""
        for other in self._recent.use(tenant, name, now):
            if other not in self._prefetch_queue and self._wants_prefetch(other):
                self._prefetch_queue[other] = tenant
                if len(self._prefetch_queue) > PREFETCH_QUEUE_LEN:
                    self._prefetch_queue.popitem(last=False)
                    self.prefetches["dropped"] += 1
        self._start_prefetches()

    def _wants_prefetch(self, name: str) -> bool:
        """Registered, in no tier above disk, not loading nor prefetching. Remote sources not in
        the disk cache are left alone: no downloads on speculation."""
        entry = self.entries.get(name)
        if entry is None or entry.slot or entry.load_task is not None:
            return False
        return name not in self._host and name not in self._prefetching and self.load_tier(name) is LoadTier.DISK

    def _start_prefetches(self) -> None:
        """Start queued prefetches while no load into the pool is reading files (a prefetch never
        delays one: it waits, and runs once the loads have their host copies) and fewer than
        ``max_prefetches`` run, oldest first among tenants with fewer than
        :data:`PREFETCHES_PER_TENANT` running. A prefetch takes no lora slot and no pages; a load
        of an adapter being prefetched joins that read."""
        if self._loads_reading():
            return
        for name, tenant in list(self._prefetch_queue.items()):
            if len(self._prefetching) >= self.max_prefetches:
                return
            if self._prefetch_tenants[tenant] >= PREFETCHES_PER_TENANT:
                continue  # behind its own tenant's prefetch, not anyone else's
            del self._prefetch_queue[name]
            if self._wants_prefetch(name):
                self.prefetches["started"] += 1
                self._prefetch_tenants[tenant] += 1
                task = asyncio.get_running_loop().create_task(self._prefetch(self.entries[name], tenant))
                self._prefetching[name] = task

    def _loads_reading(self) -> bool:
        """Whether a load into the pool is reading files or about to (started, no host copy yet,
        not waiting on a download)."""
        return any(e.name not in self._host and e.name not in self._downloading for e in self._loading)

    async def _prefetch(self, entry: AdapterEntry, tenant: str) -> torch.Tensor | None:
        """Read and pack ``entry`` into host RAM; None when that failed (a load that joined it
        then reads for itself and reports the error)."""
        try:
            packed = await self._read(entry, LoadTier.DISK)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.prefetches["failed"] += 1
            return None
        finally:
            self._prefetch_tenants[tenant] -= 1
            if not self._prefetch_tenants[tenant]:
                del self._prefetch_tenants[tenant]
            if self._prefetching.get(entry.name) is asyncio.current_task():
                del self._prefetching[entry.name]
                self._start_prefetches()
        if self.entries.get(entry.name) is entry:  # still registered
            self._keep_in_host(entry.name, packed)
            self.prefetches["done"] += 1
        return packed

    def _read_and_pack(self, entry: AdapterEntry, spec: AdapterSpec) -> torch.Tensor:
        """Read both files once, check them against the registered digest (the bytes hashed are
        the bytes used), then parse and pack."""
        weights = read_weights(spec, self._read_buffer)
        if entry.digest:
            got = _digest(spec, weights)
            if got != entry.digest:
                raise AdapterIntegrityError(
                    f"adapter {entry.name}: files in {spec.path} changed after registration (sha256 {got}, "
                    f"registered {entry.digest}); register the new content as a new version"
                )
        # Bytes that match a digest validate() returned are bytes it found finite in this dtype.
        # A version restored from the registry was checked by an earlier process, perhaps in
        # another dtype (bfloat16 weights can overflow float16): its loads check again.
        finite = bool(entry.digest) and entry.digest in self._finite_digests
        tensors = load_adapter_tensors(spec, self.dtype, weights, check_finite=not finite)
        packed = entry.layout.pack(tensors, self.pool.adapter_page_size)
        # Kept in pageable memory, not pinned: PyTorch's pinned allocator rounds blocks up to a
        # power of two (ATen/core/CachingHostAllocator.h) and caches freed ones, so max_cpu_loras
        # pinned adapters could hold up to twice their size in page-locked RAM for good. A pageable
        # copy to the GPU is slower per byte (the driver stages it), a few ms per 7B adapter
        # against a sub-second TTFT budget.
        return packed

    async def _reserve(self, entry: AdapterEntry) -> tuple[int, list[int]]:
        """A free lora slot and pages, evicting idle adapters; waits while running requests hold
        them. How it waits is the :class:`LoadWait` it is in, looked at again on every wake-up.

        When every slot stays busy for ``slot_wait_s`` and requests wait for this load, the load
        joins the line of starving loads; the first in line makes one busy adapter yield (see
        :meth:`_make_one_yield`) and takes its slot once it is idle and its pages make room. So
        hot adapters with endless queues cannot starve a cold one, and starving loads go in order.
        """
        need = entry.layout.num_pages
        started = self._clock()
        yielded: AdapterEntry | None = None  # the busy adapter yielding its slot to this load
        try:
            while True:
                if yielded is not None and not yielded.yielding:
                    yielded = None  # evicted or unloaded meanwhile: make another yield if still starving
                room = self._take_room(need, yielded)
                if room is not None:
                    return room
                state = self._wait_state(entry, yielded, started)
                timeout: float | None = None  # None: until memory or a slot frees
                if state is LoadWait.PATIENT:
                    timeout = started + self.slot_wait_s - self._clock()
                elif state is LoadWait.PREWARM:
                    self._leave_line(entry)
                    timeout = max(self.slot_wait_s, MIN_RECHECK_S)
                elif state is LoadWait.STARVING:
                    if entry not in self._starving:
                        self._starving.append(entry)
                    if self._starving[0] is entry:
                        yielded = self._make_one_yield()
                        if yielded is not None:
                            continue  # it may be idle of running requests already
                        timeout = max(self.slot_wait_s, MIN_RECHECK_S)  # none may yield yet
                self._memory_freed.clear()
                try:
                    await asyncio.wait_for(self._memory_freed.wait(), timeout)
                except TimeoutError:
                    pass
        finally:
            self._leave_line(entry)
            if yielded is not None and yielded.yielding:  # not evicted (we are done or cancelled)
                yielded.yielding = False
                self._on_ready()  # its queued requests may be admitted again

    def _take_room(self, need: int, yielded: AdapterEntry | None) -> tuple[int, list[int]] | None:
        """A lora slot and ``need`` pages if they can be had now: an idle adapter gives up its
        slot, or the adapter that yielded to this load does once it is idle and its pages
        complete the room."""
        if not self._free_slots:
            victims = self._evictable()
            if victims:
                self._evict(victims[0])
            elif yielded is not None and yielded.running == 0:
                if self.pool.num_free + len(yielded.pages) < need and self._idle_kv is not None:
                    # No adapter is idle: idle cached KV blocks complete the room, cheapest first.
                    self._idle_kv.evict(need - len(yielded.pages))
                if self.pool.num_free + len(yielded.pages) >= need:
                    self._evict(yielded)  # it yielded for this load: its slot and pages are ours
        if self._free_slots and (self.pool.num_free >= need or self.evict_idle(need)):
            pages = self.pool.allocate(need, PageKind.ADAPTER)
            if pages is not None:
                return self._free_slots.pop(), pages
        return None

    def _wait_state(self, entry: AdapterEntry, yielded: AdapterEntry | None, started: float) -> LoadWait:
        if yielded is not None:
            return LoadWait.YIELDED
        if self._free_slots:
            return LoadWait.ROOM
        if self._clock() - started < self.slot_wait_s:
            return LoadWait.PATIENT
        # An admin pin is demand too: it may make a busy adapter yield, as waiting requests do.
        return LoadWait.STARVING if entry.waiting or entry.pinned else LoadWait.PREWARM

    def _leave_line(self, entry: AdapterEntry) -> None:
        if entry in self._starving:
            self._starving.remove(entry)
            self.notify_memory_freed()  # the next in line may make an adapter yield now

    def _make_one_yield(self) -> AdapterEntry | None:
        """Stop admitting to the least valuable busy resident adapter (per page, as eviction
        ranks; pinned ones never), so its slot frees once its running requests finish. Its queued requests wait
        and reload it afterwards: busy adapters take turns rather than one holding on forever.
        An adapter resident for less than ``slot_wait_s`` is spared, so every turn lasts at
        least that long and the slot does not change hands after every batch."""
        now = self._clock()
        busy = [
            e
            for e in self._by_slot.values()
            if not e.yielding and not e.pinned and now - e.resident_since >= self.slot_wait_s
        ]
        if not busy:
            return None
        victim = min(busy, key=lambda e: self.value_per_page(e, now))
        victim.yielding = True
        self.yields += 1
        return victim

    def _copy_in(self, entry: AdapterEntry, packed: torch.Tensor, slot: int, pages: list[int]) -> None:
        """Host RAM -> pool pages, then point the slot's table rows at them (``run_on_device``)."""
        n, size = len(pages), self.pool.adapter_page_size
        src = packed.view(packed.shape[0], n, size)
        storage = self.pool.adapter_storage
        if pages[-1] - pages[0] == n - 1:
            storage[:, pages[0] : pages[0] + n].copy_(src, non_blocking=True)
        else:
            storage[:, torch.tensor(pages, device=storage.device)] = src.to(storage.device, non_blocking=True)
        self.tables.write_slot(slot, entry.layout, pages)


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


def _digest(spec: AdapterSpec, weights: torch.Tensor) -> str:
    """The content digest of ``spec``'s directory, over the weights' bytes as read (``weights``)."""
    config = read_config_bytes(spec.path)
    return bytes_digest({"adapter_config.json": config, spec.weights_file.name: weights.numpy().data})
