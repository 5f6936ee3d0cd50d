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
from bisect import bisect_right
from collections import Counter, defaultdict
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

    def admit(self, name: str, now: float) -> None:
        """A request for ``name`` is admitted at ``now``: it runs on the adapter."""
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

    def settled_until(self, now: float) -> float:
        """Until when :meth:`advance` has nothing to do if nothing else happens (``now``: it may
        have now; ``math.inf``: never): steps before it may be run as one decode run."""
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

    def admit(self, name: str, now: float) -> None:
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

    def settled_until(self, now: float) -> float:
        return min((t for t in self.ready_at.values() if t >= now), default=math.inf)


@dataclass(frozen=True)
class SimConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    num_kv_pages: int = 4096
    block_size: int = 16
    adapter_load_s: float = 0.05  # of the default FixedLoad residency
    cost: StepCost = field(default_factory=CostModel)
    adapter_rank: int = 16  # the rank the step cost charges each distinct adapter at
    # Steps that only decode (nothing waits, arrives, loads or finishes) run as one decode run,
    # their rows' bookkeeping done once at its end: the same results, several times faster.
    decode_runs: bool = True


@dataclass
class _DecodeRun:
    """Steps of an unchanged batch that only decode: step ``i`` starts at ``times[i]``; ``done`` of
    its ``len(times) - 1`` steps are done; ``grows[k]``: the k-th KV page the rows take, at
    (after) that many steps."""

    times: list[float]
    cost: float
    grows: list[int]
    free_pages: int  # at its start
    tokens: int  # tokens in flight at its start
    done: int = 0


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
            sim.residency.admit(req.adapter, sim.now)
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
        self._tokens = sum(r.num_prompt_tokens + r.max_tokens for r in self.trace)  # in flight
        self._adapters: Counter[str] = Counter(r.adapter for r in self.trace if r.adapter is not None)
        self._quiet = False  # the last step left nothing waiting, and nothing arrived or was preempted since
        self._run: _DecodeRun | None = None

    def submit(self, req: SimRequest) -> None:
        """Add a request arriving at or after every one added so far (the fleet routes online)."""
        if self.trace and req.arrival_time < self.trace[-1].arrival_time:
            raise ValueError(f"{req.request_id} arrives at {req.arrival_time}, before the last submitted request")
        self.settle()
        self.trace.append(req)
        self._tokens += req.num_prompt_tokens + req.max_tokens - req.generated
        if req.adapter is not None:
            self._adapters[req.adapter] += 1

    @property
    def in_flight(self) -> int:
        """Requests running or waiting here."""
        return len(self.running) + len(self.waiting) + len(self.trace) - self._next

    @property
    def tokens_in_flight(self) -> int:
        """Prompt + remaining output tokens of the requests running or waiting here (a router's
        ``ReplicaView.tokens_in_flight``)."""
        return self._tokens

    @property
    def adapters_in_flight(self) -> int:
        """Distinct adapters of the requests running or waiting here."""
        return len(self._adapters)

    @property
    def kv_free(self) -> float:
        """Fraction of the KV pages free."""
        return self.free_pages / max(self.config.num_kv_pages, 1)

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.config.block_size)

    def run(self, until: float = math.inf, on_step: Callable[[Simulator], None] | None = None) -> None:
        """Simulate until every request finished or the clock passes ``until`` (call again to go on)."""
        while self.now < until:
            if self._run is not None:
                if self._go_on(until):
                    return
                continue
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
            if self._quiet and on_step is None and self.config.decode_runs and self._start_run():
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
            self._quiet = not self.waiting  # the policy has nothing left to decide
            if on_step is not None:
                on_step(self)

    def settle(self) -> None:
        """Bring the rows of a decode run under way up to date (their tokens, pages, the policy's
        counters): call it before reading a request or the policy between :meth:`run` calls."""
        run = self._run
        if run is None:
            return
        self._run = None
        n = run.done
        if not n:
            return
        now, block = run.times[n], self.config.block_size
        served, on_service, pages = self.served, self.policy.on_service, self.pages
        for req in self.running:
            req.generated += n
            served[req.tenant][1] += n
            on_service(req, 0, n, now)
            pages[req.request_id] = max(pages[req.request_id], -(-(req.num_prompt_tokens + req.generated) // block))
        self._finish(self.running)

    def _start_run(self) -> bool:
        """Plan the decode run from now, if at least one step of it is possible (nothing waits,
        the policy had nothing to do, no copy is due); :meth:`_go_on` carries it out."""
        running = self.running
        if not running or self.waiting or self._copy_s:
            return False
        limit = self.residency.settled_until(self.now)
        if self._next < len(self.trace):
            limit = min(limit, self.trace[self._next].arrival_time)
        if self.now >= limit:
            return False
        left = min(r.max_tokens - r.generated for r in running)
        distinct = len({r.adapter for r in running if r.adapter is not None})
        cost = self.config.cost.time(StepShape(0, len(running), [self.config.adapter_rank] * distinct))
        t = self.now
        times = [t]
        while len(times) <= left and t < limit:
            t += cost
            times.append(t)
        steps, block, pages = len(times) - 1, self.config.block_size, self.pages
        grows: list[int] = []
        for req in running:  # before step k it needs pages for prompt + generated + k + 1 tokens
            first = pages[req.request_id] * block - req.num_prompt_tokens - req.generated
            grows.extend(range(first, steps, block))
        grows.sort()
        if len(grows) > self.free_pages:  # out of pages: the step that would need one is a normal one
            steps = grows[self.free_pages]
            del times[steps + 1 :]
        if steps < 1:
            return False
        self._run = _DecodeRun(times, cost, grows, self.free_pages, self._tokens)
        return True

    def _go_on(self, until: float) -> bool:
        """Carry the decode run on through the steps starting before ``until``; True when it
        stopped there (``run`` returns), False when it ended (the rows are settled)."""
        run = self._run
        assert run is not None
        times, last, n = run.times, len(run.times) - 1, run.done
        start = n
        while n < last and times[n] < until:
            n += 1
        if n > start:
            rows, cost = len(self.running), run.cost
            for _ in range(n - start):
                self.busy_s += cost
            self.steps += n - start
            self.rows += rows * (n - start)
            self.last_batch_size = rows
            self.now = times[n]
            self._tokens = run.tokens - rows * n
            self.free_pages = run.free_pages - bisect_right(run.grows, n - 1)
            run.done = n
        if n < last:
            return True
        self.settle()
        return False

    def _arrive(self, req: SimRequest) -> None:
        self._quiet = False
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
        self._quiet = False
        self.running.remove(req)
        self.free_pages += self.pages.pop(req.request_id)
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.add(req)
        if req.adapter is not None:
            self.residency.requeue(req.adapter, self.now)
        self.policy.preempt(req, self.now)

    def _step(self, ctx: _Context) -> bool:
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
        self._tokens -= len(batch)
        return self._finish(batch)

    def _finish(self, batch: list[SimRequest]) -> bool:
        """End the requests of ``batch`` that generated all their tokens; whether any did."""
        done = [r for r in batch if r.generated >= r.max_tokens]
        for req in done:
            self.running.remove(req)
            self.free_pages += self.pages.pop(req.request_id)
            req.finished_at = self.now
            self._tokens -= req.num_prompt_tokens + req.max_tokens - req.generated
            if req.adapter is not None:
                self._adapters[req.adapter] -= 1
                if not self._adapters[req.adapter]:
                    del self._adapters[req.adapter]
                self.residency.finish(req.adapter, self.now)
            self.policy.on_finish(req, self.now)
        return bool(done)

    def _serve(self, req: SimRequest, input_tokens: int) -> None:
        if req.first_token_at is None:
            req.first_token_at = self.now
        req.generated += 1
        self.served[req.tenant][1] += 1
        self.policy.on_service(req, input_tokens, 1, self.now)
