"""The autoscaling policy (lorapage/fleet/autoscale.py): pure, on a clock the test moves."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from lorapage.fleet.autoscale import (
    AutoscaleConfig,
    Autoscaler,
    RayAutoscalingPolicy,
    ReplicaLoad,
    autoscaling_config,
    decide,
    desired,
    wanted,
)

CONFIG = AutoscaleConfig(
    min_replicas=1, max_replicas=10, target_tokens=10_000, target_queue=4, max_num_seqs=32,
    upscale_delay_s=10, downscale_delay_s=60,
)  # fmt: skip


def loads(n: int, tokens: float, queue: float = 0, kv_free: float = 0.5) -> list[ReplicaLoad]:
    return [ReplicaLoad(queue, tokens, kv_free) for _ in range(n)]


def test_wanted_counts_tokens_queue_and_kv_not_requests() -> None:
    assert wanted(loads(2, 10_000), 2, CONFIG) == 2  # at target
    assert wanted(loads(2, 20_000), 2, CONFIG) == 4  # 40k tokens / 10k
    assert wanted(loads(2, 1_000), 2, CONFIG) == 1  # 2k tokens: one replica holds it
    # A queue past target_queue a replica: one more replica per max_num_seqs queued beyond it.
    assert wanted(loads(2, 5_000, queue=4), 2, CONFIG) == 1  # a queue at target: the tokens decide
    assert wanted(loads(2, 5_000, queue=40), 2, CONFIG) == 2 + 3  # 80 - 8 = 72 over: ceil(72 / 32)
    # KV nearly full on average: one more, whatever the tokens say.
    assert wanted(loads(2, 5_000, kv_free=0.01), 2, CONFIG) == 3
    assert wanted(loads(2, 1e9), 2, CONFIG) == 10  # max_replicas
    assert wanted([], 3, CONFIG) == 1  # nothing reported: min_replicas


def test_upscale_waits_its_delay_and_takes_the_least_wanted_meanwhile() -> None:
    t = [0.0]
    scaler = Autoscaler(CONFIG, lambda: t[0])
    assert scaler(loads(2, 30_000), 2) == 2  # wants 6 from t=0
    t[0] = 5
    assert scaler(loads(2, 20_000), 2) == 2  # wants 4: the least over the wait
    t[0] = 10
    assert scaler(loads(2, 40_000), 2) == 4  # delay passed: the least it wanted (4), not this report's 8
    assert scaler.state == {}


def test_a_burst_shorter_than_the_delay_adds_nothing() -> None:
    t = [0.0]
    scaler = Autoscaler(CONFIG, lambda: t[0])
    assert scaler(loads(2, 40_000), 2) == 2
    t[0] = 5
    assert scaler(loads(2, 10_000), 2) == 2  # back at the count: the wait resets
    t[0] = 12
    assert scaler(loads(2, 40_000), 2) == 2  # a new wait starts here
    t[0] = 22
    assert scaler(loads(2, 40_000), 2) == 8


def test_downscale_is_slow_bounded_and_keeps_the_most_wanted() -> None:
    t = [0.0]
    scaler = Autoscaler(CONFIG, lambda: t[0])
    assert scaler(loads(8, 1_000), 8) == 8  # wants 1
    t[0] = 30
    assert scaler(loads(8, 3_000), 8) == 8  # wants 3: the most over the wait
    t[0] = 59
    assert scaler(loads(8, 1_000), 8) == 8
    t[0] = 60
    assert scaler(loads(8, 1_000), 8) == 4  # max(3, 8 - max_downscale 4)
    # Wobbling between above and below restarts the downscale wait.
    assert scaler(loads(4, 1_000), 4) == 4
    t[0] = 100
    assert scaler(loads(4, 10_000), 4) == 4  # wants 4: resets
    t[0] = 121
    assert scaler(loads(4, 1_000), 4) == 4  # the wait started again at 121
    t[0] = 181
    assert scaler(loads(4, 1_000), 4) == 1


def test_bounds_apply_at_once() -> None:
    assert decide([], 12, 0.0, {}, CONFIG) == (10, {})
    assert decide([], 0, 0.0, {}, CONFIG) == (1, {})


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="min_replicas <= max_replicas"):
        AutoscaleConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="target_tokens > 0"):
        AutoscaleConfig(target_tokens=0)
    with pytest.raises(ValueError, match="look_back_period_s > 0"):
        AutoscaleConfig(look_back_period_s=0)


def test_ray_policy_reads_the_custom_metrics_and_keeps_its_state_in_ray() -> None:
    """The same decision through Ray Serve's custom policy: a context as Ray 2.5x+ builds it."""
    kwargs = autoscaling_config(CONFIG)["policy"].policy_kwargs
    policy = RayAutoscalingPolicy(**kwargs)
    replicas = ["a", "b"]

    def ctx(now: float, tokens: float, state: dict) -> SimpleNamespace:
        metrics = {"tokens_in_flight": dict.fromkeys(replicas, tokens), "queue_depth": {"a": 0.0}, "kv_free": {}}
        return SimpleNamespace(
            capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=10, aggregated_metrics=metrics,
            running_replicas=replicas, current_time=now, target_num_replicas=2, policy_state=state,
        )  # fmt: skip

    n, state = policy(ctx(0.0, 30_000, {}))
    assert (n, state["up_since"]) == (2, 0.0)
    assert policy(ctx(10.0, 30_000, state)) == (6, {})
    assert autoscaling_config(CONFIG)["upscale_delay_s"] == 0.0  # the policy's own delays, not Ray's on top
    # Ray's report cadence and window are Ray's options, not the policy's.
    fast = autoscaling_config(replace(CONFIG, metrics_interval_s=0.5, look_back_period_s=2.0))
    assert (fast["metrics_interval_s"], fast["look_back_period_s"]) == (0.5, 2.0)
    assert "look_back_period_s" not in fast["policy"].policy_kwargs


