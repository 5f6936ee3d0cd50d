"""Pure scheduling metrics: per-tenant counters and per-step histograms, no exporter attached.

The server turns a :class:`SchedulerMetrics` into Prometheus series; the simulator and tests read
it directly. :class:`MeteredPolicy` fills it around any :class:`SchedulerPolicy`. Everything here
is bounded: histograms have fixed buckets, stats are per tenant (the tenants file's) and per
rejection reason, and the wrapper's books hold only requests in flight.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Generic

from lorapage.scheduler.base import AdmissionContext, R, SchedulerPolicy
from lorapage.scheduler.vtc import VtcScheduler

WAIT_BOUNDS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DISTINCT_BOUNDS = (0, 1, 2, 4, 8, 16, 32, 64, 128)
POLICY_BOUNDS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
TAIL_WINDOW_STEPS = 256  # the tail lanes' use is averaged over this many recent steps


class Histogram:
    """Observation counts per upper bound (last bucket: above every bound), with sum and count."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # counts[i]: observations in (bounds[i-1], bounds[i]]
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1


@dataclass
class TenantStats:
    """What one tenant was admitted, refused and served, and how long it queued."""

    offered_requests: int = 0  # queued or refused: what the tenant asked for, beside what was admitted
    admitted_requests: int = 0
    admitted_prompt_tokens: int = 0
    served_input_tokens: int = 0
    served_output_tokens: int = 0
    preemptions: int = 0  # times its running requests were preempted (to recompute later)
    rejected_requests: Counter[str] = field(default_factory=Counter)  # reason -> requests
    rejected_tokens: Counter[str] = field(default_factory=Counter)  # reason -> prompt + max_tokens
    wait_adapter_s: Histogram = field(default_factory=lambda: Histogram(WAIT_BOUNDS_S))
    wait_capacity_s: Histogram = field(default_factory=lambda: Histogram(WAIT_BOUNDS_S))


class SchedulerMetrics:
    """Per-tenant stats and per-step histograms (batch size, distinct adapters in the batch, and
    the time the policy took, which the engine measures and hands in: the policy has no clock),
    and how much of VTC's reserved tail lanes recent steps used."""

    def __init__(self) -> None:
        self.tenants: dict[str, TenantStats] = {}
        self.batch_size = Histogram(BATCH_BOUNDS)
        self.distinct_adapters = Histogram(DISTINCT_BOUNDS)
        self.policy_s = Histogram(POLICY_BOUNDS_S)
        # Per recent step: fractions of the reserved tail lanes held by tail adapters, and lent.
        self._tail: deque[tuple[float, float]] = deque(maxlen=TAIL_WINDOW_STEPS)

    def tenant(self, name: str) -> TenantStats:
        stats = self.tenants.get(name)
        if stats is None:
            stats = self.tenants[name] = TenantStats()
        return stats

    def record_offered(self, tenant: str) -> None:
        """A generation request entered the queue (a refused one is counted offered by
        :meth:`record_rejected`): the incident view's offered, beside admitted."""
        self.tenant(tenant).offered_requests += 1

    def record_rejected(self, tenant: str, tokens: int, reason: str) -> None:
        """A request refused before queueing (``reason``: rpm, tpm, concurrency, queue_full...).
        It was offered too: offered = queued + refused."""
        stats = self.tenant(tenant)
        stats.offered_requests += 1
        stats.rejected_requests[reason] += 1
        stats.rejected_tokens[reason] += tokens

    def record_admitted(self, tenant: str, prompt_tokens: int, adapter_wait_s: float, capacity_wait_s: float) -> None:
        stats = self.tenant(tenant)
        stats.admitted_requests += 1
        stats.admitted_prompt_tokens += prompt_tokens
        stats.wait_adapter_s.observe(adapter_wait_s)
        stats.wait_capacity_s.observe(capacity_wait_s)

    def record_preempted(self, tenant: str) -> None:
        self.tenant(tenant).preemptions += 1

    def record_served(self, tenant: str, input_tokens: int, output_tokens: int) -> None:
        stats = self.tenant(tenant)
        stats.served_input_tokens += input_tokens
        stats.served_output_tokens += output_tokens

    def record_step(self, batch_size: int, distinct_adapters: int) -> None:
        self.batch_size.observe(batch_size)
        self.distinct_adapters.observe(distinct_adapters)

    def record_tail_lanes(self, held: int, lent: int, reserved: int) -> None:
        """One step's reserved tail lanes: ``held`` by adapters that came in through one (single
        requests, or aged ones), ``lent`` to general holders while no such request wanted one."""
        self._tail.append((held / reserved, lent / reserved) if reserved else (0.0, 0.0))

    def tail_lane_utilization(self) -> tuple[float, float]:
        """The fractions of the reserved tail lanes held by tail adapters and lent, each averaged
        over the last ``TAIL_WINDOW_STEPS`` steps that ran anything (0 before any, and under FCFS)."""
        n = len(self._tail) or 1
        return sum(h for h, _ in self._tail) / n, sum(lent for _, lent in self._tail) / n

    def record_policy_time(self, seconds: float) -> None:
        """Seconds one step spent in the policy (scheduling, service and finish accounting)."""
        self.policy_s.observe(seconds)


