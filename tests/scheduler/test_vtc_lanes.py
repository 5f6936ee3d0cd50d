"""Work-conserving lanes: a reserved tail lane nobody waiting can use is lent to the general queue,
and taken back, within one generation of one holder, once somebody can. Pure policy on a fake
clock and a fake engine context, then the simulator's virtual clock; no wall time."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from lorapage.scheduler import MeteredPolicy, SchedulerMetrics, VtcConfig, VtcScheduler, make_policy
from lorapage.sim import SimConfig, SimRequest, Simulator


@dataclass(eq=False)
class Req:
    request_id: str
    tenant: str
    adapter: str | None = None
    arrival_time: float = 0.0
    num_prompt_tokens: int = 10
    max_tokens: int = 10


class Ctx:
    """Admits while rows last; every adapter is ready."""

    def __init__(self, rows: int = 1000) -> None:
        self.rows = rows

    def adapter_ready(self, req: Req) -> bool:
        return True

    def try_admit(self, req: Req) -> bool:
        if self.rows == 0:
            return False
        self.rows -= 1
        return True


def ids(reqs: list[Req]) -> list[str]:
    return [r.request_id for r in reqs]


def eight_groups_of_four() -> tuple[VtcScheduler[Req], list[Req]]:
    """The issue's mix: 8 adapters at max_loras=8 (one reserved tail lane), request i on adapter
    i mod 8, all admitted in the first step."""
    vtc: VtcScheduler[Req] = VtcScheduler(VtcConfig(max_loras=8, age_deadline_s=100.0))
    reqs = [Req(f"r{i}", "t", f"a{i % 8}") for i in range(32)]
    for r in reqs:
        vtc.add(r, 0.0)
    admitted = vtc.schedule(0.0, Ctx())
    for r in admitted:
        vtc.on_service(r, r.num_prompt_tokens, 1, 0.1)
    return vtc, admitted


def test_an_idle_tail_lane_is_lent_when_no_waiting_request_can_use_it():
    vtc, admitted = eight_groups_of_four()
    assert vtc.lanes.reserved_tail == 1
    assert len(admitted) == 32 and vtc.num_waiting() == 0  # not 28: the eighth group borrows the tail lane
    assert vtc.lanes.distinct() == 8 and vtc.lanes.borrowed() == 1 and vtc.lanes.tail == set()


def test_a_single_request_adapter_gets_a_lent_lane_back_within_one_generation_of_one_holder():
    vtc, running = eight_groups_of_four()
    vtc.add(Req("solo", "light", "solo"), 1.0)
    assert vtc.schedule(1.0, Ctx()) == []  # every lane is taken: the lent one is owed back
    assert vtc.lanes.closing == "a0"  # the general holder that opened first takes no joins
    vtc.add(Req("join0", "t", "a0"), 1.0)
    vtc.add(Req("join1", "t", "a1"), 1.0)
    assert ids(vtc.schedule(1.1, Ctx())) == ["join1"]  # the other holders still take joins
    a0_rows = [r for r in running if r.adapter == "a0"]
    for r in a0_rows[:-1]:
        vtc.on_finish(r, 2.0)
        assert vtc.schedule(2.0, Ctx()) == []
    vtc.on_finish(a0_rows[-1], 2.5)  # 4 finishes: the closing holder's rows, no preemption
    assert ids(vtc.schedule(2.5, Ctx())) == ["solo"]
    assert vtc.lanes.tail == {"solo"} and vtc.lanes.borrowed() == 0
    assert vtc.lanes.closing is None


def test_a_tail_holder_takes_joins_while_nobody_wants_the_tail_lane():
    vtc: VtcScheduler[Req] = VtcScheduler(VtcConfig(max_loras=3, reserved_tail_lanes=1, age_deadline_s=100))
    for i, adapter in enumerate(["g1", "g1", "g2", "g2", "solo"]):
        vtc.add(Req(f"r{i}", "t", adapter), 0.0)
    assert len(vtc.schedule(0.0, Ctx())) == 5
    assert vtc.lanes.tail == {"solo"}
    vtc.add(Req("late", "t", "solo"), 1.0)
    assert ids(vtc.schedule(1.0, Ctx())) == ["late"]  # nobody else could use the tail lane: lent to solo
    assert vtc.lanes.tail == set() and vtc.lanes.borrowed() == 1
    vtc.add(Req("other", "u", "other"), 2.0)
    vtc.add(Req("late2", "t", "solo"), 2.0)
    vtc.add(Req("g2-more", "t", "g2"), 2.0)
    # A single for another adapter wants the lane back: g1 (opened first) closes, the rest join.
    assert sorted(ids(vtc.schedule(2.0, Ctx()))) == ["g2-more", "late2"]
    assert vtc.lanes.closing == "g1"


def test_a_closing_holder_nobody_is_owed_a_lane_takes_joins_again():
    vtc, _ = eight_groups_of_four()
    solo = Req("solo", "light", "solo")
    vtc.add(solo, 1.0)
    vtc.add(Req("join0", "t", "a0"), 1.0)
    assert vtc.schedule(1.0, Ctx()) == [] and vtc.lanes.closing == "a0"
    vtc.remove(solo)  # the client went away: nobody is owed the lane any more
    assert ids(vtc.schedule(1.1, Ctx())) == ["join0"]
    assert vtc.lanes.closing is None


def test_a_waiting_single_keeps_the_tail_lane_from_being_lent():
    """Reserved means reserved while somebody can use it: a group may not take the tail lane
    while a single-request adapter waits, whatever their order in the queue."""
    vtc: VtcScheduler[Req] = VtcScheduler(VtcConfig(max_loras=3, reserved_tail_lanes=1, age_deadline_s=100))
    for i, adapter in enumerate(["g1", "g1", "g2", "g2", "g3", "g3", "solo"]):
        vtc.add(Req(f"r{i}", "t", adapter), 0.0)
    assert [r.adapter for r in vtc.schedule(0.0, Ctx())] == ["g1", "g1", "g2", "g2", "solo"]
    assert vtc.lanes.borrowed() == 0


class LoadingCtx(Ctx):
    """Every adapter but ``loading`` is ready."""

    def __init__(self, loading: set[str]) -> None:
        super().__init__()
        self.loading = loading

    def adapter_ready(self, req: Req) -> bool:
        return req.adapter not in self.loading


def test_a_single_whose_adapter_is_loading_keeps_the_tail_lane_reserved():
    """Lent while the single's adapter loads, the lane would be held for a whole generation:
    the group waits for a general lane, and the single takes the tail lane once it has loaded."""
    vtc: VtcScheduler[Req] = VtcScheduler(VtcConfig(max_loras=3, reserved_tail_lanes=1, age_deadline_s=100))
    for i, adapter in enumerate(["solo", "g1", "g1", "g2", "g2", "g3", "g3"]):
        vtc.add(Req(f"r{i}", "t", adapter), 0.0)
    ctx = LoadingCtx({"solo"})
    assert [r.adapter for r in vtc.schedule(0.0, ctx)] == ["g1", "g1", "g2", "g2"]
    assert vtc.lanes.borrowed() == 0 and "r0" in vtc.lanes.wanting
    assert vtc.schedule(0.1, ctx) == []  # still loading: nothing lent, nothing recalled
    assert vtc.lanes.borrowed() == 0 and vtc.lanes.closing is None
    ctx.loading.clear()
    assert ids(vtc.schedule(0.2, ctx)) == ["r0"]
    assert vtc.lanes.tail == {"solo"}


def test_a_ready_single_behind_a_loading_one_still_gets_a_lent_lane_back():
    vtc: VtcScheduler[Req] = VtcScheduler(VtcConfig(max_loras=3, reserved_tail_lanes=1, age_deadline_s=100))
    for i, adapter in enumerate(["g1", "g1", "g2", "g2", "g3", "g3"]):
        vtc.add(Req(f"r{i}", "t", adapter), 0.0)
    ctx = LoadingCtx({"slow"})
    assert len(vtc.schedule(0.0, ctx)) == 6 and vtc.lanes.borrowed() == 1  # nobody wanted the tail lane
    vtc.add(Req("loading", "u", "slow"), 1.0)
    vtc.add(Req("ready", "v", "solo"), 1.0)
    assert vtc.schedule(1.0, ctx) == []  # every lane is held
    assert vtc.lanes.closing == "g1"  # recalled for the ready single, though the loading one is first


def test_the_wanting_index_holds_only_waiting_requests():
    vtc, running = eight_groups_of_four()
    for i in range(50):
        vtc.add(Req(f"s{i}", f"u{i}", f"single{i}"), 1.0)
    vtc.schedule(1.0, Ctx())
    assert vtc.index_sizes()["wanting_entries"] <= vtc.num_waiting()
    for r in running:
        vtc.on_finish(r, 2.0)
    while vtc.num_waiting():
        for r in vtc.schedule(3.0, Ctx()):
            vtc.on_finish(r, 3.0)
    assert vtc.index_sizes()["wanting_entries"] == 0


# --- the simulator: whole runs on the virtual clock ---------------------------------------------


def batch_counts(policy: str, adapters: list[str], max_loras: int, tenants: int = 1) -> tuple[int, float]:
    """Steps and mean rows per step of one batch of requests (request i on ``adapters[i]``, from
    tenant i mod ``tenants``, 32 tokens), all arriving at t=0, through ``policy`` in the simulator."""
    trace = [SimRequest(f"r{i}", f"t{i % tenants}", a, 0.0, 16, 32) for i, a in enumerate(adapters)]
    config = SimConfig(max_num_seqs=256, adapter_load_s=0.0)  # every adapter resident, as in the bench
    sim = Simulator(make_policy(policy, vtc=VtcConfig(max_loras=max_loras)), config, trace)
    rows: list[int] = []
    sim.run(on_step=lambda s: rows.append(s.last_batch_size))
    assert all(r.finished_at is not None for r in trace)
    return sim.steps, sum(rows) / len(rows)


@pytest.mark.parametrize(
    ("adapters", "max_loras"),
    [
        ([f"a{i % 8}" for i in range(32)], 8),
        ([f"a{i % 32}" for i in range(128)], 32),
        ([f"a{i % 16}" for i in range(64)], 16),
    ],
    ids=["8x4@8", "32x4@32", "16x4@16"],
)
def test_mixed_adapters_that_fit_the_lanes_run_in_one_generation(adapters, max_loras):
    """As many distinct adapters as lanes: VTC runs the batch in as many steps as FCFS, one
    generation, every row in every step (before lanes were lent: twice the steps, half the rows)."""
    vtc_steps, vtc_rows = batch_counts("vtc", adapters, max_loras)
    fcfs_steps, fcfs_rows = batch_counts("fcfs", adapters, max_loras)
    assert vtc_steps == fcfs_steps == 32
    assert vtc_rows == fcfs_rows == len(adapters)


@pytest.mark.parametrize("tenants", [1, 4])
def test_a_zipf_mix_that_fits_the_lanes_runs_in_one_generation(tenants):
    """Singles and groups of every size from several tenants: a single takes a general lane in
    VTC order while two or more are free, so the groups may need the tail lanes, which nobody
    else wants once the last single is in (a group's first request stops counting as a single the
    moment its second arrives)."""
    counts = (19, 10, 6, 5, 4, 3, 3, 2, 2, 2, 2, 2, 1, 1, 1, 1)  # Zipf(1.0), bench/bench_lanes.py's zipf@16
    adapters = [f"z{k}" for k, n in enumerate(counts) for _ in range(n)]
    random.Random(0).shuffle(adapters)
    vtc = batch_counts("vtc", adapters, max_loras=16, tenants=tenants)
    assert vtc == batch_counts("fcfs", adapters, max_loras=16, tenants=tenants) == (32, 64)


def hot_stream_with_singles(seed: int) -> tuple[list[SimRequest], list[SimRequest]]:
    """Three tenants keep 5 hot adapters above capacity; a single-request adapter arrives every
    half second from t=2."""
    rng = random.Random(seed)
    trace, t, i = [], 0.0, 0
    while t < 12.0:
        t += rng.expovariate(100.0)
        adapter = f"hot{rng.randrange(5)}"
        trace.append(SimRequest(f"h{i}", f"t{i % 3}", adapter, t, rng.randint(16, 128), rng.randint(20, 60)))
        i += 1
    singles = [SimRequest(f"s{k}", "tail", f"single{k}", 2.0 + 0.5 * k, 64, 32) for k in range(16)]
    return trace + singles, singles


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_under_sustained_load_singles_get_a_lane_within_one_generation_and_rows_stay_full(seed):
    """5 hot adapters on 4 lanes (one reserved): the tail lane serves a hot adapter between
    singles, so the batch stays full, and every single still gets in within its adapter's load
    plus one generation of the closing holder (at most 60 tokens of steps under 20 ms), well
    before its age deadline. (With the tail lane kept idle for singles, rows went unused: a mean
    of 30.5 of 32 for seed 4, down to 17 in a step.)"""
    trace, singles = hot_stream_with_singles(seed)
    sim = Simulator(
        make_policy("vtc", vtc=VtcConfig(max_loras=4, reserved_tail_lanes=1, age_deadline_s=5.0)),
        SimConfig(max_num_seqs=32),
        trace,
    )
    rows: list[int] = []
    sim.run(until=12.0, on_step=lambda s: rows.append(s.last_batch_size) if s.now > 1 else None)
    load_s = SimConfig().adapter_load_s
    assert all(r.admitted_at is not None for r in singles)  # no starvation
    assert max(r.queue_wait for r in singles) <= load_s + 60 * 0.02
    assert sum(rows) / len(rows) >= 31.5 and sum(r == 32 for r in rows) / len(rows) >= 0.95


def test_tail_lane_utilization_averages_held_and_lent_over_recent_steps():
    """The gauge behind lorapage_tail_lane_utilization: per step that ran, the reserved tail lanes
    held by a tail adapter and lent to general holders, averaged; none under FCFS."""
    metrics = SchedulerMetrics()
    policy = MeteredPolicy(VtcScheduler(VtcConfig(max_loras=3, reserved_tail_lanes=1, age_deadline_s=100)), metrics)
    for i, adapter in enumerate(["g1", "g1", "g2", "g2", "solo"]):
        policy.add(Req(f"r{i}", "t", adapter), 0.0)
    assert len(policy.schedule(0.0, Ctx())) == 5
    assert metrics.tail_lane_utilization() == (1.0, 0.0)  # solo holds the one tail lane
    policy.add(Req("late", "t", "solo"), 1.0)
    assert ids(policy.schedule(1.0, Ctx())) == ["late"]  # nobody else wants it: lent to solo
    assert metrics.tail_lane_utilization() == (0.5, 0.5)
    fcfs = SchedulerMetrics()
    plain = MeteredPolicy(make_policy("fcfs", vtc=VtcConfig(max_loras=3)), fcfs)
    plain.add(Req("x", "t", "solo"), 0.0)
    assert ids(plain.schedule(0.0, Ctx())) == ["x"] and fcfs.tail_lane_utilization() == (0.0, 0.0)


def test_fcfs_holds_at_most_max_loras_distinct_adapters_and_keeps_order():
    """vLLM's rule under FCFS: a request that would be a distinct adapter past max_loras is passed
    over (it keeps its place); one whose adapter is in the batch still joins; a finish frees a lane."""
    fcfs = make_policy("fcfs", vtc=VtcConfig(max_loras=2))
    reqs = [Req(f"r{i}", "t", a, float(i)) for i, a in enumerate(["a", "b", "c", "a", None])]
    for r in reqs:
        fcfs.add(r, r.arrival_time)
    assert ids(fcfs.schedule(0.0, Ctx())) == ["r0", "r1", "r3", "r4"]  # c would be a third adapter
    fcfs.on_finish(reqs[1], 1.0)
    assert ids(fcfs.schedule(1.0, Ctx())) == ["r2"]  # b's lane freed


def _long_holders(bound: int | None, lent_tokens: int = 500) -> tuple[VtcScheduler[Req], list[Req]]:
    """8 lanes (1 reserved), 8 adapters admitted while nobody wants the tail: the eighth (a7)
    borrows it. Every holder's requests generate 500 tokens but a7's, which generate ``lent_tokens``."""
    vtc: VtcScheduler[Req] = VtcScheduler(VtcConfig(max_loras=8, age_deadline_s=100.0, lend_max_tokens=bound))
    reqs = [Req(f"r{i}", "t", f"a{i % 8}", max_tokens=lent_tokens if i % 8 == 7 else 500) for i in range(32)]
    for r in reqs:
        vtc.add(r, 0.0)
    running = vtc.schedule(0.0, Ctx())
    assert len(running) == 32 and vtc.lanes.borrowed() == 1
    return vtc, running


def _steps_until_admitted(vtc: VtcScheduler[Req], running: list[Req], solo: Req) -> tuple[int, list[Req]]:
    """Steps that ran while ``solo`` waited for a lane, as the engine runs them: each step the
    policy's reclaimed rows are preempted first, then admissions; each running request generates a
    token a step and finishes after its max_tokens. Also the rows preempted."""
    done = {r.request_id: 0 for r in running}
    preempted: list[Req] = []
    for step in range(1, 1000):
        now = 1.0 + step * 0.05
        for r in vtc.reclaim(now):
            running.remove(r)
            vtc.preempt(r, now)
            preempted.append(r)
        admitted = vtc.schedule(now, Ctx())
        running += [r for r in admitted if r is not solo]
        if solo in admitted:
            return step - 1, preempted
        for r in list(running):
            vtc.on_service(r, 0, 1, now)
            done[r.request_id] = done.get(r.request_id, 0) + 1
            if done[r.request_id] == r.max_tokens:
                running.remove(r)
                vtc.on_finish(r, now)
    raise AssertionError("never admitted")


def test_a_lent_lane_takes_long_requests_while_nobody_wants_it():
    """The bound costs nothing in steady state: with nobody wanting a tail lane, a long request
    joins the lent lane's holder like any other (the bound once refused it, losing rows)."""
    vtc, running = _long_holders(16)
    late = [Req(f"late{i}", "t", "a7", arrival_time=0.5, max_tokens=400) for i in range(2)]
    for r in late:
        vtc.add(r, 0.5)
    assert ids(vtc.schedule(0.5, Ctx())) == ["late0", "late1"]
    assert vtc.reclaim(0.6) == []


