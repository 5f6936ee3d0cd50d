"""VTC policy unit tests on a fake clock and a fake engine context."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from lorapage.scheduler import FcfsScheduler, MeteredPolicy, SchedulerMetrics, VtcConfig, VtcScheduler, make_policy


@dataclass(eq=False)
class Req:
    request_id: str
    tenant: str
    adapter: str | None = None
    arrival_time: float = 0.0
    num_prompt_tokens: int = 10
    max_tokens: int = 10


class Ctx:
    """Admits while rows last; adapters in ``loading`` are not ready."""

    def __init__(self, rows: int = 1000, loading: set[str] | None = None) -> None:
        self.rows = rows
        self.loading = loading or set()

    def adapter_ready(self, req: Req) -> bool:
        return req.adapter not in self.loading

    def try_admit(self, req: Req) -> bool:
        if self.rows == 0:
            return False
        self.rows -= 1
        return True


def ids(reqs: list) -> list[str]:
    return [r.request_id for r in reqs]


def admit_one(policy: VtcScheduler, now: float = 0.0) -> list[str]:
    return ids(policy.schedule(now, Ctx(rows=1)))


def test_smallest_counter_first_and_charges_are_weighted():
    vtc = VtcScheduler(VtcConfig(), {"a": 2.0})
    a1, a2 = Req("a1", "a", num_prompt_tokens=10), Req("a2", "a")
    vtc.add(a1, 0.0)
    assert admit_one(vtc) == ["a1"]
    assert vtc.counter("a") == pytest.approx(10 * 1.0 / 2)  # the prompt is charged at admission
    vtc.on_service(a1, 10, 1, 0.1)  # prefill reported: already paid; one output token
    assert vtc.counter("a") == pytest.approx((10 + 2) / 2)
    vtc.on_service(a1, 0, 3, 0.2)
    assert vtc.counter("a") == pytest.approx((10 + 2 * 4) / 2)
    vtc.add(a2, 0.3)
    vtc.add(Req("b1", "b"), 0.3)  # b is lifted to a's counter (9); ties go to the earlier push
    vtc.on_service(a1, 0, 1, 0.4)  # a: 10
    assert admit_one(vtc, 0.5) == ["b1"]


def test_new_tenant_is_lifted_to_the_least_served_backlogged_tenant():
    vtc = VtcScheduler()
    for i in range(3):
        vtc.add(Req(f"a{i}", "a"), 0.0)
    a0 = vtc.schedule(0.0, Ctx(rows=1))[0]
    vtc.on_service(a0, 10, 500, 1.0)
    assert vtc.counter("a") == pytest.approx(10 + 1000)
    vtc.add(Req("b0", "b"), 1.0)
    assert vtc.counter("b") == pytest.approx(vtc.counter("a"))  # no credit for having been idle
    vtc.add(Req("c0", "c"), 1.0)
    assert vtc.counter("c") == pytest.approx(vtc.counter("a"))


def test_returning_tenant_gets_no_banked_credit_when_nobody_waits():
    vtc = VtcScheduler()
    a0 = Req("a0", "a")
    vtc.add(a0, 0.0)
    vtc.schedule(0.0, Ctx())
    vtc.on_service(a0, 10, 100, 1.0)
    vtc.on_finish(a0, 1.0)
    vtc.add(Req("a1", "a"), 2.0)
    vtc.schedule(2.0, Ctx())  # a admitted last at counter 10 + 200 + 10
    vtc.add(Req("b0", "b"), 3.0)  # nobody is backlogged: b starts at the last admission's counter
    assert vtc.counter("b") == pytest.approx(220)
    assert vtc.counter("b") <= vtc.counter("a")


def test_loading_adapter_defers_only_its_request():
    vtc = VtcScheduler()
    vtc.add(Req("a1", "a", "cold", 0.0), 0.0)
    vtc.add(Req("a2", "a", "warm", 0.1), 0.1)
    vtc.add(Req("b1", "b", "cold", 0.2), 0.2)
    vtc.add(Req("c1", "c", None, 0.3), 0.3)
    admitted = ids(vtc.schedule(1.0, Ctx(loading={"cold"})))
    assert sorted(admitted) == ["a2", "c1"]
    assert vtc.num_waiting() == 2
    assert sorted(ids(vtc.schedule(2.0, Ctx()))) == ["a1", "b1"]


def test_capacity_shortage_ends_the_step_and_keeps_order():
    vtc = VtcScheduler()
    for i in range(3):
        vtc.add(Req(f"a{i}", "a", arrival_time=i), float(i))
    assert ids(vtc.schedule(5.0, Ctx(rows=2))) == ["a0", "a1"]
    assert ids(vtc.schedule(6.0, Ctx(rows=5))) == ["a2"]


def test_distinct_adapter_cap_lets_joins_through_and_gives_the_last_lane_to_the_biggest_group():
    vtc = VtcScheduler(VtcConfig(max_loras=2, reserved_tail_lanes=0))
    for i, adapter in enumerate(["x", "y", "z", "x", "z"]):
        vtc.add(Req(f"r{i}", f"t{i}", adapter), 0.0)
    admitted = vtc.schedule(0.1, Ctx())
    # x opens the first of two free lanes in VTC order; the last goes to z (2 waiting), not y (1)
    assert [r.adapter for r in admitted] == ["x", "z", "x", "z"]
    assert vtc.lanes.distinct() == 2
    for r in admitted:
        if r.adapter == "z":
            vtc.on_finish(r, 0.2)
    assert ids(vtc.schedule(0.3, Ctx())) == ["r1"]


def test_reserved_tail_lanes_take_single_request_adapters_and_no_joins():
    vtc = VtcScheduler(VtcConfig(max_loras=3, reserved_tail_lanes=1, age_deadline_s=100))
    for i, adapter in enumerate(["g1", "g1", "g2", "g2", "g3", "g3", "solo"]):
        vtc.add(Req(f"r{i}", "t", adapter, arrival_time=i), float(i))
    admitted = vtc.schedule(10.0, Ctx())
    # g1 and g2 fill the general lanes; g3 is a group and may not take the tail lane; solo may.
    assert [r.adapter for r in admitted] == ["g1", "g1", "g2", "g2", "solo"]
    assert vtc.lanes.tail == {"solo"}
    vtc.add(Req("late", "t", "solo", arrival_time=11), 11.0)
    vtc.add(Req("next", "t", "solo2", arrival_time=11), 11.0)  # another single wants the tail lane
    assert vtc.schedule(11.0, Ctx()) == []  # so the tail holder takes no joins
    vtc.on_finish(admitted[-1], 12.0)
    assert ids(vtc.schedule(12.0, Ctx())) == ["late"]


def test_aged_request_claims_the_next_lane_and_closes_the_oldest_holder():
    vtc = VtcScheduler(VtcConfig(max_loras=2, reserved_tail_lanes=0, age_deadline_s=1.0))
    for i, adapter in enumerate(["hot1", "hot1", "hot2"]):
        vtc.add(Req(f"h{i}", "hot", adapter), 0.0)
    running = vtc.schedule(0.0, Ctx())
    vtc.add(Req("rare", "light", "rare"), 0.0)
    assert vtc.schedule(0.5, Ctx()) == []  # no lane, not aged yet
    vtc.add(Req("h3", "hot", "hot1"), 0.5)
    vtc.add(Req("h4", "hot", "hot2"), 0.5)
    running += vtc.schedule(0.6, Ctx())
    assert ids(running) == ["h0", "h1", "h2", "h3", "h4"]  # joins go on meanwhile
    assert vtc.schedule(1.5, Ctx()) == []  # aged: it claims; hot1, which came in first, closes
    assert vtc.lanes.claim is not None and vtc.lanes.closing == "hot1"
    vtc.add(Req("h5", "hot", "hot1"), 1.5)
    vtc.add(Req("h6", "hot", "hot2"), 1.5)
    assert ids(vtc.schedule(1.6, Ctx())) == ["h6"]  # hot1 takes no joins while closing
    for r in running:
        if r.adapter == "hot1":
            vtc.on_finish(r, 2.0)
    assert ids(vtc.schedule(2.0, Ctx())) == ["rare"]
    assert vtc.lanes.claim is None and vtc.lanes.closing is None
    assert vtc.schedule(2.1, Ctx()) == []  # h5 waits for a lane like anyone else


def test_preempted_request_is_requeued_first_and_recompute_is_free():
    vtc = VtcScheduler()
    r1, r2 = Req("r1", "a", arrival_time=0.0), Req("r2", "a", arrival_time=1.0)
    vtc.add(r1, 0.0)
    vtc.schedule(0.0, Ctx())
    vtc.on_service(r1, 10, 1, 0.1)
    vtc.on_service(r1, 0, 4, 0.2)
    before = vtc.counter("a")
    vtc.add(r2, 1.0)
    vtc.preempt(r1, 1.5)
    assert vtc.lanes.distinct() == 0 and vtc.num_waiting() == 2
    assert ids(vtc.schedule(2.0, Ctx(rows=1))) == ["r1"]  # back in arrival order
    assert vtc.counter("a") == pytest.approx(before)  # no second prompt charge
    vtc.on_service(r1, 15, 1, 2.1)  # recompute of prompt + 5 generated tokens: free
    assert vtc.counter("a") == pytest.approx(before + 2)


def test_pick_victim_takes_the_newest_request_of_the_most_served_tenant():
    vtc = VtcScheduler()
    reqs = [Req("a0", "a", arrival_time=0.0), Req("a1", "a", arrival_time=1.0), Req("b0", "b", arrival_time=2.0)]
    for r in reqs:
        vtc.add(r, r.arrival_time)
    vtc.schedule(3.0, Ctx())
    vtc.on_service(reqs[0], 10, 50, 3.1)
    assert vtc.pick_victim(reqs).request_id == "a1"


def test_unused_prompt_charge_is_refunded_on_abort_and_waiting_requests_can_be_removed():
    vtc = VtcScheduler()
    r1, r2 = Req("r1", "a", num_prompt_tokens=100), Req("r2", "a")
    vtc.add(r1, 0.0)
    vtc.add(r2, 0.0)
    vtc.schedule(0.0, Ctx(rows=1))
    assert vtc.counter("a") == pytest.approx(100)
    vtc.on_finish(r1, 0.1)  # aborted before its prefill ran
    assert vtc.counter("a") == pytest.approx(0)
    vtc.remove(r2)
    assert vtc.num_waiting() == 0 and vtc.schedule(0.2, Ctx()) == []


def test_scan_budget_bounds_one_step():
    vtc = VtcScheduler(VtcConfig(max_scan=5))
    for i in range(20):
        vtc.add(Req(f"r{i}", f"t{i}", "cold"), 0.0)
    vtc.add(Req("ok", "z", None), 0.0)
    assert vtc.schedule(0.0, Ctx(loading={"cold"})) == []
    assert ids(vtc.schedule(0.1, Ctx())) != []


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="reserved_tail_lanes"):
        VtcConfig(max_loras=4, reserved_tail_lanes=4)
    with pytest.raises(ValueError, match="max_loras"):
        VtcConfig(max_loras=0)
    assert VtcConfig(max_loras=32).tail_lanes == 4


def test_make_policy():
    assert isinstance(make_policy("vtc"), VtcScheduler)
    fcfs = make_policy("fcfs")
    assert isinstance(fcfs, FcfsScheduler)
    fcfs.add(Req("x", "a"), 0.0)
    assert ids(fcfs.schedule(0.0, Ctx())) == ["x"]
    with pytest.raises(ValueError, match="fcfs"):
        make_policy("lottery")


@pytest.mark.parametrize("name", ["vtc", "fcfs"])
def test_metered_policy_splits_wait_into_adapter_load_and_capacity(name):
    metrics = SchedulerMetrics()
    policy = make_policy(name, metrics=metrics)
    assert isinstance(policy, MeteredPolicy)
    req = Req("r", "acme", "cold", num_prompt_tokens=7)
    policy.add(req, 0.0)
    assert policy.schedule(0.5, Ctx(loading={"cold"})) == []
    assert policy.schedule(0.75, Ctx(rows=0)) == []  # loaded by now: from here on it waits for a row
    assert ids(policy.schedule(2.0, Ctx())) == ["r"]
    policy.on_service(req, 7, 1, 2.1)
    stats = metrics.tenants["acme"]
    assert stats.admitted_requests == 1 and stats.admitted_prompt_tokens == 7
    assert stats.wait_adapter_s.sum == pytest.approx(0.75)
    assert stats.wait_capacity_s.sum == pytest.approx(1.25)
    assert (stats.served_input_tokens, stats.served_output_tokens) == (7, 1)
    assert metrics.batch_size.count == 1 and metrics.distinct_adapters.sum == 1  # idle steps: none
    metrics.record_rejected("acme", 120, "tpm")
    assert stats.rejected_requests["tpm"] == 1 and stats.rejected_tokens["tpm"] == 120
    policy.on_finish(req, 3.0)
    assert policy.num_waiting() == 0


@pytest.mark.parametrize("name", ["vtc", "fcfs"])
def test_metered_policy_load_ending_while_idle_is_adapter_wait(name):
    """The engine steps only on arrival and when the load ends: the whole wait was the load."""
    metrics = SchedulerMetrics()
    policy = make_policy(name, metrics=metrics)
    policy.add(Req("r", "acme", "cold"), 0.0)
    assert policy.schedule(0.0, Ctx(loading={"cold"})) == []
    assert ids(policy.schedule(3.0, Ctx())) == ["r"]
    stats = metrics.tenants["acme"]
    assert stats.wait_adapter_s.sum == pytest.approx(3.0) and stats.wait_capacity_s.sum == 0


def test_metered_policy_readmission_after_preemption_is_not_a_new_admission():
    metrics = SchedulerMetrics()
    policy = make_policy("fcfs", metrics=metrics)
    req = Req("r", "acme")
    policy.add(req, 0.0)
    assert ids(policy.schedule(0.0, Ctx())) == ["r"]
    policy.preempt(req, 1.0)
    assert ids(policy.schedule(2.0, Ctx())) == ["r"]
    assert metrics.tenants["acme"].admitted_requests == 1 and metrics.batch_size.count == 2


class CountingCtx(Ctx):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.asked = 0

    def adapter_ready(self, req: Req) -> bool:
        self.asked += 1
        return super().adapter_ready(req)


def test_parked_tenants_cost_nothing_until_an_event_lets_them_in():
    vtc = VtcScheduler(VtcConfig(max_loras=2, reserved_tail_lanes=0, age_deadline_s=100.0))
    hot = [Req(f"h{i}", "hot", f"hot{i % 2}") for i in range(4)]
    for r in hot:
        vtc.add(r, 0.0)
    assert len(vtc.schedule(0.0, Ctx())) == 4  # both lanes taken
    for i in range(500):  # 500 tenants, each with a pair of requests for its own adapter
        vtc.add(Req(f"c{i}a", f"cold{i}", f"cold{i}"), 0.0)
        vtc.add(Req(f"c{i}b", f"cold{i}", f"cold{i}"), 0.0)
    first = CountingCtx()
    assert vtc.schedule(1.0, first) == [] and first.asked >= 500  # each looked at once, then parked
    later = CountingCtx()
    assert vtc.schedule(2.0, later) == [] and later.asked == 0
    vtc.on_finish(hot[0], 3.0)
    vtc.on_finish(hot[2], 3.0)  # hot0 leaves: one general lane frees for the biggest group
    after = CountingCtx()
    admitted = vtc.schedule(3.0, after)
    assert len(admitted) == 2 and admitted[0].tenant == admitted[1].tenant
    assert after.asked < 50
    assert vtc.num_waiting() == 998
