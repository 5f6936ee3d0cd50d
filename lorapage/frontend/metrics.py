"""Prometheus metrics of one server, in a registry of its own (several servers can share a process).

Latencies are labelled by tenant and by the tier the adapter was in when the request arrived
(``gpu``, ``ram``, ``disk``; ``none`` for the base model), which is what tells a cold adapter's
first token from a warm one's. Engine gauges are read from ``Engine.stats()`` at scrape time, and
the scheduler's figures (per tenant: admitted and rejected requests and tokens, queue wait split
into adapter load and capacity, VTC counter; per step: batch size, distinct adapters; the reserved
tail lanes' recent use) from its
:class:`~lorapage.scheduler.SchedulerMetrics`. The event loop's lag comes from a
:class:`~lorapage.frontend.loop_lag.LoopLagMonitor`.

Per-adapter series (``lorapage_adapter_*``) come from the engine's
:class:`~lorapage.adapters.metrics.AdapterMetrics`. Their ``adapter`` label is bounded: an
adapter id (versions aggregate) for the top ``--metrics-top-adapters`` ids by recent traffic
(default 20), ``other`` for the rest, so a server with thousands of adapters still exports a
few dozen series per family.

Per-tenant SLO series (``lorapage_tenant_goodput_ratio``, ``lorapage_tenant_slo_*``, the
tenant's answered, failed and good requests) come from a :class:`~lorapage.tenancy.slo.SloTracker`:
gauges over its sliding window, counters since start for Prometheus' own windows.
"""

from __future__ import annotations

import time
from collections import Counter as TallyCounter
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

from lorapage.adapters.metrics import COST_BOUNDS_PCT, AdapterMetrics
from lorapage.engine.stats import EngineStats
from lorapage.frontend.loop_lag import LoopLagMonitor
from lorapage.scheduler.metrics import Histogram as SchedHistogram, SchedulerMetrics, TenantStats
from lorapage.tenancy.slo import SloTracker

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass(frozen=True)
class EngineSeries:
    """One ``/metrics`` series of :class:`~lorapage.engine.stats.EngineStats`: the field it reads
    (unlabelled), the ``{tenant: number}`` field it reads with a ``tenant`` label, or both."""

    name: str
    help: str
    field: str | None = None
    by_tenant: str | None = None