@pytest.mark.parametrize("bound", [None, 16, 32])
def test_the_lend_bound_keeps_a_tail_request_from_waiting_a_long_generation(bound):
    """Every holder generates 500 tokens. Without the bound the recalled holder closes and the
    single waits for its whole generation; with it the holder's rows are preempted ``bound``
    steps after the single wanted the lane, and the single is in by then. The preempted rows
    wait again (none lost: they are readmitted later with the tokens they had)."""
    vtc, running = _long_holders(bound)
    solo = Req("solo", "light", "solo", arrival_time=1.0, max_tokens=300)
    vtc.add(solo, 1.0)
    steps, preempted = _steps_until_admitted(vtc, running, solo)
    if bound is None:
        assert steps >= 400 and preempted == []  # a whole long generation
    else:
        assert steps <= bound
        assert len(preempted) == 4 and len({r.adapter for r in preempted}) == 1  # one holder's rows
        assert vtc.num_waiting() == 4


def test_the_holder_that_finishes_first_is_recalled_and_nothing_is_preempted():
    """The recall closes the holder with the fewest tokens left (here the lent lane's, 10 tokens),
    so the single is in within its generation, under the bound, with no preemption."""
    vtc, running = _long_holders(16, lent_tokens=10)
    solo = Req("solo", "light", "solo", arrival_time=1.0, max_tokens=300)
    vtc.add(solo, 1.0)
    steps, preempted = _steps_until_admitted(vtc, running, solo)
    assert steps <= 10 and preempted == []


