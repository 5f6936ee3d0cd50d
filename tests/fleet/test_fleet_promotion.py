"""Automatic promotion to a dedicated merged deployment and demotion back, with hysteresis
(``lorapage.fleet.promotion``: pure, driven here by a clock the test moves)."""

from __future__ import annotations

import pytest

from lorapage.fleet.promotion import REPLICA_TOKENS_PER_S, DedicatedConfig, PromotionPolicy, PromotionRules

TICK_S = 1.0  # one answer a second per adapter, its tokens chosen to make the rate wanted


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _policy(**kw: float) -> tuple[PromotionPolicy, Clock]:
    clock = Clock()
    rules = PromotionRules(**{"promote_after_s": 60.0, "demote_after_s": 600.0, "half_life_s": 10.0, **kw})
    return PromotionPolicy(rules, clock), clock


def _traffic(policy: PromotionPolicy, clock: Clock, seconds: float, **rates: float) -> None:
    """Each adapter named gets its rate's tokens every second for ``seconds``."""
    end = clock.now + seconds
    while clock.now < end:
        clock.now += TICK_S
        for adapter_id, rate in rates.items():
            policy.observe(adapter_id, round(rate * TICK_S))


def _actions(policy: PromotionPolicy, merged: set[str], starting: set[str] = frozenset()) -> list[tuple[str, str]]:
    return [(d.action, d.adapter_id) for d in policy.decide(merged, starting)]


def test_the_default_threshold_is_one_replicas_decode_throughput() -> None:
    rules = PromotionRules()
    assert rules.promote_tokens_per_s == REPLICA_TOKENS_PER_S == 32 / 0.05  # seed 001
    assert rules.demote_tokens_per_s < rules.promote_tokens_per_s
    with pytest.raises(ValueError, match="hysteresis"):
        PromotionRules(promote_tokens_per_s=100, demote_tokens_per_s=100)
    with pytest.raises(ValueError):
        DedicatedConfig(replicas=0)


def test_the_rate_follows_the_tokens() -> None:
    policy, clock = _policy()
    _traffic(policy, clock, 120, hot=800)
    assert policy.rates.rate("hot", policy.clock()) == pytest.approx(800, rel=0.05)
    assert policy.rates.rate("never", policy.clock()) == 0.0


def test_promotes_only_after_the_rate_holds_above_the_threshold() -> None:
    policy, clock = _policy()
    _traffic(policy, clock, 40, hot=1000, tail=50)
    assert _actions(policy, set()) == []  # over the threshold, not yet for promote_after_s
    _traffic(policy, clock, 30, hot=1000, tail=50)
    assert _actions(policy, set()) == []  # its rate crossed the threshold ~15 s in (half-life 10 s)
    _traffic(policy, clock, 61, hot=1000, tail=50)
    assert _actions(policy, set()) == [("promote", "hot")]
    # once it is starting or merged it is never promoted again, and the tail never is
    assert _actions(policy, set(), {"hot"}) == []
    assert _actions(policy, {"hot"}) == []


def test_a_burst_does_not_promote() -> None:
    policy, clock = _policy()
    _traffic(policy, clock, 20, burst=5000)
    assert _actions(policy, set()) == []
    _traffic(policy, clock, 120)  # silence: the rate decays under the threshold, the wait resets
    assert _actions(policy, set()) == []
    assert policy.rates.rate("burst", policy.clock()) < policy.rules.demote_tokens_per_s


def test_stays_merged_while_traffic_wobbles_between_the_thresholds() -> None:
    policy, clock = _policy()
    for _ in range(30):  # 20 minutes of 600 / 400 tokens a second: under promote, over demote
        _traffic(policy, clock, 20, hot=600)
        assert _actions(policy, {"hot"}) == []
        _traffic(policy, clock, 20, hot=400)
        assert _actions(policy, {"hot"}) == []


def test_demotes_after_the_hold_and_a_dip_restarts_it() -> None:
    policy, clock = _policy()
    _traffic(policy, clock, 60, hot=1000)
    _traffic(policy, clock, 60, hot=50)  # well under demote_tokens_per_s now
    assert _actions(policy, {"hot"}) == []
    _traffic(policy, clock, 400, hot=50)
    assert _actions(policy, {"hot"}) == []  # below for ~400 s of the 600 s hold
    _traffic(policy, clock, 60, hot=1000)  # back up: the hold starts again
    assert _actions(policy, {"hot"}) == []
    _traffic(policy, clock, 60, hot=50)
    assert _actions(policy, {"hot"}) == []
    _traffic(policy, clock, 599, hot=50)
    assert _actions(policy, {"hot"}) == []  # 599 s since the first judgement below
    _traffic(policy, clock, 2, hot=50)
    assert _actions(policy, {"hot"}) == [("demote", "hot")]


def test_no_flapping_around_one_threshold() -> None:
    """Traffic that crosses the promotion threshold every half minute promotes once and then
    never demotes: the demotion threshold is far below."""
    policy, clock = _policy(promote_after_s=0.0)
    merged: set[str] = set()
    changes = []
    for _ in range(60):
        for rate in (700, 580):
            _traffic(policy, clock, 30, hot=rate)
            for action, adapter_id in _actions(policy, merged):
                changes.append(action)
                merged = merged | {adapter_id} if action == "promote" else merged - {adapter_id}
    assert changes == ["promote"]


def test_the_busiest_first_within_max_deployments() -> None:
    policy, clock = _policy(max_deployments=2)
    _traffic(policy, clock, 70, a=700, b=2000, c=1500)
    _traffic(policy, clock, 61, a=700, b=2000, c=1500)
    assert _actions(policy, set()) == [("promote", "b"), ("promote", "c")]
    assert _actions(policy, {"b"}, {"c"}) == []  # two dedicated: no room for a
    # a demotion frees its room in the same judgement
    _traffic(policy, clock, 60, a=700, c=1500)
    assert _actions(policy, {"b", "c"}) == []  # b is idle: its hold starts at this judgement
    _traffic(policy, clock, 601, a=700, c=1500)
    assert _actions(policy, {"b", "c"}) == [("demote", "b"), ("promote", "a")]


def test_a_failed_promotion_waits_before_the_next_try() -> None:
    policy, clock = _policy(retry_after_s=1800.0)
    _traffic(policy, clock, 70, hot=1000)
    _traffic(policy, clock, 61, hot=1000)
    assert _actions(policy, set()) == [("promote", "hot")]
    policy.failed("hot")
    _traffic(policy, clock, 600, hot=1000)
    assert _actions(policy, set()) == []
    _traffic(policy, clock, 1300, hot=1000)
    assert _actions(policy, set()) == [("promote", "hot")]