# Every engine series, read from Engine.stats() when scraped. All gauges: the few that count since
# start (preemptions, evicted blocks) were always exported as gauges, and a counter would be renamed
# ``*_total`` under the dashboards and alert rules in deploy/ that name them.
ENGINE_SERIES: tuple[EngineSeries, ...] = (
    EngineSeries(
        "lorapage_engine_host_ram_adapter_bytes",
        "Bytes of adapters' packed copies in host RAM.",
        "host_ram_adapter_bytes",
    ),
    EngineSeries("lorapage_engine_lora_slots", "Adapters that may be resident in the pool at once.", "lora_slots"),
    EngineSeries("lorapage_engine_registered_adapters", "Adapter versions the engine knows.", "registered_adapters"),
    EngineSeries("lorapage_engine_queue_depth", "Requests waiting for admission.", "queue_depth"),
    EngineSeries(
        "lorapage_engine_running",
        "Sequences in the running batch (overall and by tenant).",
        "running",
        "running_by_tenant",
    ),
    EngineSeries(
        "lorapage_engine_tokens_in_flight",
        "Prompt and remaining output tokens of every request queued or running (what fleet placement weighs).",
        "tokens_in_flight",
    ),
    EngineSeries(
        "lorapage_engine_adapter_room_pages",
        "Pool pages the lora slots can hold: slots x pages of a max-rank adapter, at most the pool "
        "(what the pinned-bytes guard divides by).",
        "adapter_room_pages",
    ),
    EngineSeries(
        "lorapage_engine_adapter_held_pages",
        "Pool pages of resident adapters that cannot be evicted now: pinned, kept hot, or in use.",
        "adapter_held_pages",
    ),
    EngineSeries(
        "lorapage_engine_adapter_held_slots",
        "Lora slots of resident adapters that cannot be evicted now (the guard's other share).",
        "adapter_held_slots",
    ),
    EngineSeries("lorapage_engine_adapter_slots", "Lora slots (max_resident_loras).", "adapter_slots"),
    EngineSeries("lorapage_engine_pool_page_bytes", "Bytes of one pool page.", "pool_page_bytes"),
    EngineSeries("lorapage_engine_pool_pages_total", "Pages in the pool.", "pool_pages_total"),
    EngineSeries("lorapage_engine_pool_pages_kv", "Pool pages of KV blocks held by sequences.", "pool_pages_kv"),
    EngineSeries("lorapage_engine_pool_pages_adapters", "Pool pages of resident adapters.", "pool_pages_adapters"),
    EngineSeries(
        "lorapage_engine_pool_pages_free",
        "Pool pages free for new work (idle cached blocks included).",
        "pool_pages_free",
    ),
    EngineSeries(
        "lorapage_engine_pool_pages_cached", "Pool pages of cached KV blocks, held or idle.", "pool_pages_cached"
    ),
    EngineSeries(
        "lorapage_engine_pool_pages_cached_idle",
        "Pool pages of cached KV blocks no sequence holds.",
        "pool_pages_cached_idle",
    ),
    EngineSeries(
        "lorapage_engine_prefix_cache_evicted_blocks",
        "Idle cached KV blocks given back, since start.",
        "prefix_cache_evicted_blocks",
    ),
    EngineSeries(
        "lorapage_engine_prefix_cache_hit_rate",
        "Prompt tokens found in the prefix cache over those looked up, since start (overall and by tenant).",
        "prefix_cache_hit_rate",
        "prefix_cache_hit_rate_by_tenant",
    ),
    EngineSeries(
        "lorapage_engine_evictions_per_minute",
        "Adapters evicted from the pool over the last minute.",
        "evictions_per_minute",
    ),
    EngineSeries(
        "lorapage_engine_preemptions",
        "Running sequences preempted (KV freed, to recompute), since start.",
        "preemptions",
    ),
    EngineSeries(
        "lorapage_engine_kv_pages_held",
        "KV blocks in each tenant's running sequences' block tables.",
        by_tenant="kv_pages_held_by_tenant",
    ),
    EngineSeries(
        "lorapage_engine_adapter_yields",
        "Adapter loads that yielded to a request's deadline, since start.",
        "adapter_yields",
    ),
    EngineSeries("lorapage_engine_adapters_pinned", "Adapter versions pinned resident.", "adapters_pinned"),
    EngineSeries("lorapage_engine_adapters_resident", "Adapter versions resident in the pool.", "adapters_resident"),
    EngineSeries("lorapage_engine_adapters_host_ram", "Adapter versions with a copy in host RAM.", "adapters_host_ram"),
    EngineSeries(
        "lorapage_engine_adapters_kept_hot",
        "Adapter versions of the hot traffic tier, kept resident.",
        "adapters_kept_hot",
    ),
    EngineSeries("lorapage_engine_adapter_pinned_pages", "Pool pages held by pinned adapters.", "adapter_pinned_pages"),
    EngineSeries(
        "lorapage_engine_adapter_pin_limit_pages",
        "Pool pages pins may hold (--max-pinned-fraction).",
        "adapter_pin_limit_pages",
    ),
    *(
        EngineSeries(
            f"lorapage_engine_adapter_prefetches_{outcome}",
            f"Adapter prefetches into host RAM {what}.",
            f"adapter_prefetches_{outcome}",
        )
        for outcome, what in (
            ("started", "started"),
            ("done", "done"),
            ("failed", "failed"),
            ("dropped", "dropped (their queue was full)"),
        )
    ),
    *(
        EngineSeries(
            f"lorapage_engine_adapter_{stage}_s_per_page",
            f"Measured seconds per page of an adapter load's {stage} (moving average, seeded).",
            f"adapter_{stage}_s_per_page",
        )
        for stage in ("copy", "read", "download")
    ),
)
# EngineStats fields not exported (the series of their lengths are).
NOT_EXPORTED = frozenset({"resident_adapters", "host_ram_adapters", "merged_deployment"})


