"""Decode runs (lorapage/sim/simulator.py): steps that only decode, run as one, give the very
results of stepping one at a time, on a fixed fleet (KV roomy and tight) and an autoscaled one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lorapage.fleet.autoscale import AutoscaleConfig
from lorapage.replay.generator import GenConfig, generate
from lorapage.sim.fleet import SimFleetConfig, simulate
from lorapage.sim.scaling import ScalingConfig, simulate_scaled


def _stepwise(config: SimFleetConfig, decode_runs: bool) -> SimFleetConfig:
    return replace(config, engine=replace(config.engine, decode_runs=decode_runs))


def _key(records) -> list[tuple]:
    return [(r.index, r.tier, r.ttft_s, r.e2e_s, r.output_tokens, r.end_s, r.outcome) for r in records]


@pytest.fixture(scope="module")
def trace():
    config = GenConfig(seed=3, scale=0.2, rate=12.0, duration_s=40.0, diurnal_amplitude=0.5, diurnal_period_s=40.0)
    return generate(config)


@pytest.mark.parametrize("replicas, kv_pages", [(4, 4096), (2, 600)])
def test_a_fixed_fleet_gives_the_same_records_and_steps(trace, replicas: int, kv_pages: int) -> None:
    base = SimFleetConfig(replicas=replicas, drain_s=30.0)
    base = replace(base, engine=replace(base.engine, num_kv_pages=kv_pages))
    one, runs = (simulate(trace, _stepwise(base, d)) for d in (False, True))
    assert _key(one.records) == _key(runs.records)
    assert one.steps == runs.steps and one.prewarms == runs.prewarms
    assert one.summary() == runs.summary()


def test_an_autoscaled_fleet_gives_the_same_records_and_replica_hours(trace) -> None:
    policy = AutoscaleConfig(max_replicas=6, target_tokens=8_000, upscale_delay_s=1, downscale_delay_s=4)
    scaling = ScalingConfig(policy=policy, hour_s=40.0 / 24, join_s=2.0)
    one, runs = (simulate_scaled(trace, _stepwise(SimFleetConfig(), d), scaling) for d in (False, True))
    assert len(set(one.replica_of)) >= 2  # it did scale
    assert _key(one.records) == _key(runs.records)
    assert one.timeline == runs.timeline and one.replica_hours == runs.replica_hours
    assert one.ticks == runs.ticks
