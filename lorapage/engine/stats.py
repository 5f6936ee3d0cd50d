"""What :meth:`Engine.stats` answers: one frozen, picklable record of the engine's state now.

Flat on purpose: each field's name is the key ``GET /internal/state`` has always shown (the record
encodes to the same JSON object) and the suffix of the series ``/metrics`` exports for it. Which
fields are exported, under what name, type and help, is the server's table
(:data:`lorapage.frontend.metrics.ENGINE_SERIES`), not this record's business. Fleet replicas send
it in their heartbeats as it is. No torch: the fleet's ingress reads it without an engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lorapage.adapters.value import Stage
from lorapage.memory.kv import held_pages
from lorapage.memory.pages import PageKind

if TYPE_CHECKING:
    from lorapage.adapters.metrics import AdapterMetrics
    from lorapage.engine.build import AdapterParts, MemoryParts, SchedulingParts
    from lorapage.request import Request
    from lorapage.scheduler import SchedulerMetrics


@dataclass(frozen=True)
class EngineStats:
    """Adapters by tier, queue and batch, pool pages by use, prefix cache, evictions and
    prefetches, measured reload costs. Pages are pool pages; rates are over the engine's clock."""

    # -- adapters
    resident_adapters: tuple[str, ...]  # versions (id@N) in pool pages
    host_ram_adapters: tuple[str, ...]  # versions with a packed copy in host RAM
    host_ram_adapter_bytes: int
    lora_slots: int  # adapters that may be resident at once (max_resident_loras)
    registered_adapters: int  # versions the cache knows, servable or not
    adapter_yields: int  # loads that gave way to a request's deadline (adapter_wait_s)
    adapters_pinned: int
    adapters_resident: int  # len(resident_adapters): the lists are not exported, their lengths are
    adapters_host_ram: int  # len(host_ram_adapters)
    adapters_kept_hot: int  # hot traffic tier: kept resident
    adapter_pinned_pages: int
    adapter_pin_limit_pages: int  # max_pinned_fraction of the pool
    adapter_prefetches_started: int  # prefetches into host RAM, by outcome
    adapter_prefetches_done: int
    adapter_prefetches_failed: int
    adapter_prefetches_dropped: int
    adapter_copy_s_per_page: float  # measured reload costs (EWMA, seeded): seconds per page of each stage
    adapter_read_s_per_page: float
    adapter_download_s_per_page: float
    # -- requests
    queue_depth: int  # waiting for admission
    running: int  # sequences in the batch
    running_by_tenant: Mapping[str, int]  # every tenant seen, 0 when it has none running
    preemptions: int  # since start
    kv_pages_held_by_tenant: Mapping[str, int]  # every tenant seen, 0 when it holds none
    # -- the pool
    pool_pages_total: int
    pool_pages_kv: int  # held by sequences (idle cached blocks not included)
    pool_pages_adapters: int
    pool_pages_free: int  # free, and idle cached blocks (given back under pressure)
    pool_pages_cached: int  # cached KV blocks, held or idle
    pool_pages_cached_idle: int
    # -- prefix cache and eviction
    prefix_cache_evicted_blocks: int  # idle cached blocks given back, since start
    prefix_cache_hit_rate: float  # prompt tokens found cached / prompt tokens looked up, since start
    prefix_cache_hit_rate_by_tenant: Mapping[str, float]
    evictions_per_minute: int  # adapters evicted over the last 60 s
    # -- what fleet placement weighs (docs/fleet.md, affinity_load)
    adapter_held_pages: int = 0  # pages of resident adapters that cannot be evicted now (pinned, hot, in use)
    pool_page_bytes: int = 0  # the bytes of one pool page
    adapter_room_pages: int = 0  # the lora slots' pages: slots x pages of an adapter of max_lora_rank, at most the pool
    adapter_held_slots: int = 0  # lora slots taken by those adapters (held pages may be few: low-rank adapters)
    adapter_slots: int = 0  # the lora slots (max_resident_loras)
    tokens_in_flight: int = 0  # prompt + remaining output tokens of every request queued or running here
    # -- a dedicated deployment (lorapage serve --merge): its equivalence check; None: the shared pool
    merged_deployment: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class EngineMetrics:
    """What :meth:`Engine.metrics` answers: the live sources a Prometheus collector reads an
    engine through when scraped (:func:`lorapage.frontend.metrics.register_engine_collectors`),
    so that a front end holds no engine internals."""

    stats: Callable[[], EngineStats]
    scheduler: SchedulerMetrics  # admissions, rejections, waits per tenant
    vtc_counters: Callable[[], dict[str, float]]  # each tenant's VTC counter now (none under FCFS)
    adapters: AdapterMetrics  # loads, evictions, downloads, the top adapters' traffic