class _EngineGauges:
    """Exports :data:`ENGINE_SERIES` from one ``stats()`` call when scraped."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self):
        stats = self._stats()
        for series in ENGINE_SERIES:
            if series.by_tenant is None:
                yield GaugeMetricFamily(series.name, series.help, value=getattr(stats, str(series.field)))
                continue
            # One family: the overall figure unlabelled beside each tenant's (one HELP line per name).
            family = GaugeMetricFamily(series.name, series.help, labels=("tenant",))
            if series.field is not None:
                family.add_sample(series.name, {}, getattr(stats, series.field))
            for tenant, number in sorted(getattr(stats, series.by_tenant).items()):
                family.add_metric([tenant], number)
            yield family


class BaseGauges:
    """A server serving several bases (:mod:`lorapage.serve.engines`): each unlabelled engine
    series again per base, as ``lorapage_base_*{base="NAME"}`` (one series per base: the label
    set is the bases served), and ``lorapage_base_info{base, digest}``. The ``lorapage_engine_*``
    series stay the primary engine's, as on a server of one base."""

    def __init__(self, engines: list[tuple[str, str, Callable[[], EngineStats]]]) -> None:
        self._engines = engines  # (base name, its digest, its engine's stats), the primary first

    def collect(self):
        info = GaugeMetricFamily(
            "lorapage_base_info", "Each base served (1), with its digest.", labels=("base", "digest")
        )
        for name, digest, _ in self._engines:
            info.add_metric([name, f"sha256:{digest}"], 1)
        yield info
        stats = [(name, read()) for name, _, read in self._engines]
        for series in ENGINE_SERIES:
            if series.field is None:
                continue
            name = series.name.replace("lorapage_engine_", "lorapage_base_", 1)
            family = GaugeMetricFamily(name, f"{series.help} Per base.", labels=("base",))
            for base, got in stats:
                family.add_metric([base], getattr(got, series.field))
            yield family


class _LoopLagGauges:
    """Exports a :class:`LoopLagMonitor`'s worst recent lag and its latest sample."""

    def __init__(self, monitor: LoopLagMonitor) -> None:
        self._monitor = monitor

    def collect(self):
        m = self._monitor
        yield GaugeMetricFamily(
            "lorapage_event_loop_lag_seconds",
            f"Worst lateness of the event loop over the last {m.window_s:g} s (sampled every {m.interval_s:g} s).",
            value=m.worst(time.monotonic()),
        )
        yield GaugeMetricFamily(
            "lorapage_event_loop_lag_last_seconds", "Lateness of the event loop's latest sample.", value=m.last
        )
        samples = HistogramMetricFamily(
            "lorapage_event_loop_lag_samples_seconds",
            f"Lateness of the event loop, every sample (one each {m.interval_s:g} s).",
        )
        _histogram(samples, [], m.histogram)
        yield samples


_PER_TENANT: tuple[tuple[str, str, Callable[[TenantStats], int]], ...] = (
    (
        "offered_requests",
        "Generation requests offered: queued, or refused by a quota or a full queue (beside admitted).",
        lambda t: t.offered_requests,
    ),
    (
        "admitted_requests",
        "Requests admitted to the batch (a preempted one's return not again).",
        lambda t: t.admitted_requests,
    ),
    ("admitted_prompt_tokens", "Prompt tokens of admitted requests.", lambda t: t.admitted_prompt_tokens),
    ("served_input_tokens", "Prompt tokens prefilled (recomputes included).", lambda t: t.served_input_tokens),
    ("served_output_tokens", "Tokens generated.", lambda t: t.served_output_tokens),
    ("preemptions", "Times a running request was preempted (its KV freed, to recompute).", lambda t: t.preemptions),
)
_REJECTED: tuple[tuple[str, str, Callable[[TenantStats], TallyCounter[str]]], ...] = (
    (
        "rejected_requests",
        "Requests refused before queueing, by reason (rpm, tpm, concurrency, queue_full).",
        lambda t: t.rejected_requests,
    ),
    (
        "rejected_tokens",
        "Prompt plus max_tokens of refused requests, by reason (none for a request refused before its body was read).",
        lambda t: t.rejected_tokens,
    ),
)


