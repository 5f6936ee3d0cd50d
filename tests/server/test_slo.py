"""The per-tenant SLO arithmetic on an injected clock: which SLIs a request is judged on, goodput,
burn rates, and a window that forgets what is older than it."""

from __future__ import annotations

import pytest

from lorapage.tenancy.slo import WINDOW_BUCKETS, Outcome, SloTargets, SloTracker, SloWindow, judge

TIGHT = SloTargets(ttft_p95_s=0.5, itl_p95_s=0.05, error_rate=0.01)


def test_latency_slis_judge_only_the_requests_that_measured_them():
    assert judge(Outcome(False, ttft_s=0.2, itl_s=0.01), TIGHT) == ({"ttft": False, "itl": False, "error": False}, True)
    assert judge(Outcome(False, ttft_s=0.9, itl_s=0.01), TIGHT) == ({"ttft": True, "itl": False, "error": False}, False)
    # One token: no ITL to judge, still goodput when the first token was in time.
    assert judge(Outcome(False, ttft_s=0.2), TIGHT) == ({"ttft": False, "error": False}, True)
    # Failed before any token: only the error SLI, and never goodput.
    assert judge(Outcome(True), TIGHT) == ({"error": True}, False)
    # No targets: nothing judged; goodput is not failing.
    assert judge(Outcome(False, ttft_s=99.0), SloTargets()) == ({}, True)
    assert judge(Outcome(True, ttft_s=0.1), SloTargets()) == ({}, False)


def test_burn_rate_is_the_bad_fraction_over_the_allowed_one():
    tracker = SloTracker({"a": TIGHT}, window_s=60)
    for i in range(20):  # 2 of 20 first tokens late (10%: twice the 5% a p95 allows), 1 of 20 failed
        tracker.record("a", Outcome(i == 19, ttft_s=None if i == 19 else (0.9 if i < 2 else 0.1), itl_s=0.01), now=i)
    (name, slo), *_ = tracker.report(now=20)
    assert name == "a" and slo.window.requests == 20
    burns = slo.burn_rates()
    assert burns["ttft"] == pytest.approx((2 / 19) / 0.05)  # judged on the 19 that got a token
    assert burns["itl"] == 0.0
    assert burns["error"] == pytest.approx((1 / 20) / 0.01)
    assert slo.goodput_ratio == pytest.approx(17 / 20)
    assert slo.error_ratio == pytest.approx(1 / 20)


def test_the_window_forgets_what_is_older_than_it_and_the_counters_do_not():
    tracker = SloTracker({"a": TIGHT, "idle": TIGHT}, window_s=60)
    for t in range(30):
        tracker.record("a", Outcome(False, ttft_s=5.0), now=t)  # every one late
    tracker.record("a", Outcome(False, ttft_s=0.1), now=100)
    report = dict(tracker.report(now=100))
    a = report["a"]
    assert a.window.requests == 1 and a.burn_rates()["ttft"] == 0.0 and a.goodput_ratio == 1.0
    assert a.lifetime.requests == 31 and a.lifetime.bad["ttft"] == 30 and a.lifetime.good == 1
    idle = report["idle"]  # a configured tenant with no traffic: reported, spending no budget
    assert idle.window.requests == 0 and idle.goodput_ratio is None and set(idle.burn_rates().values()) == {0.0}
    assert next(s for n, s in tracker.report(now=1000) if n == "a").window.requests == 0


def test_the_window_slides_a_bucket_at_a_time_with_bounded_memory():
    window = SloWindow(window_s=10.0)
    for i in range(10_000):  # 100 per second for 100 s
        window.add(i / 100, {"ttft": i % 2 == 0}, good=True, failed=False)
    assert len(window._buckets) <= WINDOW_BUCKETS
    last_10s = window.totals(now=99.99)
    assert 1000 - 10_000 / 100 * window.bucket_s <= last_10s.requests <= 1000  # within a bucket of 10 s
    assert last_10s.bad_fraction("ttft") == pytest.approx(0.5, abs=0.01)


def test_reloaded_targets_apply_to_requests_from_then_on():
    tracker = SloTracker({"a": SloTargets(ttft_p95_s=10.0)}, window_s=60)
    tracker.record("a", Outcome(False, ttft_s=1.0), now=0)
    tracker.set_targets({"a": SloTargets(ttft_p95_s=0.5)})
    tracker.record("a", Outcome(False, ttft_s=1.0), now=1)
    slo = dict(tracker.report(now=2))["a"]
    assert slo.window.bad["ttft"] == 1 and slo.targets.ttft_p95_s == 0.5


@pytest.mark.parametrize(("window_s", "buckets"), [(0.0, 30), (-1.0, 30), (10.0, 0)])
def test_a_window_needs_a_length_and_buckets(window_s, buckets):
    with pytest.raises(ValueError, match="window_s > 0 and buckets >= 1"):
        SloWindow(window_s, buckets)