@pytest.mark.parametrize("bound", [None, 16])
def test_a_tail_lane_held_by_a_long_single_is_reclaimed_for_the_next_single(bound):
    """No lane lent: the tail lane is held by a single of 500 tokens (a tail holder takes no joins,
    but its one row can keep the lane a whole generation). With the bound it is reclaimed: the
    next single is in within the bound, the first waits again (it had its first token)."""
    vtc: VtcScheduler[Req] = VtcScheduler(VtcConfig(max_loras=2, reserved_tail_lanes=1, age_deadline_s=100.0,
                                                    lend_max_tokens=bound))  # fmt: skip
    for i in range(2):
        vtc.add(Req(f"g{i}", "t", "group", max_tokens=500), 0.0)
    vtc.add(Req("first", "u", "one", max_tokens=500), 0.0)
    running = vtc.schedule(0.0, Ctx())
    assert sorted(ids(running)) == ["first", "g0", "g1"] and vtc.lanes.tail == {"one"}
    solo = Req("solo", "v", "two", arrival_time=1.0, max_tokens=10)
    vtc.add(solo, 1.0)
    steps, preempted = _steps_until_admitted(vtc, running, solo)
    if bound is None:
        assert steps >= 400 and preempted == []
    else:
        assert steps <= bound and ids(preempted) == ["first"] and vtc.num_waiting() == 1
