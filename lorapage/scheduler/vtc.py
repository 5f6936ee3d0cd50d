"""Virtual Token Counter scheduling (Sheng et al., OSDI 2024) with adapter-aware admission.

Every tenant carries a counter of the weighted service it has received: ``input_weight`` per
prompt token and ``output_weight`` per generated token, divided by the tenant's weight. Each
admission goes to the backlogged tenant with the smallest counter. The prompt is charged when a
request is admitted (so one step cannot hand one tenant every free row) and output as it is
produced. Which adapters may enter is :mod:`lorapage.scheduler.slots`' business;
docs/scheduling.md explains how the two interact.

A tenant none of whose waiting requests can enter now is *parked*: it leaves VTC order and comes
back only on an event that may let it in (a slot frees, its adapter opens, closes or loads, a
request of it ages past the deadline, it sends another request). That keeps a step's cost
independent of how many tenants wait on the long tail of adapters.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass

from lorapage.scheduler.base import AdmissionContext, SchedRequest
from lorapage.scheduler.groups import AdapterGroups
from lorapage.scheduler.slots import AdapterSlots, Blocked, SlotKind
from lorapage.scheduler.tenant_queue import Tenant, TenantQueue, TenantState, Waiting

ACTIVE, IDLE = TenantState.ACTIVE, TenantState.IDLE


@dataclass(frozen=True)
class VtcConfig:
    """Knobs of :class:`VtcScheduler`; durations in seconds of the injected clock."""

    input_weight: float = 1.0  # counter units per prompt token
    output_weight: float = 2.0  # counter units per generated token
    max_loras: int = 32  # distinct adapters the running batch may hold
    reserved_tail_slots: int | None = None  # of max_loras, for single-request adapters; None: max_loras // 8
    age_deadline_s: float = 1.0  # a request waiting this long may take any slot, or claim the next
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


@dataclass(eq=False, slots=True)
class _Ledger:
    """What a running request has been charged, so that nothing is charged twice."""

    tenant: Tenant
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
        self.slots = AdapterSlots(self.config.max_loras, self.config.tail_slots)
        self._weights: dict[str, float] = dict(tenant_weights or {})
        self._queue = TenantQueue()
        self._groups = AdapterGroups()
        self._floor = 0.0  # counter of the tenant admitted last: the lift when nobody is backlogged
        self._running: dict[str, SchedRequest] = {}
        self._ledger: dict[str, _Ledger] = {}
        self._num_waiting = 0
        # Parked requests that need a slot, oldest first; while no claim is pending, the oldest
        # past the age deadline is woken to take one. One entry per request (_in_line).
        self._line: list[tuple[float, str, str]] = []  # (enqueued_at, request_id, tenant)
        self._in_line: set[str] = set()
        # Requests of parked tenants to look at one by one next step, instead of waking the
        # whole tenant: new arrivals, and requests whose adapter is still loading.
        self._fresh: list[Waiting] = []
        self._loading: dict[str, Waiting] = {}

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

    def _tenant(self, name: str) -> Tenant:
        t = self._queue.tenants.get(name)
        if t is None:
            t = self._queue.tenants[name] = Tenant(name, *self._costs(name))
        return t

    # --- SchedulerPolicy --------------------------------------------------------------------

    def add(self, req: SchedRequest, now: float) -> None:
        if req.request_id in self._running:
            self._requeue_preempted(req)
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
            self._groups.add(entry, self.slots.running)

    def remove(self, req: SchedRequest) -> None:
        t = self._queue.tenants.get(req.tenant)
        entry = t.waiting.pop(req.request_id, None) if t else None
        if t is None or entry is None:
            return
        self._dequeued(entry)
        self._ledger.pop(req.request_id, None)
        if not t.waiting:
            self._queue.set_state(t, IDLE)

    def schedule(self, now: float, ctx: AdmissionContext) -> list[SchedRequest]:
        self._wake(now, ctx)
        admitted: list[SchedRequest] = []
        examined: list[Tenant] = []  # put back (active or parked) at the end of the step
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

    def on_service(self, req: SchedRequest, input_tokens: int, output_tokens: int, now: float) -> None:
        led = self._ledger.get(req.request_id)
        if led is None:
            return
        t = led.tenant
        led.served_this_run += input_tokens + output_tokens
        if input_tokens:  # prefill: the prompt was paid at admission, a recompute is free
            covered = min(led.free, input_tokens)
            led.free -= covered
            input_tokens -= covered
            covered = min(led.prepaid, input_tokens)
            led.prepaid -= covered
            t.counter += (input_tokens - covered) * t.in_cost
        t.counter += output_tokens * t.out_cost

    def on_finish(self, req: SchedRequest, now: float) -> None:
        if self._running.pop(req.request_id, None) is None:
            self.remove(req)
            return
        self._refund_prepaid(self._ledger.pop(req.request_id))
        self.slots.release(req.adapter)

    def pick_victim(self, running: list[SchedRequest]) -> SchedRequest:
        """The newest request of the tenant with the largest counter: it has had the most service
        and the newest request has the least progress to recompute."""
        return max(running, key=lambda r: (self.counter(r.tenant), r.arrival_time))

    def num_waiting(self) -> int:
        return self._num_waiting

    def num_running(self) -> int:
        return len(self._running)

    # --- one tenant's turn ------------------------------------------------------------------

    def _next_tenant(self) -> Tenant | None:
        """The lowest counter among active tenants and the parked tenants that could open a
        free slot: a tail slot, or one of two or more unclaimed general slots (the last general
        slot goes to the biggest group, whose tenants are woken for it)."""
        states = [ACTIVE]
        anyone_may_open = self.slots.claim is None and self.slots.free_general() >= 2
        if anyone_may_open or self.slots.free_tail():
            states.append(TenantState.PARKED_ANY)
        if anyone_may_open:
            states.append(TenantState.PARKED_GENERAL)
        return self._queue.lowest(tuple(states))

    def _pick(self, t: Tenant, now: float, ctx: AdmissionContext, budget: int) -> tuple[SchedRequest | None, int, bool]:
        """Admit ``t``'s oldest request that can enter. Returns it (or None), the scan budget
        left, and whether capacity ran out, which ends the step: a later, smaller request must
        not overtake the tenant whose turn it is. With none that can enter, ``t`` is parked."""
        blocked: list[tuple[Waiting, Blocked]] = []
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

    def _gate(self, entry: Waiting, now: float, ctx: AdmissionContext) -> SlotKind | Blocked | None:
        """How ``entry`` would enter now, why it cannot, or None while its adapter loads."""
        req = entry.req
        if not ctx.adapter_ready(req):
            self.slots.unclaim(req)  # loading (again): let others use the slot meanwhile
            self._loading[req.request_id] = entry
            return None
        aged = now - entry.enqueued_at >= self.config.age_deadline_s
        group = self._groups.size(req.adapter) if req.adapter is not None else 0
        return self.slots.gate(req, group=group, aged=aged, best_group=lambda: self._biggest_group_size(ctx))

    def _park(self, t: Tenant, entry: Waiting, reason: Blocked) -> None:
        """``entry`` cannot enter for ``reason``: raise ``t``'s parked state to match, and put
        ``entry`` in line for the claim unless only its own adapter can let it in."""
        state = TenantState.parked_for(reason)
        if state.openness > t.state.openness:
            t.state = state
        req = entry.req
        if reason is not Blocked.ADAPTER and req.request_id not in self._in_line:
            heapq.heappush(self._line, (entry.enqueued_at, req.request_id, t.name))
            self._in_line.add(req.request_id)

    def _admitted(self, t: Tenant, entry: Waiting, kind: SlotKind) -> None:
        req = entry.req
        del t.waiting[req.request_id]
        self._dequeued(entry)
        self.slots.occupy(req, kind)
        self._running[req.request_id] = req
        led = self._ledger.get(req.request_id)
        if led is None:  # first admission: charge the prompt now, reconciled by on_service
            led = self._ledger[req.request_id] = _Ledger(t, prepaid=req.num_prompt_tokens)
            t.counter += req.num_prompt_tokens * t.in_cost
        led.served_this_run = 0
        self._floor = t.counter

    def _dequeued(self, entry: Waiting) -> None:
        self._num_waiting -= 1
        if entry.req.adapter is not None:
            self._groups.remove(entry, self.slots.running)
        self.slots.unclaim(entry.req)

    def _requeue_preempted(self, req: SchedRequest) -> None:
        del self._running[req.request_id]
        self.slots.release(req.adapter)
        led = self._ledger[req.request_id]
        self._refund_prepaid(led)
        # Recomputing what it had been served is the engine's doing, not the tenant's.
        led.free = led.served_this_run

    def _refund_prepaid(self, led: _Ledger) -> None:
        if led.prepaid:
            led.tenant.counter -= led.prepaid * led.tenant.in_cost
            led.prepaid = 0
            self._queue.counter_dropped(led.tenant)

    # --- waking parked tenants --------------------------------------------------------------

    def _wake(self, now: float, ctx: AdmissionContext) -> None:
        """Before a step: act on what happened since the last one."""
        fresh, self._fresh = self._fresh, []
        loading, self._loading = self._loading, {}
        self._look_at(fresh + list(loading.values()), now, ctx)
        self._wake_changed(now, ctx)
        self._wake_biggest_group(now, ctx)
        claim = self.slots.claim
        if claim is not None:
            if self.slots.free_general() or self.slots.free_tail():
                self._queue.activate(self._queue.tenants[claim.tenant])  # its slot is here
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

    def _look_at(self, entries: list[Waiting], now: float, ctx: AdmissionContext) -> None:
        """Wake the parked tenant of each entry that can enter now; register the others."""
        for entry in entries:
            req = entry.req
            t = self._queue.tenants[req.tenant]
            if req.request_id not in t.waiting or t.state is IDLE or t.state is ACTIVE:
                continue  # gone, or its tenant is examined in full anyway
            gate = self._gate(entry, now, ctx)
            if isinstance(gate, SlotKind):
                self._queue.activate(t)
            elif isinstance(gate, Blocked):
                before = t.state
                self._park(t, entry, gate)
                if t.state is not before:
                    self._queue.set_state(t, t.state)  # into the heap of its new state

    def _wake_changed(self, now: float, ctx: AdmissionContext) -> None:
        """Adapters opened, closed or stopped draining: look again at their waiting requests."""
        changed = self.slots.changed
        while changed:
            adapter = changed.pop()
            self._groups.push(adapter, self.slots.running)  # it may have left the batch
            self._look_at(self._groups.entries(adapter), now, ctx)

    def _wake_biggest_group(self, now: float, ctx: AdmissionContext) -> None:
        """A general slot is free: make sure a tenant waiting on the biggest group is active to
        open it (once open, the rest of the group is looked at as joins)."""
        if self.slots.claim is not None or not self.slots.free_general():
            return
        best = self._biggest_group(ctx)
        for entry in self._groups.entries(best) if best is not None else ():
            t = self._queue.tenants[entry.req.tenant]
            if t.state is ACTIVE:
                return
            if isinstance(self._gate(entry, now, ctx), SlotKind):
                self._queue.activate(t)
                return

    def _biggest_group(self, ctx: AdmissionContext) -> str | None:
        return self._groups.biggest(self.slots.running, lambda entry: ctx.adapter_ready(entry.req))

    def _biggest_group_size(self, ctx: AdmissionContext) -> int:
        best = self._biggest_group(ctx)
        return self._groups.size(best) if best is not None else 0
