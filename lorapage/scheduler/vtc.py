"""Virtual Token Counter scheduling (Sheng et al., OSDI 2024) with adapter-aware admission.

Every tenant carries a counter of the weighted service it has received: ``input_weight`` per
prompt token and ``output_weight`` per generated token, divided by the tenant's weight. Each
admission goes to the backlogged tenant with the smallest counter. The prompt is charged when a
request is admitted (so one step cannot hand one tenant every free row) and output as it is
produced. docs/scheduling.md explains how VTC order, adapter slots and the age deadline interact.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Mapping

from lorapage.scheduler.base import AdmissionContext, SchedRequest
from lorapage.scheduler.slots import AdapterSlots, SlotKind


@dataclass(frozen=True)
class VtcConfig:
    """Knobs of :class:`VtcScheduler`; durations in seconds of the injected clock."""

    input_weight: float = 1.0  # counter units per prompt token
    output_weight: float = 2.0  # counter units per generated token
    max_loras: int = 32  # distinct adapters the running batch may hold
    reserved_tail_slots: int | None = None  # of max_loras, for single-request adapters; None: max_loras // 8
    age_deadline_s: float = 1.0  # a request waiting this long gets the next adapter slot that frees
    max_scan: int = 1024  # waiting requests examined per step at most (bounds the step's cost)

    def __post_init__(self) -> None:
        for name in ("input_weight", "output_weight", "age_deadline_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"VtcConfig.{name} must be >= 0; got {getattr(self, name)}")
        for name in ("max_loras", "max_scan"):
            if getattr(self, name) < 1:
                raise ValueError(f"VtcConfig.{name} must be >= 1; got {getattr(self, name)}")
        if not 0 <= self.tail_slots < self.max_loras:
            raise ValueError(
                f"VtcConfig.reserved_tail_slots must be in [0, max_loras={self.max_loras}); "
                f"got {self.reserved_tail_slots}"
            )

    @property
    def tail_slots(self) -> int:
        return self.max_loras // 8 if self.reserved_tail_slots is None else self.reserved_tail_slots


@dataclass(eq=False)
class _Waiting:
    req: SchedRequest
    enqueued_at: float


@dataclass(eq=False)
class _Tenant:
    name: str
    weight: float
    counter: float = 0.0
    waiting: dict[str, _Waiting] = field(default_factory=dict)  # request_id -> entry, oldest first
    stamp: int = -1  # stamp of this tenant's one valid heap entry; -1: none


@dataclass(eq=False)
class _Ledger:
    """What a request has been charged, so that nothing is charged twice."""

    prepaid: int = 0  # prompt tokens charged at admission and not yet reported as served
    free: int = 0  # tokens a recompute after preemption may prefill without charge
    served_this_run: int = 0  # tokens served since the last (re)admission


class VtcScheduler:
    """Fair admission across tenants by Virtual Token Counter, grouped by adapter.

    Contract with the engine (beyond :class:`~lorapage.scheduler.base.SchedulerPolicy`): each
    admitted request ends with exactly one ``on_finish`` or, when preempted, one ``add`` (not
    both); a recompute prefill is reported through ``on_service`` as input tokens and is free up
    to what the request had been served before it was preempted.
    """

    def __init__(self, config: VtcConfig | None = None, tenant_weights: Mapping[str, float] | None = None) -> None:
        self.config = config or VtcConfig()
        self._weights: dict[str, float] = dict(tenant_weights or {})
        self._tenants: dict[str, _Tenant] = {}
        self._heap: list[tuple[float, int, str]] = []  # (counter when pushed, stamp, tenant)
        self._stamp = 0
        self._floor = 0.0  # counter of the tenant admitted last: the lift when nobody is backlogged
        self._running: dict[str, SchedRequest] = {}
        self._ledger: dict[str, _Ledger] = {}
        self._num_waiting = 0
        self._adapter_waiting: dict[str, int] = {}  # adapter -> waiting requests for it
        self.slots = AdapterSlots(self.config.max_loras, self.config.tail_slots)

    # --- tenants and counters ---------------------------------------------------------------

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        """New VTC shares (tenants file reloaded); they apply to service charged from now on."""
        self._weights = dict(weights)
        for t in self._tenants.values():
            t.weight = self._weights.get(t.name, 1.0)

    def counter(self, tenant: str) -> float:
        t = self._tenants.get(tenant)
        return t.counter if t else 0.0

    def counters(self) -> dict[str, float]:
        return {name: t.counter for name, t in self._tenants.items()}

    def _tenant(self, name: str) -> _Tenant:
        t = self._tenants.get(name)
        if t is None:
            t = self._tenants[name] = _Tenant(name, self._weights.get(name, 1.0))
        return t

    def _charge(self, t: _Tenant, input_tokens: int, output_tokens: int) -> None:
        cfg = self.config
        t.counter += (input_tokens * cfg.input_weight + output_tokens * cfg.output_weight) / t.weight

    def _push(self, t: _Tenant) -> None:
        self._stamp += 1
        t.stamp = self._stamp
        heapq.heappush(self._heap, (t.counter, self._stamp, t.name))

    def _peek_min(self) -> _Tenant | None:
        """The backlogged tenant with the smallest counter. Entries go stale as counters grow
        (re-pushed here, lazily) or when a tenant's queue empties or it is re-pushed (dropped)."""
        heap = self._heap
        while heap:
            key, stamp, name = heap[0]
            t = self._tenants[name]
            if stamp != t.stamp or not t.waiting:
                heapq.heappop(heap)
            elif key < t.counter:
                heapq.heappop(heap)
                self._push(t)
            else:
                return t
        return None

    def _pop_min(self) -> _Tenant | None:
        t = self._peek_min()
        if t is not None:
            heapq.heappop(self._heap)
            t.stamp = -1
        return t

    # --- SchedulerPolicy --------------------------------------------------------------------

    def add(self, req: SchedRequest, now: float) -> None:
        if req.request_id in self._running:
            self._requeue_preempted(req)
        t = self._tenant(req.tenant)
        if not t.waiting:
            # No banked credit: a tenant that was not backlogged starts level with the least
            # served backlogged tenant (or the one admitted last, when no one waits).
            lowest = self._peek_min()
            t.counter = max(t.counter, lowest.counter if lowest else self._floor)
            self._push(t)
        newest = next(reversed(t.waiting.values()), None)
        t.waiting[req.request_id] = _Waiting(req, now)
        if newest is not None and req.arrival_time < newest.req.arrival_time:
            # A preempted request goes back in arrival order, ahead of its tenant's later ones.
            t.waiting = dict(sorted(t.waiting.items(), key=lambda kv: kv[1].req.arrival_time))
        self._num_waiting += 1
        if req.adapter is not None:
            self._adapter_waiting[req.adapter] = self._adapter_waiting.get(req.adapter, 0) + 1

    def remove(self, req: SchedRequest) -> None:
        t = self._tenants.get(req.tenant)
        if t is None or t.waiting.pop(req.request_id, None) is None:
            return
        self._dequeued(req)
        self._ledger.pop(req.request_id, None)

    def schedule(self, now: float, ctx: AdmissionContext) -> list[SchedRequest]:
        admitted: list[SchedRequest] = []
        skipped: list[_Tenant] = []  # nothing admissible this step; they keep their place
        budget = self.config.max_scan
        while budget > 0:
            t = self._pop_min()
            if t is None:
                break
            req, budget, full = self._pick(t, now, ctx, budget)
            if req is not None:
                admitted.append(req)
            if req is None or full:
                skipped.append(t)
            elif t.waiting:
                self._push(t)
            if full:
                break
        for t in skipped:
            if t.waiting:
                self._push(t)
        return admitted

    def on_service(self, req: SchedRequest, input_tokens: int, output_tokens: int, now: float) -> None:
        led = self._ledger.get(req.request_id)
        if led is None:
            return
        led.served_this_run += input_tokens + output_tokens
        covered = min(led.free, input_tokens)
        led.free -= covered
        input_tokens -= covered
        covered = min(led.prepaid, input_tokens)
        led.prepaid -= covered
        input_tokens -= covered
        if input_tokens or output_tokens:
            self._charge(self._tenants[req.tenant], input_tokens, output_tokens)

    def on_finish(self, req: SchedRequest, now: float) -> None:
        if self._running.pop(req.request_id, None) is None:
            self.remove(req)
            return
        self._refund_prepaid(req, self._ledger.pop(req.request_id))
        self.slots.release(req.adapter)

    def pick_victim(self, running: list[SchedRequest]) -> SchedRequest:
        """The newest request of the tenant with the largest counter: it has had the most service
        and the newest request has the least progress to recompute."""
        return max(running, key=lambda r: (self.counter(r.tenant), r.arrival_time))

    def num_waiting(self) -> int:
        return self._num_waiting

    def num_running(self) -> int:
        return len(self._running)

    # --- admission --------------------------------------------------------------------------

    def _pick(
        self, t: _Tenant, now: float, ctx: AdmissionContext, budget: int
    ) -> tuple[SchedRequest | None, int, bool]:
        """Admit ``t``'s oldest admissible request. Returns it (or None), the scan budget left,
        and whether capacity ran out (which ends the step: a later, smaller request must not
        overtake the tenant whose turn it is)."""
        for entry in list(t.waiting.values()):
            if budget <= 0:
                break
            budget -= 1
            req = entry.req
            if not ctx.adapter_ready(req):
                self.slots.unclaim(req)  # loading (again): let others use the slot meanwhile
                continue
            aged = now - entry.enqueued_at >= self.config.age_deadline_s
            single = req.adapter is not None and self._adapter_waiting[req.adapter] == 1
            kind = self.slots.gate(req, single=single, aged=aged)
            if kind is None:
                continue
            if not ctx.try_admit(req):
                return None, budget, True
            self._admitted(t, entry, kind)
            return req, budget, False
        return None, budget, False

    def _admitted(self, t: _Tenant, entry: _Waiting, kind: SlotKind) -> None:
        req = entry.req
        del t.waiting[req.request_id]
        self._dequeued(req)
        self.slots.occupy(req, kind)
        self._running[req.request_id] = req
        led = self._ledger.get(req.request_id)
        if led is None:  # first admission: charge the prompt now, reconciled by on_service
            led = self._ledger[req.request_id] = _Ledger(prepaid=req.num_prompt_tokens)
            self._charge(t, req.num_prompt_tokens, 0)
        led.served_this_run = 0
        self._floor = t.counter

    def _dequeued(self, req: SchedRequest) -> None:
        self._num_waiting -= 1
        if req.adapter is not None:
            left = self._adapter_waiting[req.adapter] - 1
            if left:
                self._adapter_waiting[req.adapter] = left
            else:
                del self._adapter_waiting[req.adapter]
        self.slots.unclaim(req)

    def _requeue_preempted(self, req: SchedRequest) -> None:
        del self._running[req.request_id]
        self.slots.release(req.adapter)
        led = self._ledger[req.request_id]
        self._refund_prepaid(req, led)
        # Recomputing what it had been served is the engine's doing, not the tenant's.
        led.free = led.served_this_run

    def _refund_prepaid(self, req: SchedRequest, led: _Ledger) -> None:
        if not led.prepaid:
            return
        t = self._tenants[req.tenant]
        t.counter -= led.prepaid * self.config.input_weight / t.weight
        led.prepaid = 0
        if t.waiting:
            self._push(t)  # its entry's key is now above its counter
