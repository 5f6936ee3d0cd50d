"""Virtual Token Counter scheduling (Sheng et al., OSDI 2024) with adapter-aware admission.

Every tenant carries a counter of the weighted service it has received: ``input_weight`` per
prompt token and ``output_weight`` per generated token, divided by the tenant's weight. Each
admission goes to the backlogged tenant with the smallest counter. The prompt is charged when a
request is admitted (so one step cannot hand one tenant every free row) and output as it is
produced. Which adapters may enter is :mod:`lorapage.scheduler.lanes`' business;
docs/scheduling.md explains how the two interact.

A tenant none of whose waiting requests can enter now is *parked*: it leaves VTC order and comes
back only on an event that may let it in (a lane frees, its adapter opens, closes or loads, a
request of it ages past the deadline, it sends another request). That keeps a step's cost
independent of how many tenants wait on the long tail of adapters.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Generic

from lorapage.scheduler.base import AdmissionContext, R, SchedRequest
from lorapage.scheduler.groups import AdapterGroups
from lorapage.scheduler.lanes import AdapterLanes, Blocked, LaneKind
from lorapage.scheduler.tenant_queue import Tenant, TenantQueue, TenantState, Waiting

ACTIVE, IDLE = TenantState.ACTIVE, TenantState.IDLE


@dataclass(frozen=True)
class VtcConfig:
    """Knobs of :class:`VtcScheduler`; durations in seconds of the injected clock."""

    input_weight: float = 1.0  # counter units per prompt token
    output_weight: float = 2.0  # counter units per generated token
    max_loras: int = 32  # distinct adapters the running batch may hold
    reserved_tail_lanes: int | None = None  # of max_loras, for single-request adapters; None: max_loras // 8
    age_deadline_s: float = 1.0  # a request waiting this long may take any lane, or claim the next
    # Decode steps a lent tail lane is kept once a request wants it back: then the recalled
    # holder's rows are preempted (lanes.py), so a tail request waits at most this many steps for
    # a lane. 16 x 50 ms a step: 0.8 s, inside the design's p95 TTFT of 1 s warm. None or 0: no
    # bound (it waits for the recalled holder's whole generation).
    lend_max_tokens: int | None = 16
    max_scan: int = 1024  # waiting requests examined per step at most (bounds the step's cost)

    def __post_init__(self) -> None:
        for name in ("input_weight", "output_weight", "age_deadline_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"VtcConfig.{name} must be >= 0; got {getattr(self, name)}")
        for name in ("max_loras", "max_scan"):
            if getattr(self, name) < 1:
                raise ValueError(f"VtcConfig.{name} must be >= 1; got {getattr(self, name)}")
        if not 0 <= self.tail_lanes < self.max_loras:
            raise ValueError(
                f"VtcConfig.reserved_tail_lanes must be in [0, max_loras={self.max_loras}); "
                f"got {self.reserved_tail_lanes}"
            )

    @property
    def tail_lanes(self) -> int:
        return self.max_loras // 8 if self.reserved_tail_lanes is None else self.reserved_tail_lanes


# Entries of ``lanes.wanting`` looked at past a front one whose adapter is loading (bounds a step's cost).
_LOOKAHEAD = 8
# Line entries beyond twice the requests that could still use one before the line is compacted.
_COMPACT_SLACK = 64


@dataclass(eq=False, slots=True)
class _Ledger(Generic[R]):
    """What a running request has been charged, so that nothing is charged twice."""

    tenant: Tenant[R]
    prepaid: int = 0  # prompt tokens charged at admission and not yet reported as served
    free: int = 0  # tokens a recompute after preemption may prefill without charge
    served_this_run: int = 0  # tokens served since the last (re)admission
    generated: int = 0  # output tokens over every run (what is left: max_tokens - generated)


class VtcScheduler(Generic[R]):
    """Fair admission across tenants by Virtual Token Counter, grouped by adapter.

    Contract with the engine (beyond :class:`~lorapage.scheduler.base.SchedulerPolicy`): each
    admitted request ends with exactly one ``on_finish`` or one ``preempt`` (not both); a
    recompute prefill is reported through ``on_service`` as input tokens and is free up to what
    the request had been served before it was preempted.
    """

    def __init__(self, config: VtcConfig | None = None, tenant_weights: Mapping[str, float] | None = None) -> None:
        self.config = config or VtcConfig()
        self.lanes = AdapterLanes(
            self.config.max_loras, self.config.tail_lanes, self.config.lend_max_tokens, self._tokens_left
        )
        self._weights: dict[str, float] = dict(tenant_weights or {})
        self._queue: TenantQueue[R] = TenantQueue()
        self._groups: AdapterGroups[R] = AdapterGroups()
        self._floor = 0.0  # counter of the tenant admitted last: the lift when nobody is backlogged
        self._running: dict[str, R] = {}
        self._ledger: dict[str, _Ledger[R]] = {}
        self._num_waiting = 0
        # Parked requests that need a lane, oldest first; while no claim is pending, the oldest
        # past the age deadline is woken to take one. One entry per request (_in_line).
        self._line: list[tuple[float, str, str]] = []  # (enqueued_at, request_id, tenant)
        self._in_line: set[str] = set()
        # Requests of parked tenants to look at one by one next step, instead of waking the
        # whole tenant: new arrivals, and requests whose adapter is still loading.
        self._fresh: list[Waiting[R]] = []
        self._loading: dict[str, Waiting[R]] = {}

    # --- tenants and counters ---------------------------------------------------------------

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        """New VTC shares (tenants file reloaded); they apply to service charged from now on."""
        self._weights = dict(weights)
        for t in self._queue.tenants.values():
            t.in_cost, t.out_cost = self._costs(t.name)

    def counter(self, tenant: str) -> float:
        t = self._queue.tenants.get(tenant)
        return t.counter if t else 0.0

    def counters(self) -> dict[str, float]:
        return {name: t.counter for name, t in self._queue.tenants.items()}

    def _costs(self, tenant: str) -> tuple[float, float]:
        weight = self._weights.get(tenant, 1.0)
        return self.config.input_weight / weight, self.config.output_weight / weight

    def _tenant(self, name: str) -> Tenant[R]:
        t = self._queue.tenants.get(name)
        if t is None:
            t = self._queue.tenants[name] = Tenant(name, *self._costs(name))
        return t

    # --- SchedulerPolicy --------------------------------------------------------------------

    def add(self, req: R, now: float) -> None:
        if req.request_id in self._running:
            raise ValueError(
                f"request {req.request_id!r} is running: a preempted request comes back through preempt(), not add()"
            )
        self._enqueue(req, now)

    def preempt(self, req: R, now: float) -> None:
        if req.request_id not in self._running:
            raise ValueError(f"request {req.request_id!r} is not running: only an admitted request can be preempted")
        del self._running[req.request_id]
        self.lanes.release(req.adapter)
        led = self._ledger[req.request_id]
        self._refund_prepaid(led)
        # Recomputing what it had been served is the engine's doing, not the tenant's.
        led.free = led.served_this_run
        self._enqueue(req, now)

    def remove(self, req: R) -> None:
        t = self._queue.tenants.get(req.tenant)
        entry = t.waiting.pop(req.request_id, None) if t else None
        if t is None or entry is None:
            return
        self._dequeued(entry)
        self._ledger.pop(req.request_id, None)
        if not t.waiting:
            self._queue.set_state(t, IDLE)
        self._bound_line()

    def schedule(self, now: float, ctx: AdmissionContext[R]) -> list[R]:
        self._wake(now, ctx)
        admitted: list[R] = []
        examined: list[Tenant[R]] = []  # put back (active or parked) at the end of the step
        budget = self.config.max_scan
        while budget > 0:
            t = self._next_tenant()
            if t is None:
                break
            self._queue.take_out(t)
            req, budget, full = self._pick(t, now, ctx, budget)
            if req is None or full:
                examined.append(t)
                if full:
                    break
                continue
            admitted.append(req)
            self._queue.set_state(t, ACTIVE if t.waiting else IDLE)
            self._wake_changed(now, ctx)
            self._wake_biggest_group(now, ctx)
        for t in examined:
            self._queue.put_back(t)
        return admitted

    def reclaim(self, now: float) -> list[R]:
        """Running rows to preempt before this step's admissions: those of a holder of a lent
        tail lane recalled ``lend_max_tokens`` steps ago for a request still wanting a lane."""
        adapter = self.lanes.reclaim()
        if adapter is None:
            return []
        return [r for r in self._running.values() if r.adapter == adapter]

    def _tokens_left(self) -> dict[str, int]:
        """Most output tokens any running row of each adapter has left (asked only on a recall)."""
        left: dict[str, int] = {}
        for req in self._running.values():
            if req.adapter is not None:
                led = self._ledger.get(req.request_id)
                n = req.max_tokens - (led.generated if led else 0)
                left[req.adapter] = max(left.get(req.adapter, 0), n)
        return left

    def on_service(self, req: R, input_tokens: int, output_tokens: int, now: float) -> None:
        led = self._ledger.get(req.request_id)
        if led is None:
            return
        t = led.tenant
        led.served_this_run += input_tokens + output_tokens
        led.generated += output_tokens
        if input_tokens:  # prefill: the prompt was paid at admission, a recompute is free
            covered = min(led.free, input_tokens)
            led.free -= covered
            input_tokens -= covered
            covered = min(led.prepaid, input_tokens)
            led.prepaid -= covered
            t.counter += (input_tokens - covered) * t.in_cost
        t.counter += output_tokens * t.out_cost

    def on_finish(self, req: R, now: float) -> None:
        if self._running.pop(req.request_id, None) is None:
            self.remove(req)
            return
        self._refund_prepaid(self._ledger.pop(req.request_id))
        self.lanes.release(req.adapter)
        self._bound_line()

    def pick_victim(self, running: list[R]) -> R:
        """The newest request of the tenant with the largest counter: it has had the most service
        and the newest request has the least progress to recompute."""
        return max(running, key=lambda r: (self.counter(r.tenant), r.arrival_time))

    def num_waiting(self) -> int:
        return self._num_waiting

    def num_running(self) -> int:
        return len(self._running)

    def index_sizes(self) -> dict[str, int]:
        """Entries in the lazy heaps, stale ones included, beside what they index; each heap
        stays within about twice its live count, however long the server runs."""
        return {
            "tenant_heap_entries": self._queue.heap_entries(),
            "tenants_waiting": sum(1 for t in self._queue.tenants.values() if t.state is not IDLE),
            "line_entries": len(self._line),
            "waiting_or_running": self._num_waiting + len(self._running),
            "group_heap_entries": self._groups.heap_entries(),
            "groups": len(self._groups.groups),
            "wanting_entries": len(self.lanes.wanting),
        }

    # --- arrivals ---------------------------------------------------------------------------

    def _enqueue(self, req: R, now: float) -> None:
        """``req`` waits from ``now``: a new arrival, or a preempted request back in the queue."""
        t = self._tenant(req.tenant)
        if t.state is IDLE:
            # No banked credit: a tenant that was not backlogged starts level with the least
            # served backlogged tenant (or the one admitted last, when no one waits).
            lowest = self._queue.backlogged_lowest()
            t.counter = max(t.counter, lowest.counter if lowest else self._floor)
        newest = next(reversed(t.waiting.values()), None)
        entry = t.waiting[req.request_id] = Waiting(req, now)
        if newest is not None and req.arrival_time < newest.req.arrival_time:
            # A preempted request goes back in arrival order, ahead of its tenant's later ones.
            t.waiting = dict(sorted(t.waiting.items(), key=lambda kv: kv[1].req.arrival_time))
        if t.state is IDLE:
            self._queue.set_state(t, ACTIVE)
        elif t.state is not ACTIVE:
            self._fresh.append(entry)  # parked: only this request needs a look
        self._num_waiting += 1
        if req.adapter is not None:
            self._groups.add(entry, self.lanes.running)
            size = self._groups.size(req.adapter)
            if size == 1:
                self.lanes.want(req)  # it may take a tail lane: keep them from being lent
            elif size == 2:  # the other one is no single any more (aged, it asks again when refused)
                self.lanes.unwant(next(iter(self._groups.groups[req.adapter].values())).req)

    # --- one tenant's turn ------------------------------------------------------------------

    def _next_tenant(self) -> Tenant[R] | None:
        """The lowest counter among active tenants and the parked tenants that could open a
        free lane: a tail lane, or one of two or more unclaimed general lanes (the last general
        lane goes to the biggest group, whose tenants are woken for it)."""
        states = [ACTIVE]
        anyone_may_open = self.lanes.claim is None and self.lanes.free_general() >= 2
        if anyone_may_open or self.lanes.free_tail():
            states.append(TenantState.PARKED_ANY)
        if anyone_may_open:
            states.append(TenantState.PARKED_GENERAL)
        return self._queue.lowest(tuple(states))

    def _pick(self, t: Tenant[R], now: float, ctx: AdmissionContext[R], budget: int) -> tuple[R | None, int, bool]:
        """Admit ``t``'s oldest request that can enter. Returns it (or None), the scan budget
        left, and whether capacity ran out, which ends the step: a later, smaller request must
        not overtake the tenant whose turn it is. With none that can enter, ``t`` is parked."""
        blocked: list[tuple[Waiting[R], Blocked]] = []
        for entry in list(t.waiting.values()):
            if budget <= 0:
                t.state = ACTIVE  # not fully examined: not parked
                return None, budget, False
            budget -= 1
            gate = self._gate(entry, now, ctx)
            if gate is None:
                continue
            if isinstance(gate, Blocked):
                blocked.append((entry, gate))
                continue
            if not ctx.try_admit(entry.req):
                t.state = ACTIVE
                return None, budget, True
            self._admitted(t, entry, gate)
            return entry.req, budget, False
        t.state = TenantState.PARKED_ADAPTER  # what is left when every request is loading
        for entry, reason in blocked:
            self._park(t, entry, reason)
        return None, budget, False

    def _gate(self, entry: Waiting[R], now: float, ctx: AdmissionContext[R]) -> LaneKind | Blocked | None:
        """How ``entry`` would enter now, why it cannot, or None while its adapter loads."""
        req = entry.req
        if not ctx.adapter_ready(req):
            self.lanes.loading(req)  # its claim lapses (others use the lane meanwhile); a tail lane stays held
            self._loading[req.request_id] = entry
            return None
        aged = now - entry.enqueued_at >= self.config.age_deadline_s
        group = self._groups.size(req.adapter) if req.adapter is not None else 0
        return self.lanes.gate(req, group=group, aged=aged, best_group=lambda: self._biggest_group_size(ctx))

    def _park(self, t: Tenant[R], entry: Waiting[R], reason: Blocked) -> None:
        """``entry`` cannot enter for ``reason``: raise ``t``'s parked state to match, and put
        ``entry`` in line for the claim unless only its own adapter can let it in."""
        state = TenantState.parked_for(reason)
        if state.openness > t.state.openness:
            t.state = state
        req = entry.req
        if reason is not Blocked.ADAPTER and req.request_id not in self._in_line:
            heapq.heappush(self._line, (entry.enqueued_at, req.request_id, t.name))
            self._in_line.add(req.request_id)
            self._bound_line()

    def _bound_line(self) -> None:
        """Keep the line within twice the requests that may still use an entry (plus slack), by
        dropping the entries of requests gone for good (finished or aborted): the line only ever
        skipped them. A running request keeps its entry, which it finds again if preempted."""
        if len(self._line) <= 2 * (self._num_waiting + len(self._running)) + _COMPACT_SLACK:
            return
        queue, running = self._queue, self._running
        self._line[:] = [e for e in self._line if e[1] in running or e[1] in queue.tenants[e[2]].waiting]
        heapq.heapify(self._line)
        self._in_line = {e[1] for e in self._line}

    def _admitted(self, t: Tenant[R], entry: Waiting[R], kind: LaneKind) -> None:
        req = entry.req
        del t.waiting[req.request_id]
        self._dequeued(entry)
        self.lanes.occupy(req, kind)
        self._running[req.request_id] = req
        led = self._ledger.get(req.request_id)
        if led is None:  # first admission: charge the prompt now, reconciled by on_service
            led = self._ledger[req.request_id] = _Ledger(t, prepaid=req.num_prompt_tokens)
            t.counter += req.num_prompt_tokens * t.in_cost
        led.served_this_run = 0
        self._floor = t.counter

    def _dequeued(self, entry: Waiting[R]) -> None:
        self._num_waiting -= 1
        if entry.req.adapter is not None:
            self._groups.remove(entry, self.lanes.running)
        self.lanes.unclaim(entry.req)

    def _refund_prepaid(self, led: _Ledger[R]) -> None:
        if led.prepaid:
            led.tenant.counter -= led.prepaid * led.tenant.in_cost
            led.prepaid = 0
            self._queue.counter_dropped(led.tenant)

    # --- waking parked tenants --------------------------------------------------------------

    def _wake(self, now: float, ctx: AdmissionContext[R]) -> None:
        """Before a step: act on what happened since the last one."""
        self._lend_or_recall(now, ctx)
        fresh, self._fresh = self._fresh, []
        loading, self._loading = self._loading, {}
        self._look_at(fresh + list(loading.values()), now, ctx)
        self._wake_changed(now, ctx)
        self._wake_biggest_group(now, ctx)
        claim = self.lanes.claim
        if claim is not None:
            if self.lanes.free_general() or self.lanes.free_tail():
                self._queue.activate(self._queue.tenants[claim.tenant])  # its lane is here
            return
        line = self._line
        while line:  # no claim pending: the oldest parked request past the deadline may take it
            enqueued_at, request_id, name = line[0]
            t = self._queue.tenants[name]
            if request_id in t.waiting and enqueued_at + self.config.age_deadline_s > now:
                return
            heapq.heappop(line)
            self._in_line.discard(request_id)
            if request_id in t.waiting:
                self._queue.activate(t)
                return

    def _lend_or_recall(self, now: float, ctx: AdmissionContext[R]) -> None:
        """Drop the stale front of ``lanes.wanting``: if a request is left that could open any
        lane, lanes lent are owed back; if it could once its adapter has loaded, nothing changes
        (the reservation holds: a lane lent now would be held for a whole generation, the load
        takes a moment); if none is left, the reserved lanes are lent."""
        wanting = self.lanes.wanting
        while wanting:
            req = next(iter(wanting.values()))
            entry = self._queue.tenants[req.tenant].waiting.get(req.request_id)
            may_open = self._may_open_any(entry, now, ctx) if entry is not None else False
            if may_open is None:  # loading: a ready one a little further back is owed a lane now
                if any(self._ready_to_open(r, now, ctx) for r in islice(wanting.values(), 1, 1 + _LOOKAHEAD)):
                    self.lanes.recall()
                return
            if may_open:
                self.lanes.recall()
                return
            self.lanes.unclaim(req)
        self.lanes.lend()

    def _ready_to_open(self, req: SchedRequest, now: float, ctx: AdmissionContext[R]) -> bool:
        entry = self._queue.tenants[req.tenant].waiting.get(req.request_id)
        return entry is not None and self._may_open_any(entry, now, ctx) is True

    def _may_open_any(self, entry: Waiting[R], now: float, ctx: AdmissionContext[R]) -> bool | None:
        """Whether ``entry`` may take a tail lane: its adapter is outside the batch, and it is a
        single request for that adapter or aged. None: it may once its adapter has loaded."""
        req = entry.req
        if req.adapter is None or req.adapter in self.lanes.running:
            return False
        if not (self._groups.size(req.adapter) == 1 or now - entry.enqueued_at >= self.config.age_deadline_s):
            return False
        if not ctx.adapter_ready(req):
            self._loading[req.request_id] = entry  # looked at again once it has loaded
            return None
        return True

    def _look_at(self, entries: list[Waiting[R]], now: float, ctx: AdmissionContext[R]) -> None:
        """Wake the parked tenant of each entry that can enter now; register the others."""
        for entry in entries:
            req = entry.req
            t = self._queue.tenants[req.tenant]
            if req.request_id not in t.waiting or t.state is IDLE or t.state is ACTIVE:
                continue  # gone, or its tenant is examined in full anyway
            gate = self._gate(entry, now, ctx)
            if isinstance(gate, LaneKind):
                self._queue.activate(t)
            elif isinstance(gate, Blocked):
                before = t.state
                self._park(t, entry, gate)
                if t.state is not before:
                    self._queue.set_state(t, t.state)  # into the heap of its new state

    def _wake_changed(self, now: float, ctx: AdmissionContext[R]) -> None:
        """Adapters opened, closed or stopped closing: look again at their waiting requests."""
        changed = self.lanes.changed
        while changed:
            adapter = changed.pop()
            self._groups.push(adapter, self.lanes.running)  # it may have left the batch
            self._look_at(self._groups.entries(adapter), now, ctx)

    def _wake_biggest_group(self, now: float, ctx: AdmissionContext[R]) -> None:
        """A general lane is free: make sure a tenant waiting on the biggest group is active to
        open it (once open, the rest of the group is looked at as joins)."""
        if self.lanes.claim is not None or not self.lanes.free_general():
            return
        best = self._biggest_group(ctx)
        for entry in self._groups.entries(best) if best is not None else ():
            t = self._queue.tenants[entry.req.tenant]
            if t.state is ACTIVE:
                return
            if isinstance(self._gate(entry, now, ctx), LaneKind):
                self._queue.activate(t)
                return

    def _biggest_group(self, ctx: AdmissionContext[R]) -> str | None:
        return self._groups.biggest(self.lanes.running, lambda entry: ctx.adapter_ready(entry.req))

    def _biggest_group_size(self, ctx: AdmissionContext[R]) -> int:
        best = self._biggest_group(ctx)
        return self._groups.size(best) if best is not None else 0