def test_headroom_grows_with_the_square_root_of_the_load() -> None:
    config = AutoscaleConfig(max_replicas=100, target_tokens=10_000, headroom=0.5)
    assert wanted(loads(1, 40_000), 1, config) == 5  # L = 4: ceil(4 + 0.5 * 2)
    assert wanted(loads(1, 160_000), 1, config) == 18  # L = 16: ceil(16 + 0.5 * 4), not 4 x 5
    assert wanted(loads(1, 0), 1, config) == 1  # min_replicas


def test_smoothing_reads_the_mean_so_a_spike_neither_adds_nor_resets() -> None:
    config = AutoscaleConfig(
        max_replicas=10, target_tokens=10_000, upscale_delay_s=10, downscale_delay_s=60, smoothing_s=20
    )
    t = [0.0]
    scaler = Autoscaler(config, lambda: t[0])
    assert scaler(loads(4, 5_000), 4) == 4  # 20k tokens: wants 2, the downscale wait starts
    for now in range(1, 60):  # one report in ten is a spike to 60k tokens (6 replicas' worth)
        t[0] = now
        assert scaler(loads(4, 15_000 if now % 10 == 0 else 5_000), 4) == 4
    t[0] = 60
    assert scaler(loads(4, 5_000), 4) == 3  # the mean (~24k) never wanted 4: down after the delay
    # Without smoothing the same spikes reset the wait each time.
    raw = Autoscaler(replace(config, smoothing_s=0.0), lambda: t[0])
    for now in range(0, 121):
        t[0] = now
        assert raw(loads(4, 15_000 if now % 10 == 0 else 5_000), 4) == 4


def test_lead_projects_a_rising_slope_ahead() -> None:
    config = AutoscaleConfig(max_replicas=20, target_tokens=10_000, upscale_delay_s=0, smoothing_s=10, lead_s=30)
    flat = Autoscaler(replace(config, lead_s=0.0), lambda: t[0])
    t = [0.0]
    ahead = Autoscaler(config, lambda: t[0])
    n_flat = n_ahead = 2
    for now in range(0, 101):  # 1,000 tokens more each second: from 20k to 120k
        t[0] = now
        n_flat = flat(loads(1, 20_000 + 1_000 * now), n_flat)
        n_ahead = ahead(loads(1, 20_000 + 1_000 * now), n_ahead)
        assert n_ahead >= n_flat
    # The mean lags 10 s (10k tokens); the projection covers it and 30 s more: 150k tokens' worth.
    assert n_flat in (11, 12) and n_ahead == 15
    with pytest.raises(ValueError, match="smoothing_s > 0 for a lead_s"):
        AutoscaleConfig(lead_s=30)


def test_desired_is_what_decide_moves_to_and_the_autoscaler_reports_it() -> None:
    # Before the hysteresis: what the reports call for now, as decide() reads them.
    assert desired(loads(2, 20_000), 0.0, {}, CONFIG, 2) == (4, {})
    now = [0.0]
    scaler = Autoscaler(CONFIG, lambda: now[0])
    assert scaler(loads(2, 20_000), 2) == 2 and scaler.wanted == 4  # wanted at once, held for the delay
    now[0] = 10.0
    assert scaler(loads(2, 20_000), 2) == 4 and scaler.wanted == 4
    smooth = replace(CONFIG, smoothing_s=10.0)
    count, state = desired(loads(2, 20_000), 5.0, {"tokens": 0.0, "tokens_slow": 0.0, "tokens_at": 0.0}, smooth, 2)
    assert state["tokens"] < 40_000 and count == wanted(loads(2, 20_000), 2, smooth, state["tokens"])