def _histogram(fam: HistogramMetricFamily, labels: list[str], hist: SchedHistogram) -> None:
    buckets, total = [], 0
    for bound, count in zip((*map(floatToGoString, hist.bounds), "+Inf"), hist.counts):
        total += count
        buckets.append((bound, total))
    fam.add_metric(labels, buckets, hist.sum)


class _SchedulerCollector:
    """Exports a :class:`SchedulerMetrics` and the VTC counters as they are when scraped."""

    def __init__(self, sched: SchedulerMetrics, counters: Callable[[], dict[str, float]]) -> None:
        self._sched = sched
        self._counters = counters

    def collect(self):
        tenants = self._sched.tenants
        for field, doc, read in _PER_TENANT:
            fam = CounterMetricFamily(f"lorapage_tenant_{field}", doc, labels=("tenant",))
            for name, stats in tenants.items():
                fam.add_metric([name], read(stats))
            yield fam
        for field, doc, by_reason in _REJECTED:
            fam = CounterMetricFamily(f"lorapage_tenant_{field}", doc, labels=("tenant", "reason"))
            for name, stats in tenants.items():
                for reason, count in by_reason(stats).items():
                    fam.add_metric([name, reason], count)
            yield fam
        wait = HistogramMetricFamily(
            "lorapage_queue_wait_seconds",
            "Arrival to admission, split into waiting for the adapter to load and waiting for capacity.",
            labels=("tenant", "kind"),
        )
        for name, stats in tenants.items():
            _histogram(wait, [name, "adapter_load"], stats.wait_adapter_s)
            _histogram(wait, [name, "capacity"], stats.wait_capacity_s)
        yield wait
        vtc = GaugeMetricFamily("lorapage_vtc_counter", "Each tenant's VTC virtual counter.", labels=("tenant",))
        for name, counter in self._counters().items():
            vtc.add_metric([name], counter)
        yield vtc
        batch = HistogramMetricFamily("lorapage_batch_size", "Sequences in each step's batch.")
        _histogram(batch, [], self._sched.batch_size)
        yield batch
        distinct = HistogramMetricFamily(
            "lorapage_batch_distinct_adapters", "Distinct adapters in each step's batch (base model not counted)."
        )
        _histogram(distinct, [], self._sched.distinct_adapters)
        yield distinct
        held, lent = self._sched.tail_lane_utilization()
        tail = GaugeMetricFamily(
            "lorapage_tail_lane_utilization",
            "Fraction of VTC's reserved tail lanes (--reserved-tail-lanes) in use, averaged over recent steps: "
            "holder=tail, by adapters that came in through one (single requests, aged ones); holder=lent, by "
            "general holders while nobody wanted one. Tail near 1: the long tail queues for them.",
            labels=("holder",),
        )
        tail.add_metric(["tail"], held)
        tail.add_metric(["lent"], lent)
        yield tail
        policy = HistogramMetricFamily(
            "lorapage_scheduler_policy_seconds",
            "Seconds each step spent in the scheduling policy (admission and service accounting).",
        )
        _histogram(policy, [], self._sched.policy_s)
        yield policy


