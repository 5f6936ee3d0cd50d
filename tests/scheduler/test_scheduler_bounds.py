"""The scheduler's lazy structures stay bounded by what they index, however long it runs, and
compacting them changes no admission. Sizes are asserted, never times."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from lorapage.scheduler import MeteredPolicy, SchedulerMetrics, VtcConfig, VtcScheduler, tenant_queue, vtc
from lorapage.scheduler.tenant_queue import Tenant, TenantQueue, TenantState

SLACK = 64  # the compaction slack both heaps allow beyond twice their live entries


@dataclass(eq=False)
class Req:
    request_id: str
    tenant: str
    adapter: str | None
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int
    generated: int = 0


class Engine:
    """Rows are the only capacity; an adapter is ready 60 ms after its first request."""

    def __init__(self, rows: int) -> None:
        self.free_rows = rows
        self.now = 0.0
        self.ready_at: dict[str, float] = {}

    def adapter_ready(self, req: Req) -> bool:
        return req.adapter is None or self.ready_at[req.adapter] <= self.now

    def try_admit(self, req: Req) -> bool:
        if self.free_rows == 0:
            return False
        self.free_rows -= 1
        return True


def churn(policy: VtcScheduler[Req] | MeteredPolicy[Req], steps: int, seed: int, check=None) -> list[list[str]]:
    """Many tenants on many adapters behind a 4-lane batch: requests park, age, claim, join,
    finish, get preempted and aborted. The queue is kept at 150 waiting. Returns the admissions."""
    rng = random.Random(seed)
    engine = Engine(rows=24)
    running: list[Req] = []
    waiting: dict[str, Req] = {}
    admissions: list[list[str]] = []
    ids = 0
    for step in range(steps):
        now = engine.now = step * 0.02
        while policy.num_waiting() < 150:
            adapter = rng.choice([None, *(f"a{min(int(rng.paretovariate(1.0)), 60)}" for _ in range(4))])
            req = Req(f"r{ids}", f"t{rng.randrange(80)}", adapter, now, rng.randint(8, 64), rng.randint(2, 40))
            ids += 1
            if adapter is not None:
                engine.ready_at.setdefault(adapter, now + 0.06)
            waiting[req.request_id] = req
            policy.add(req, now)
        admitted = policy.schedule(now, engine)
        admissions.append([r.request_id for r in admitted])
        for req in admitted:
            del waiting[req.request_id]
            policy.on_service(req, req.num_prompt_tokens + req.generated, 1, now)
        for req in running:
            policy.on_service(req, 0, 1, now)
        running += admitted
        for req in running:
            req.generated += 1
        for req in [r for r in running if r.generated >= r.max_tokens]:
            running.remove(req)
            engine.free_rows += 1
            policy.on_finish(req, now)
        if running and step % 7 == 0:  # out of KV pages: one goes back to the queue
            victim = policy.pick_victim(running)
            running.remove(victim)
            engine.free_rows += 1
            waiting[victim.request_id] = victim
            policy.preempt(victim, now)
        if step % 5 == 0:  # a waiting client gives up
            policy.remove(waiting.pop(rng.choice(sorted(waiting))))
        if check is not None:
            check()
    return admissions


def test_vtc_heaps_stay_within_twice_their_live_entries():
    policy: VtcScheduler[Req] = VtcScheduler(VtcConfig(max_loras=4, reserved_tail_lanes=1, age_deadline_s=0.1))
    peak_groups = 0
    pushed_past_bound = False

    def check() -> None:
        nonlocal peak_groups, pushed_past_bound
        sizes = policy.index_sizes()
        assert sizes["tenant_heap_entries"] <= 2 * sizes["tenants_waiting"] + SLACK
        assert sizes["line_entries"] <= 2 * sizes["waiting_or_running"] + SLACK
        peak_groups = max(peak_groups, sizes["groups"])
        assert sizes["group_heap_entries"] <= 4 * peak_groups + SLACK
        pushed_past_bound |= sizes["line_entries"] > sizes["waiting_or_running"]

    admitted = sum(map(len, churn(policy, steps=3000, seed=1, check=check)))
    assert admitted > 10 * (150 + 24)  # traffic far beyond what is ever in flight
    assert pushed_past_bound  # stale entries did accumulate: the bound was exercised


def test_compaction_changes_no_admission(monkeypatch):
    with_compaction = churn(VtcScheduler(VtcConfig(max_loras=4, reserved_tail_lanes=1, age_deadline_s=0.1)), 1500, 2)
    monkeypatch.setattr(tenant_queue, "_COMPACT_SLACK", 10**9)
    monkeypatch.setattr(vtc, "_COMPACT_SLACK", 10**9)
    never_compacted: VtcScheduler[Req] = VtcScheduler(VtcConfig(max_loras=4, reserved_tail_lanes=1, age_deadline_s=0.1))
    grew = False

    def check() -> None:
        nonlocal grew
        sizes = never_compacted.index_sizes()
        grew |= sizes["tenant_heap_entries"] > 2 * sizes["tenants_waiting"] + SLACK

    without = churn(never_compacted, 1500, 2, check=check)
    assert grew  # the heap did pass the bound: compaction would have run
    assert with_compaction == without


def test_tenant_queue_compaction_keeps_the_lowest_tenant():
    rng = random.Random(3)
    queue: TenantQueue[Req] = TenantQueue()
    tenants = [queue.tenants.setdefault(f"t{i}", Tenant(f"t{i}", 1.0, 1.0)) for i in range(50)]
    states = [s for s in TenantState if s is not TenantState.IDLE]
    for _ in range(20_000):
        t = rng.choice(tenants)
        t.counter += rng.random()  # counters only grow while an entry waits in a heap
        queue.set_state(t, rng.choice([*states, TenantState.IDLE]))
        state = rng.choice(states)
        lowest = queue.peek(state)
        live = [u.counter for u in tenants if u.state is state]
        assert (lowest.counter if lowest else None) == (min(live) if live else None)
        waiting = sum(u.state is not TenantState.IDLE for u in tenants)
        assert queue.heap_entries() <= 2 * waiting + SLACK


def test_metered_policy_books_hold_only_requests_in_flight():
    inner: VtcScheduler[Req] = VtcScheduler(VtcConfig(max_loras=4, reserved_tail_lanes=1, age_deadline_s=0.1))
    policy = MeteredPolicy(inner, SchedulerMetrics())

    def check() -> None:
        waiting = policy.num_waiting()
        assert len(policy._enqueued_at) <= waiting
        assert len(policy._loaded_at) <= waiting and len(policy._returning) <= waiting
        assert len(policy._running) == inner.num_running()

    churn(policy, steps=1000, seed=4, check=check)
    assert sum(s.admitted_requests for s in policy.metrics.tenants.values()) > 500


def test_add_and_preempt_say_which_one_was_meant():
    policy: VtcScheduler[Req] = VtcScheduler()
    req = Req("r", "t", None, 0.0, 10, 10)
    with pytest.raises(ValueError, match="not running"):
        policy.preempt(req, 0.0)
    policy.add(req, 0.0)
    assert policy.schedule(0.0, Engine(rows=1)) == [req]
    with pytest.raises(ValueError, match="preempt"):
        policy.add(req, 1.0)
    policy.preempt(req, 1.0)
    assert policy.num_waiting() == 1 and policy.num_running() == 0