class _ObservingContext(Generic[R]):
    """Passes the policy's questions through, noting when a request's adapter finished loading."""

    def __init__(self, ctx: AdmissionContext[R], now: float, loaded_at: dict[str, float | None]) -> None:
        self._ctx = ctx
        self._now = now
        self._loaded_at = loaded_at  # request_id -> None while seen loading, then when seen ready

    def adapter_ready(self, req: R) -> bool:
        ready = self._ctx.adapter_ready(req)
        rid = req.request_id
        if not ready:
            self._loaded_at[rid] = None
        elif rid in self._loaded_at and self._loaded_at[rid] is None:
            self._loaded_at[rid] = self._now
        return ready

    def try_admit(self, req: R) -> bool:
        return self._ctx.try_admit(req)


class MeteredPolicy(Generic[R]):
    """Any policy, with its admissions, service and steps recorded in a :class:`SchedulerMetrics`.

    Queue wait splits at the first step the policy saw the request's adapter ready after seeing
    it load: before it the request waited for an adapter load, after it for capacity (rows, pages,
    its VTC turn). A load that ends while the engine idles wakes it, so that step is the load's end.
    A request readmitted after preemption is not admitted again: counts and waits are per request.
    Steps are recorded only when something runs.
    """

    def __init__(self, policy: SchedulerPolicy[R], metrics: SchedulerMetrics) -> None:
        self.policy = policy
        self.metrics = metrics
        self._lanes = policy.lanes if isinstance(policy, VtcScheduler) else None  # FCFS reserves no tail lanes
        self._enqueued_at: dict[str, float] = {}
        self._loaded_at: dict[str, float | None] = {}
        self._returning: set[str] = set()  # preempted, waiting to be readmitted
        self._running: dict[str, str | None] = {}  # request_id -> adapter
        self._adapters: Counter[str] = Counter()  # adapter -> running requests

    def add(self, req: R, now: float) -> None:
        self.policy.add(req, now)
        self._enqueued_at[req.request_id] = now

    def preempt(self, req: R, now: float) -> None:
        self.policy.preempt(req, now)
        self.metrics.record_preempted(req.tenant)
        self._stopped(req)
        self._returning.add(req.request_id)  # its readmission is not a new admission
        self._enqueued_at[req.request_id] = now

    def remove(self, req: R) -> None:
        self._forget(req)
        self.policy.remove(req)

    def reclaim(self, now: float) -> list[R]:
        return self.policy.reclaim(now)

    def schedule(self, now: float, ctx: AdmissionContext[R]) -> list[R]:
        admitted = self.policy.schedule(now, _ObservingContext(ctx, now, self._loaded_at))
        for req in admitted:
            enqueued = self._enqueued_at.pop(req.request_id, now)
            loaded_at = self._loaded_at.pop(req.request_id, enqueued)
            loaded = now if loaded_at is None else max(enqueued, loaded_at)
            if req.request_id in self._returning:
                self._returning.discard(req.request_id)
            else:
                self.metrics.record_admitted(req.tenant, req.num_prompt_tokens, loaded - enqueued, now - loaded)
            self._running[req.request_id] = req.adapter
            if req.adapter is not None:
                self._adapters[req.adapter] += 1
        if self._running:
            self.metrics.record_step(len(self._running), len(self._adapters))
            if self._lanes is not None:
                self.metrics.record_tail_lanes(*self._lanes.tail_use(), self._lanes.reserved_tail)
        return admitted

    def on_service(self, req: R, input_tokens: int, output_tokens: int, now: float) -> None:
        self.policy.on_service(req, input_tokens, output_tokens, now)
        self.metrics.record_served(req.tenant, input_tokens, output_tokens)

    def on_finish(self, req: R, now: float) -> None:
        if req.request_id in self._running:
            self._stopped(req)
        self._forget(req)
        self.policy.on_finish(req, now)

    def pick_victim(self, running: list[R]) -> R:
        return self.policy.pick_victim(running)

    def num_waiting(self) -> int:
        return self.policy.num_waiting()

    def _forget(self, req: R) -> None:
        self._enqueued_at.pop(req.request_id, None)
        self._loaded_at.pop(req.request_id, None)
        self._returning.discard(req.request_id)

    def _stopped(self, req: R) -> None:
        adapter = self._running.pop(req.request_id)
        if adapter is not None:
            self._adapters[adapter] -= 1
            if not self._adapters[adapter]:
                del self._adapters[adapter]