class _AdapterCollector:
    """Exports an :class:`AdapterMetrics` as it is when scraped."""

    def __init__(self, adapters: AdapterMetrics) -> None:
        self._adapters = adapters

    def collect(self):
        m = self._adapters
        loads = CounterMetricFamily(
            "lorapage_adapter_loads",
            "Adapter loads into the pool, by adapter (top ids by traffic, else other) and the tier the "
            "load started from (ram: host copy, disk, remote: a download).",
            labels=("adapter", "tier"),
        )
        for (adapter, tier), count in sorted(m.loads.items()):
            loads.add_metric([adapter, tier], count)
        yield loads
        swap = CounterMetricFamily(
            "lorapage_tenant_adapter_load_bytes",
            "Bytes of adapter loads into the pool, by the tenant whose request found its adapter outside the pool "
            "first (rate(): the tenant's swap bytes/s; loads nobody waited on, pins and hot keeps, are not charged).",
            labels=("tenant",),
        )
        for tenant, nbytes in sorted(m.load_bytes_by_tenant.items()):
            swap.add_metric([tenant], nbytes)
        yield swap
        seconds = HistogramMetricFamily(
            "lorapage_adapter_load_seconds",
            "Seconds an adapter load into the pool took, by the tier it started from (its own work: "
            "download, read and copy, not the wait for room).",
            labels=("tier",),
        )
        for tier, hist in m.load_seconds.items():
            _histogram(seconds, [tier], hist)
        yield seconds
        requests = CounterMetricFamily(
            "lorapage_adapter_requests",
            "Requests by adapter (top ids by traffic, else other) and the tier it was in when they "
            "arrived (gpu: a hit in the pool, ram, disk).",
            labels=("adapter", "tier"),
        )
        for (adapter, tier), count in sorted(m.requests.items()):
            requests.add_metric([adapter, tier], count)
        yield requests
        evictions = CounterMetricFamily(
            "lorapage_adapter_evictions",
            "Adapters leaving the pool, by adapter (top ids by traffic, else other).",
            labels=("adapter",),
        )
        for adapter, count in sorted(m.evictions.items()):
            evictions.add_metric([adapter], count)
        yield evictions
        downloads = CounterMetricFamily(
            "lorapage_adapter_download_bytes",
            "Bytes downloaded from remote adapter sources, by scheme (failed downloads included).",
            labels=("scheme",),
        )
        for scheme, count in sorted(m.bytes_downloaded().items()):
            downloads.add_metric([scheme], count)
        yield downloads
        yield GaugeMetricFamily(
            "lorapage_adapter_pinned_pages", "Pool pages held by admin-pinned adapters.", value=m.pinned_pages()
        )
        yield from _cost_families(m)


def _cost_families(m: AdapterMetrics):
    """Projected costs: by name for the labelled ids (bounded like every adapter label), and over
    every served id as a histogram whose sum is what capacity planning adds up."""
    costs = m.projected_costs()
    gauge = GaugeMetricFamily(
        "lorapage_adapter_projected_cost_pct",
        "Projected extra decode bytes per token of an adapter's current version at the reference batch "
        "(--cost-reference-batch rows, each on its own adapter), in % of the base's; top ids by traffic only.",
        labels=("adapter",),
    )
    for adapter in sorted(m.labelled & costs.keys()):
        gauge.add_metric([adapter], costs[adapter])
    yield gauge
    hist = SchedHistogram(COST_BOUNDS_PCT)
    for pct in costs.values():
        hist.observe(pct)
    family = HistogramMetricFamily(
        "lorapage_adapters_projected_cost_pct",
        "Served adapter ids (current versions) by projected decode cost in % of the base's; the sum adds them up.",
    )
    _histogram(family, [], hist)
    yield family


