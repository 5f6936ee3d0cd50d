"""Step-level simulation of the engine around an unmodified :class:`SchedulerPolicy`.

The model: a step prefills the requests admitted in it (prompt plus, after a preemption, what it
had generated) and decodes one token for every other running request; every running request
gains one token per step. A step costs ``CostModel`` seconds of virtual time. KV pages are
reserved for the prompt at admission and grow a block at a time while decoding; when they run
out, the policy picks a victim, which loses its pages and queues again through
``policy.preempt`` (recompute).

Where adapters are is a :class:`ReplicaAdapters`: by default an adapter becomes ready
``adapter_load_s`` after its first request arrives and stays resident; the fleet simulator passes
:class:`~lorapage.sim.loader.SimLoader` (the engine's residency rules: slots, host RAM, disk,
loads by tier). A request's first token comes at the end of the step that prefilled it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from lorapage.scheduler.base import SchedulerPolicy
from lorapage.sim.costs import StepShape


@dataclass(eq=False)
class SimRequest:
    """A request of a trace. It generates exactly ``max_tokens`` tokens."""

    request_id: str
    tenant: str
    adapter: str | None
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int
    admitted_at: float | None = None  # first admission
    first_token_at: float | None = None  # end of the step that produced its first token
    finished_at: float | None = None
    tier: str = "none"  # where its adapter was when it arrived (none: the base model)
    generated: int = 0
    preemptions: int = 0

    @property
    def queue_wait(self) -> float:
        assert self.admitted_at is not None, f"{self.request_id} was never admitted"
        return self.admitted_at - self.arrival_time


@dataclass(frozen=True)
class CostModel:
    """Seconds of one step: fixed + per token processed + per distinct adapter in the batch."""

    step_s: float = 0.010
    per_token_s: float = 20e-6
    per_adapter_s: float = 0.2e-3

    def step_time(self, tokens: int, distinct_adapters: int) -> float:
        return self.step_s + self.per_token_s * tokens + self.per_adapter_s * distinct_adapters

    def time(self, shape: StepShape) -> float:
        tokens = shape.prefill_tokens + shape.decode_rows
        return self.step_time(tokens, len(shape.adapter_ranks)) + shape.copy_s


class StepCost(Protocol):
    """Seconds of one step (:class:`CostModel`, :class:`~lorapage.sim.costs.StepCosts`)."""

    def time(self, shape: StepShape) -> float: ...


class ReplicaAdapters(Protocol):
    """Where adapters are, as the simulator asks it (the engine's ``AdapterCache`` role)."""

    def arrive(self, name: str, now: float, tenant: str | None = None) -> str:
        """A request for ``name`` (from ``tenant``) arrived: its tier, and its load starts if needed."""
        ...

    def ready(self, name: str) -> bool: ...

    def admit(self, name: str) -> None:
        """A request for ``name`` is admitted: it runs on the adapter."""
        ...

    def finish(self, name: str, now: float) -> None:
        """A request for ``name`` that ran ended."""
        ...

    def requeue(self, name: str, now: float) -> None: ...

    def advance(self, now: float) -> float:
        """Finish what is due by ``now``; the device seconds of copies it did (added to the step)."""
        ...

    def next_event(self, now: float) -> float | None:
        """When a load next progresses on its own (None: never)."""
        ...


class FixedLoad:
    """An adapter is ready ``load_s`` after its first request and stays resident (tier ``gpu``
    once loaded, ``disk`` before)."""

    def __init__(self, load_s: float) -> None:
        self.load_s = load_s
        self.ready_at: dict[str, float] = {}  # adapter -> when its load completes
        self._now = 0.0

    def arrive(self, name: str, now: float, tenant: str | None = None) -> str:
        self._now = now
        at = self.ready_at.setdefault(name, now + self.load_s)
        return "gpu" if at <= now else "disk"

    def ready(self, name: str) -> bool:
        return self.ready_at[name] <= self._now

    def admit(self, name: str) -> None:
        return None

    def finish(self, name: str, now: float) -> None:
        return None

    def requeue(self, name: str, now: float) -> None:
        return None

    def advance(self, now: float) -> float:
        self._now = now
        return 0.0

    def next_event(self, now: float) -> float | None:
        later = [t for t in self.ready_at.values() if t > now]
        return min(later) if later else None


@dataclass(frozen=True)
class SimConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    num_kv_pages: int = 4096
    block_size: int = 16
    adapter_load_s: float = 0.05  # of the default FixedLoad residency
    cost: StepCost = field(default_factory=CostModel)
    adapter_rank: int = 16  # the rank the step cost charges each distinct adapter at


class _Context:
    """The engine's side of :class:`~lorapage.scheduler.base.AdmissionContext` for one step."""

    def __init__(self, sim: Simulator, now: float) -> None:
        self._sim = sim
        self._now = now
        self.admitted: list[SimRequest] = []
        self.tokens = len(sim.running)  # one decode token per running request

    def adapter_ready(self, req: SimRequest) -> bool:
        return req.adapter is None or self._sim.residency.ready(req.adapter)

    def try_admit(self, req: SimRequest) -> bool:
        sim = self._sim
        prefill = req.num_prompt_tokens + req.generated
        pages = sim.pages_for(prefill + 1)
        if (
            len(sim.running) + len(self.admitted) >= sim.config.max_num_seqs
            or self.tokens + prefill > sim.config.max_num_batched_tokens
            or pages > sim.free_pages
        ):
            return False
        sim.free_pages -= pages
        sim.pages[req.request_id] = pages
        self.tokens += prefill
        self.admitted.append(req)
        if req.adapter is not None:
            sim.residency.admit(req.adapter)
        return True


class Simulator:
    """Runs ``trace`` through ``policy`` on a virtual clock; results land on the requests and in
    ``served`` (tenant -> [input tokens, output tokens], counting each token once)."""

    def __init__(
        self,
        policy: SchedulerPolicy[SimRequest],
        config: SimConfig,
        trace: Iterable[SimRequest] = (),
        residency: ReplicaAdapters | None = None,
    ) -> None:
        self.policy = policy
        self.config = config
        self.residency: ReplicaAdapters = residency if residency is not None else FixedLoad(config.adapter_load_s)
        self.trace = sorted(trace, key=lambda r: r.arrival_time)
        self._next = 0  # index in trace of the next arrival
        self.now = 0.0
        self.running: list[SimRequest] = []
        self.waiting: set[SimRequest] = set()
        self.pages: dict[str, int] = {}  # request_id -> KV pages held
        self.free_pages = config.num_kv_pages
        self._copy_s = 0.0  # adapter copies done since the last step, charged to the next
        self.served: defaultdict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.steps = 0
        self.busy_s = 0.0  # virtual seconds spent in steps (the device busy)
        self.rows = 0  # requests over all steps (rows / steps: how full batches are)
        self.last_batch_size = 0  # rows of the latest step
        self.preemptions = 0

    def submit(self, req: SimRequest) -> None:
        """Add a request arriving at or after every one added so far (the fleet routes online)."""
        if self.trace and req.arrival_time < self.trace[-1].arrival_time:
            raise ValueError(f"{req.request_id} arrives at {req.arrival_time}, before the last submitted request")
        self.trace.append(req)

    @property
    def in_flight(self) -> int:
        """Requests running or waiting here."""
        return len(self.running) + len(self.waiting) + len(self.trace) - self._next

    @property
    def tokens_in_flight(self) -> int:
        """Prompt + remaining output tokens of the requests running or waiting here (a router's
        ``ReplicaView.tokens_in_flight``)."""
        reqs = [*self.running, *self.waiting, *self.trace[self._next :]]
        return sum(r.num_prompt_tokens + r.max_tokens - r.generated for r in reqs)

    @property
    def kv_free(self) -> float:
        """Fraction of the KV pages free."""
        return self.free_pages / max(self.config.num_kv_pages, 1)

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.config.block_size)

    def run(self, until: float = math.inf, on_step: Callable[[Simulator], None] | None = None) -> None:
        """Simulate until every request finished or the clock passes ``until`` (call again to go on)."""
        while self.now < until:
            while self._next < len(self.trace) and self.trace[self._next].arrival_time <= self.now:
                self._arrive(self.trace[self._next])
                self._next += 1
            if not self.running and not self.waiting:  # idle until the next arrival or load event (a prefetch)
                wake = self._next_event()
                if wake is None:
                    return
                self.now = max(self.now, wake)
                self._copy_s += self.residency.advance(self.now)
                continue
            for req in self.policy.reclaim(self.now):  # a lent lane owed back past its bound
                if req in self.running:
                    self._preempt(req)
            self._make_room_for_decode()
            self._copy_s += self.residency.advance(self.now)
            ctx = _Context(self, self.now)
            self.policy.schedule(self.now, ctx)
            if not self.running and not ctx.admitted:
                wake = self._next_event()
                if wake is None:
                    raise RuntimeError(f"{len(self.waiting)} waiting requests can never be admitted at t={self.now}")
                self.now = wake
                continue
            self._step(ctx)
            if on_step is not None:
                on_step(self)

    def _arrive(self, req: SimRequest) -> None:
        if req.adapter is not None:
            req.tier = self.residency.arrive(req.adapter, self.now, req.tenant)
        self.waiting.add(req)
        self.policy.add(req, self.now)

    def _next_event(self) -> float | None:
        """The next arrival or load event (None: neither is left)."""
        load = self.residency.next_event(self.now)
        later = [load] if load is not None else []
        if self._next < len(self.trace):
            later.append(self.trace[self._next].arrival_time)
        return min(later) if later else None

    def _make_room_for_decode(self) -> None:
        """Give each running request a page for its next token, preempting when pages run out."""
        block = self.config.block_size
        pages = self.pages
        needy = [r for r in self.running if r.num_prompt_tokens + r.generated + 1 > pages[r.request_id] * block]
        for req in needy:
            if req not in self.running:
                continue  # preempted below, earlier in this loop
            while self.pages_for(req.num_prompt_tokens + req.generated + 1) > self.pages[req.request_id]:
                if self.free_pages:
                    self.free_pages -= 1
                    self.pages[req.request_id] += 1
                    continue
                victim = self.policy.pick_victim(list(self.running))
                self._preempt(victim)
                if victim is req:
                    break

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        self.free_pages += self.pages.pop(req.request_id)
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.add(req)
        if req.adapter is not None:
            self.residency.requeue(req.adapter, self.now)
        self.policy.preempt(req, self.now)

    def _step(self, ctx: _Context) -> None:
        batch = self.running + ctx.admitted
        distinct = len({r.adapter for r in batch if r.adapter is not None})
        started = self.now
        prefill = ctx.tokens - len(self.running)
        shape = StepShape(prefill, len(self.running), [self.config.adapter_rank] * distinct, self._copy_s)
        cost = self.config.cost.time(shape)
        self.now += cost
        self.busy_s += cost
        self._copy_s = 0.0
        self.steps += 1
        self.last_batch_size = len(batch)
        self.rows += len(batch)
        for req in ctx.admitted:
            self.waiting.discard(req)
            if req.admitted_at is None:
                req.admitted_at = started
                self.served[req.tenant][0] += req.num_prompt_tokens
            self._serve(req, req.num_prompt_tokens + req.generated)
        served, on_service, now = self.served, self.policy.on_service, self.now
        for req in self.running:  # _serve(req, 0), inlined: this loop is the simulator's hot path
            req.generated += 1
            served[req.tenant][1] += 1
            on_service(req, 0, 1, now)
        self.running = batch
        for req in [r for r in batch if r.generated >= r.max_tokens]:
            self.running.remove(req)
            self.free_pages += self.pages.pop(req.request_id)
            req.finished_at = self.now
            if req.adapter is not None:
                self.residency.finish(req.adapter, self.now)
            self.policy.on_finish(req, self.now)

    def _serve(self, req: SimRequest, input_tokens: int) -> None:
        if req.first_token_at is None:
            req.first_token_at = self.now
        req.generated += 1
        self.served[req.tenant][1] += 1
        self.policy.on_service(req, input_tokens, 1, self.now)