def gather_stats(
    now: float,
    memory: MemoryParts,
    adapters: AdapterParts,
    scheduling: SchedulingParts,
    merged_deployment: Mapping[str, Any] | None,
) -> EngineStats:
    """The engine's parts read at ``now`` (the engine's clock) into one record."""
    planner, residency, cache, pool, prefix = (
        scheduling.planner,
        adapters.residency,
        adapters.cache,
        memory.pool,
        memory.prefix_cache,
    )
    hits, queried = planner.prefix_hit_tokens, planner.prefix_query_tokens
    resident, in_host = tuple(residency.slots.resident()), tuple(residency.host.keys())
    prefetches = residency.prefetch.counts
    costs = cache.costs
    tenants = scheduling.metrics.tenants
    return EngineStats(
        resident_adapters=resident,
        host_ram_adapters=in_host,
        host_ram_adapter_bytes=residency.host.nbytes,
        lora_slots=memory.max_resident_loras,
        registered_adapters=len(cache.entries),
        adapter_yields=residency.loads.yields,
        adapters_pinned=len(residency.pins.pinned()),
        adapters_resident=len(resident),
        adapters_host_ram=len(in_host),
        adapters_kept_hot=len(residency.pins.hot()),
        adapter_pinned_pages=residency.pins.pinned_pages(),
        adapter_pin_limit_pages=residency.pins.limit(),
        adapter_prefetches_started=prefetches["started"],
        adapter_prefetches_done=prefetches["done"],
        adapter_prefetches_failed=prefetches["failed"],
        adapter_prefetches_dropped=prefetches["dropped"],
        adapter_copy_s_per_page=costs.seconds_per_page(Stage.COPY),
        adapter_read_s_per_page=costs.seconds_per_page(Stage.READ),
        adapter_download_s_per_page=costs.seconds_per_page(Stage.DOWNLOAD),
        queue_depth=scheduling.policy.num_waiting(),
        running=len(planner.running),
        running_by_tenant=_running_by_tenant(planner.running, tenants),
        preemptions=planner.num_preemptions,
        kv_pages_held_by_tenant=_kv_pages_by_tenant(planner.running, tenants),
        pool_pages_total=pool.capacity,
        pool_pages_kv=pool.used[PageKind.KV] - prefix.num_idle,
        pool_pages_adapters=pool.used[PageKind.ADAPTER],
        pool_pages_free=pool.num_free + prefix.num_idle,
        pool_pages_cached=prefix.num_cached,
        pool_pages_cached_idle=prefix.num_idle,
        prefix_cache_evicted_blocks=prefix.evicted,
        prefix_cache_hit_rate=_ratio(sum(hits.values()), sum(queried.values())),
        prefix_cache_hit_rate_by_tenant={t: _ratio(hits[t], n) for t, n in queried.items()},
        evictions_per_minute=sum(1 for t in residency.slots.evictions if now - t <= 60.0),
        adapter_held_pages=held_adapter_pages(adapters),
        pool_page_bytes=memory.page_bytes,
        adapter_room_pages=min(memory.max_resident_loras * memory.tables.page_table.shape[1], pool.capacity),
        adapter_held_slots=len(held_adapters(adapters)),
        adapter_slots=memory.max_resident_loras,
        tokens_in_flight=sum(
            r.num_prompt_tokens + max(r.max_tokens - len(r.output_ids), 0) for r in planner.requests.values()
        ),
        merged_deployment=merged_deployment,
    )


def held_adapters(adapters: AdapterParts) -> dict[str, int]:
    """Resident adapters that cannot be evicted now (pinned, kept hot, or with requests queued or
    running): version key -> its pool pages."""
    rules = adapters.residency
    return {
        key: pages
        for key, pages in rules.slots.resident_pages().items()
        if (r := rules.adapters[key]).pinned or r.hot or r.running or r.waiting
    }


def held_adapter_pages(adapters: AdapterParts) -> int:
    """Pool pages of resident adapters that cannot be evicted now: pinned, kept hot, or with
    requests queued or running."""
    return sum(held_adapters(adapters).values())


def _running_by_tenant(running: list[Request], seen: Iterable[str]) -> dict[str, int]:
    """Sequences in the batch per tenant; every tenant in ``seen`` is reported, at 0 when it has none."""
    count = dict.fromkeys(seen, 0)
    for req in running:
        count[req.tenant] = count.get(req.tenant, 0) + 1
    return count


def _kv_pages_by_tenant(running: list[Request], seen: Iterable[str]) -> dict[str, int]:
    """KV blocks in the block tables of each tenant's running requests (a cached block several
    share counts for each); every tenant in ``seen`` is reported, at 0 when it holds none."""
    held = dict.fromkeys(seen, 0)
    for req in running:
        held[req.tenant] = held.get(req.tenant, 0) + held_pages(req.block_table)
    return held


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