class _SloCollector:
    """Exports an :class:`SloTracker`'s figures as they are when scraped."""

    def __init__(self, tracker: SloTracker) -> None:
        self._tracker = tracker

    def collect(self):
        report = list(self._tracker.report(time.monotonic()))
        window = f"over the last {self._tracker.window_s:g} s"
        gauges = {
            "goodput": GaugeMetricFamily(
                "lorapage_tenant_goodput_ratio",
                f"Answered requests that did not fail and met every latency SLO of their tenant, {window}.",
                labels=("tenant",),
            ),
            "errors": GaugeMetricFamily(
                "lorapage_tenant_error_ratio", f"Answered requests that failed (5xx), {window}.", labels=("tenant",)
            ),
            "burn": GaugeMetricFamily(
                "lorapage_tenant_slo_burn_rate",
                f"Bad fraction over the SLO's allowed fraction, {window} (1: the budget spent as fast as allowed).",
                labels=("tenant", "slo"),
            ),
            "budget": GaugeMetricFamily(
                "lorapage_tenant_slo_error_budget_ratio",
                "Fraction of requests an SLO allows to miss it (0.05 for a p95 target; the error-rate target).",
                labels=("tenant", "slo"),
            ),
            "target": GaugeMetricFamily(
                "lorapage_tenant_slo_target_seconds",
                "A tenant's latency SLO targets (ttft, itl), from the tenants file.",
                labels=("tenant", "slo"),
            ),
        }
        counters = {
            "requests": CounterMetricFamily(
                "lorapage_tenant_requests",
                "Generation requests answered (2xx and 5xx; the client's own 4xx are not judged).",
                labels=("tenant",),
            ),
            "failed": CounterMetricFamily(
                "lorapage_tenant_request_errors", "Answered generation requests that failed (5xx).", labels=("tenant",)
            ),
            "good": CounterMetricFamily(
                "lorapage_tenant_good_requests",
                "Answered requests that did not fail and met every latency SLO of their tenant (goodput).",
                labels=("tenant",),
            ),
            "judged": CounterMetricFamily(
                "lorapage_tenant_slo_requests", "Requests judged against each SLO.", labels=("tenant", "slo")
            ),
            "bad": CounterMetricFamily(
                "lorapage_tenant_slo_bad_requests", "Requests that missed each SLO.", labels=("tenant", "slo")
            ),
        }
        for tenant, slo in report:
            if slo.goodput_ratio is not None:
                gauges["goodput"].add_metric([tenant], slo.goodput_ratio)
            if slo.error_ratio is not None:
                gauges["errors"].add_metric([tenant], slo.error_ratio)
            for sli, burn in slo.burn_rates().items():
                gauges["burn"].add_metric([tenant, sli], burn)
            for sli, allowed in slo.targets.allowed_bad().items():
                gauges["budget"].add_metric([tenant, sli], allowed)
                counters["judged"].add_metric([tenant, sli], slo.lifetime.judged.get(sli, 0))
                counters["bad"].add_metric([tenant, sli], slo.lifetime.bad.get(sli, 0))
            for sli, seconds in slo.targets.latency_targets().items():
                gauges["target"].add_metric([tenant, sli], seconds)
            counters["requests"].add_metric([tenant], slo.lifetime.requests)
            counters["failed"].add_metric([tenant], slo.lifetime.failed)
            counters["good"].add_metric([tenant], slo.lifetime.good)
        yield from gauges.values()
        yield from counters.values()


def register_engine_collectors(
    registry: CollectorRegistry,
    stats: Callable[[], EngineStats] | None = None,
    scheduler: SchedulerMetrics | None = None,
    vtc_counters: Callable[[], dict[str, float]] = dict,
    adapters: AdapterMetrics | None = None,
) -> None:
    """Add the series one engine exports (its stats, scheduler and adapters, read when scraped):
    a server's, or an engine replica's that the fleet's ingress re-exports (:mod:`lorapage.fleet.telemetry`)."""
    if stats is not None:
        registry.register(_EngineGauges(stats))
    if scheduler is not None:
        registry.register(_SchedulerCollector(scheduler, vtc_counters))
    if adapters is not None:
        registry.register(_AdapterCollector(adapters))


class ServerMetrics:
    """The histograms and counters the server updates as requests run."""

    def __init__(
        self,
        stats: Callable[[], EngineStats] | None = None,
        scheduler: SchedulerMetrics | None = None,
        vtc_counters: Callable[[], dict[str, float]] = dict,
        loop_lag: LoopLagMonitor | None = None,
        adapters: AdapterMetrics | None = None,
        slo: SloTracker | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        labels = ("tenant", "adapter_tier")
        self.ttft = Histogram(
            "lorapage_time_to_first_token_seconds",
            "Arrival to first generated token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "lorapage_inter_token_latency_seconds",
            "Time between consecutive generated tokens.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "lorapage_request_latency_seconds",
            "Arrival to last token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "lorapage_prompt_tokens",
            "Prompt tokens of requests that started generating.",
            ("tenant",),
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "lorapage_generation_tokens", "Generated tokens.", ("tenant",), registry=self.registry
        )
        self.requests = Counter(
            "lorapage_requests",
            "Requests answered, by route and status.",
            ("route", "status"),
            registry=self.registry,
        )
        register_engine_collectors(self.registry, stats, scheduler, vtc_counters, adapters)
        if loop_lag is not None:
            self.registry.register(_LoopLagGauges(loop_lag))
        if slo is not None:
            self.registry.register(_SloCollector(slo))

    def render(self) -> bytes:
        return generate_latest(self.registry)
