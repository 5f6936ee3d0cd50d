"""The traffic tier rules (pure, time given): hot by requests or by share, warm by the last day,
cold otherwise; the sliding-window estimate over hourly rows; hysteresis on the way down."""

from __future__ import annotations

import pytest

from lorapage import EngineConfig
from lorapage.adapters.tiers import (
    HOUR_S,
    Tier,
    TierRules,
    TierState,
    assess as assess_recent,
    ranked,
    recent_requests,
    window_requests,
    window_weights,
)

RULES = TierRules(hot_requests_per_hour=100, hot_share=0.2, hot_exit_ratio=0.5, min_hold_s=600)
H = 500_000  # an hour since the epoch
T = H * HOUR_S + 1800.0  # half past it


def assess(rules: TierRules, traffic: dict, previous: dict, now: float) -> dict[str, TierState]:
    """The rules on counts per version and hour (as the registry's weighted sums give them)."""
    return assess_recent(rules, recent_requests(traffic, now), previous, now)


def tiers(states: dict[str, TierState]) -> dict[str, Tier]:
    return {k: s.tier for k, s in states.items()}


def test_the_window_counts_whole_hours_and_the_part_of_the_oldest_still_inside_it():
    hours = {H: 30, H - 1: 100, H - 2: 1000}
    # Half past H: the last hour is H's first half (all 30 so far) and H-1's second half (50).
    assert window_requests(hours, T, HOUR_S) == pytest.approx(30 + 50)
    # The last day reaches back to half past H-24: every row here counts whole.
    assert window_requests(hours, T, 24 * HOUR_S) == pytest.approx(1130)
    assert window_requests({H - 24: 10}, T, 24 * HOUR_S) == pytest.approx(5)  # half of it inside
    assert window_requests({H - 30: 10}, T, 24 * HOUR_S) == 0
    # At the very start of an hour, its (empty so far) row counts whole and the previous hour too.
    assert window_requests({H: 0, H - 1: 40}, H * HOUR_S, HOUR_S) == pytest.approx(40)


def test_hot_by_requests_or_by_share_warm_by_the_last_day_cold_otherwise():
    traffic = {
        "busy@1": {H: 120},  # 120 in the last hour: over 100
        "big@1": {H: 60},  # 60 of 260 (23 %) while the total passes 100: hot by share
        "steady@1": {H: 40, H - 1: 80},  # 40 + 40 = 80 of 260 is 31 %: hot by share too
        "trickle@1": {H - 1: 4},  # 2 in the last hour: warm
        "yesterday@1": {H - 20: 1},  # one request 20 hours ago: warm
        "old@1": {H - 30: 50},  # nothing in the last 24 hours: cold (left out)
    }
    got = tiers(assess(RULES, traffic, {}, T))
    assert got == {
        "busy@1": Tier.HOT,
        "big@1": Tier.HOT,
        "steady@1": Tier.HOT,
        "trickle@1": Tier.WARM,
        "yesterday@1": Tier.WARM,
    }
    assert all(t is not Tier.MERGED for t in got.values())  # reserved, never inferred


def test_a_large_share_of_little_traffic_is_not_hot():
    got = assess(RULES, {"only@1": {H: 5}}, {}, T)
    assert got["only@1"].tier is Tier.WARM and got["only@1"].share == 1.0


def test_a_hot_version_stays_hot_until_below_the_exit_thresholds_and_its_hold():
    rules = TierRules(hot_requests_per_hour=100, hot_share=1.0, hot_exit_ratio=0.5, min_hold_s=600)
    first = assess(rules, {"a@1": {H: 110}}, {}, T)
    assert first["a@1"].tier is Tier.HOT and first["a@1"].since == T
    # An hour later it has 60 in the last hour: below the entry threshold, above the exit one.
    later = T + HOUR_S
    second = assess(rules, {"a@1": {H + 1: 60}}, first, later)
    assert second["a@1"].tier is Tier.HOT and second["a@1"].since == T  # still the same stay
    # A new version with the same 60 is not hot: the thresholds depend on the tier held.
    assert assess(rules, {"b@1": {H + 1: 60}}, {}, later)["b@1"].tier is Tier.WARM
    # Below the exit threshold (10 + half of 60 = 40 in the last hour) it goes down to warm.
    third = assess(rules, {"a@1": {H + 1: 60, H + 2: 10}}, second, later + HOUR_S)
    assert third["a@1"].tier is Tier.WARM and third["a@1"].since == later + HOUR_S


def test_no_demotion_before_the_hold_and_promotions_at_once():
    rules = TierRules(hot_requests_per_hour=100, hot_share=1.0, hot_exit_ratio=0.5, min_hold_s=600)
    hot = assess(rules, {"a@1": {H: 200}}, {}, T)
    # 5 minutes later its traffic has gone (a row cut short: say the hour was deleted): held hot.
    soon = assess(rules, {}, hot, T + 300)
    assert soon["a@1"].tier is Tier.HOT and soon["a@1"].since == T
    # Once held for min_hold_s it drops straight to cold (nothing in the last day), and is left out.
    assert assess(rules, {}, soon, T + 600) == {}
    # Warm, then busy again: hot at once, whatever the hold.
    warm = assess(rules, {"a@1": {H: 3}}, {}, T)
    assert warm["a@1"].tier is Tier.WARM
    assert assess(rules, {"a@1": {H: 300}}, warm, T + 1)["a@1"].tier is Tier.HOT


def test_the_window_weights_name_the_25_hours_that_count():
    weights = {h: (w_hour, w_day) for h, w_hour, w_day in window_weights(T)}
    assert sorted(weights) == list(range(H - 24, H + 1))
    assert weights[H] == (1.0, 1.0) and weights[H - 1] == (0.5, 1.0) and weights[H - 2] == (0.0, 1.0)
    assert weights[H - 24] == (0.0, 0.5)


def test_the_ranking():
    states = {
        "x@1": TierState(Tier.HOT, 0.0, last_hour=10, last_day=10),
        "y@1": TierState(Tier.HOT, 0.0, last_hour=50, last_day=50),
        "z@1": TierState(Tier.WARM, 0.0, last_hour=0, last_day=9),
        "w@1": TierState(Tier.WARM, 0.0, last_hour=1, last_day=20),
    }
    assert ranked(states, Tier.HOT) == ["y@1", "x@1"]
    assert ranked(states, Tier.WARM) == ["w@1", "z@1"]


def test_the_rules_come_from_the_config_and_bad_values_are_refused():
    rules = TierRules.from_config(EngineConfig(tier_hot_requests_per_hour=7, tier_hot_share=0.3))
    assert (rules.hot_requests_per_hour, rules.hot_share) == (7, 0.3)
    for bad in (
        {"tier_hot_requests_per_hour": 0},
        {"tier_hot_share": 1.5},
        {"tier_hot_exit_ratio": 0},
        {"tier_min_hold_s": -1},
        {"tier_interval_s": 0},
        {"traffic_retention_hours": 24},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad)
