"""The seed's day on an autoscaled simulated fleet: replica-hours against the compute floor's,
p95 TTFT hour by hour, and TTFT on replicas that just joined.

The trace is ``lorapage replay gen``'s seed workload under a diurnal ramp: the mean rate 21.6
req/s with amplitude 0.85 peaks at 40 req/s and bottoms at 3.2 (8%), Zipf 1.3 over 5,000 adapters,
Zipf tenants (a few customers most of the traffic); the same as

    lorapage replay gen -o day.jsonl --duration 86400 --rate 21.62 --diurnal-amplitude 0.85 \\
        --diurnal-period 86400

Every replica is the seed's 7B replica under ``GPU_7B`` costs (``bench_fleet.py``); the fleet's
size follows ``lorapage.fleet.autoscale`` (the policy Ray Serve runs) on the virtual clock, with the
join sequence of ``lorapage.sim.scaling``. ``--hour`` shrinks the day (24 "hours" of that many
seconds: the ramp is steeper than a real day's, which is harder on the autoscaler); ``--scale``
multiplies rate and adapters. ``--quick``: a 24-minute day at scale 0.25, join 1 s, delays 1 s / 8 s, smoothing 3 s, lead 1 s, headroom 0.3 (about 30 s).

    python bench/bench_autoscale.py [--quick] [--hour 3600] [--scale 1] [--router affinity_load]

Prints the table; the last line is one JSON object with every figure and the targets.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace

from harness import machine_line, print_json, table

from lorapage.fleet.autoscale import AutoscaleConfig
from lorapage.replay.generator import GenConfig, generate
from lorapage.sim.fleet import SEED_SLO, SimFleetConfig
from lorapage.sim.scaling import ScalingConfig, floor_device_seconds, floor_replica_hours, simulate_scaled

PEAK, TROUGH_SHARE = 40.0, 0.08  # req/s at the peak, the trough's share of it
AMPLITUDE = (1 - TROUGH_SHARE) / (1 + TROUGH_SHARE)
TARGET_RATIO = 1.15
# The policy this bench runs unless told otherwise (AutoscaleConfig's own defaults keep every option
# off): a nearly full replica's tokens, square-root headroom 0.2, tokens averaged over three minutes
# and projected a base load (60 s) ahead on a rising slope, scale-down after 120 s. The seed's tokens
# in flight swing +-15% over minutes (log-normal outputs: a long one holds its tokens for a minute
# or more), and the scale-down's wait holds the top of that swing; the queue still acts on every
# report. docs/fleet.md, "Autoscaling".
SEED_POLICY = AutoscaleConfig(
    target_tokens=30_000, headroom=0.2, smoothing_s=180.0, lead_s=60.0, upscale_delay_s=10.0, downscale_delay_s=120.0
)


def _s(v: float | None) -> str:
    return "-" if v is None else ("inf" if math.isinf(v) else f"{v:.3f}")


def main(args: argparse.Namespace) -> dict:
    day = 24 * args.hour
    gen = GenConfig(
        seed=args.seed,
        scale=args.scale,
        rate=PEAK / (1 + AMPLITUDE),
        duration_s=day,
        diurnal_amplitude=AMPLITUDE,
        diurnal_period_s=day,
    )
    trace = generate(gen)
    config = replace(SimFleetConfig(), router=args.router, seed=args.seed)
    policy = AutoscaleConfig(
        min_replicas=1,
        max_replicas=args.max_replicas,
        target_tokens=args.target_tokens,
        upscale_delay_s=args.upscale_delay,
        downscale_delay_s=args.downscale_delay,
        headroom=args.headroom,
        smoothing_s=args.smoothing,
        lead_s=args.lead,
    )
    # The day starts with the fleet its first hour needs (yesterday's fleet at the trough), not from
    # one replica under load: the compute floor of the first hour, in replicas.
    first = [r for r in trace if r.arrival_s < args.hour]
    initial = max(1, round(floor_replica_hours(first, config, args.hour) * 3600 / args.hour))
    scaling = ScalingConfig(policy=policy, hour_s=args.hour, join_s=args.join, initial_replicas=initial)
    started = time.perf_counter()
    result = simulate_scaled(trace, config, scaling)
    elapsed = time.perf_counter() - started
    hourly = result.hourly(SEED_SLO)
    need = floor_device_seconds(trace, config, args.hour)
    split = {s["hour"]: s for s in result.split()}
    for h in hourly:
        h["floor"] = math.ceil(need.get(h["hour"], 0.0) / args.hour)
        h["floor_continuous"] = round(need.get(h["hour"], 0.0) / args.hour, 3)
        h.update({k: v for k, v in split.get(h["hour"], {}).items() if k != "hour"})
    excess = _excess(hourly, args.hour)
    ratio = result.replica_hours / result.floor_hours if result.floor_hours else None
    ratio_cont = result.replica_hours / result.floor_continuous_hours if result.floor_continuous_hours else None
    phases = {k: round(v, 3) for k, v in result.phase_hours.items()}
    up = result.scale_up_ttft()
    print(machine_line())
    print(
        f"seed day: {len(trace)} requests, 24 hours of {args.hour:g} s, scale {args.scale:g} (peak "
        f"{PEAK * args.scale:g} req/s), router {args.router}, {config.costs.name} costs; target tokens "
        f"{args.target_tokens:g}, headroom {args.headroom:g}, smoothing {args.smoothing:g} s, lead {args.lead:g} s, delays up "
        f"{args.upscale_delay:g} s / down {args.downscale_delay:g} s, join {args.join:g} s; the day starts with "
        f"{initial} replicas (the first hour's floor)\n"
    )
    rows = [
        [
            h["hour"],
            h["requests"],
            h["floor"],
            f"{h['floor_continuous']:.2f}",
            f"{h.get('asked', 0):.2f}",
            f"{h.get('held', 0):.2f}",
            f"{h.get('draining', 0):.2f}",
            f"{h['replicas']:.2f}",
            _s(h["warm_p95"]),
            _s(h["cold_p95"]),
            "yes" if h["meets"] else "NO",
        ]
        for h in hourly
    ]
    heads = ["hour", "requests", "floor", "continuous", "asked", "held", "draining", "mean replicas"]
    print(table([*heads, "warm p95 s", "cold p95 s", "meets"], rows, "rrrrrrrrrrl"))
    print(
        f"\nreplica-hours {result.replica_hours:.2f} (hours of 3,600 s; loading the base {phases['joining']:.2f}, "
        f"serving {phases['serving']:.2f}, draining {phases['draining']:.2f}), compute floor in whole replicas "
        f"per hour {result.floor_hours:.2f}: {ratio:.3f}x (target <= {TARGET_RATIO}); continuous floor "
        f"{result.floor_continuous_hours:.2f}: {ratio_cont:.3f}x; every hour meets: {all(h['meets'] for h in hourly)}; "
        f"TTFT on just-joined replicas p50 / p95 / p99 {_s(up['p50'])} / {_s(up['p95'])} / {_s(up['p99'])} s "
        f"({up['count']} requests); {result.prewarms} pre-warms\n({elapsed:.0f} s of simulation)"
    )
    print(
        "where the replica-hours above the continuous floor went (replica-hours): "
        + ", ".join(f"{k} {v:+.2f}" for k, v in excess.items())
    )
    return {
        "bench": "autoscale",
        "requests": len(trace),
        "hour_s": args.hour,
        "scale": args.scale,
        "router": args.router,
        "policy": policy.__dict__,
        "join_s": args.join,
        "initial_replicas": initial,
        "replica_hours": round(result.replica_hours, 3),
        "phase_replica_hours": phases,
        "floor_replica_hours": round(result.floor_hours, 3),
        "floor_continuous_replica_hours": round(result.floor_continuous_hours, 3),
        "ratio": None if ratio is None else round(ratio, 4),
        "ratio_continuous": None if ratio_cont is None else round(ratio_cont, 4),
        "meets_target": bool(ratio is not None and ratio <= TARGET_RATIO and all(h["meets"] for h in hourly)),
        "every_hour_meets": all(h["meets"] for h in hourly),
        "hourly": hourly,
        "excess_replica_hours": excess,
        "scale_up_ttft": up,
        "prewarms": result.prewarms,
        "targets": {"warm_p95_s": SEED_SLO.ttft_s, "cold_p95_s": SEED_SLO.ttft_cold_s, "ratio": TARGET_RATIO},
        "elapsed_s": round(elapsed, 1),
    }


def _excess(hourly: list[dict], hour_s: float) -> dict[str, float]:
    """Replica-hours above the continuous floor, by cause: the level the reports asked for over
    the floor (``level``), the hysteresis (held above or below it: ``lag``), drains and the rest
    (base loads, and ticks' sampling against the exact timeline: ``other``)."""
    f = hour_s / 3600.0
    total = {
        k: sum(h.get(k, 0.0) for h in hourly) * f for k in ("floor_continuous", "asked", "held", "draining", "replicas")
    }
    level = total["asked"] - total["floor_continuous"]
    lag = total["held"] - total["asked"]
    other = total["replicas"] - total["held"] - total["draining"]
    return {
        "level": round(level, 3),
        "lag": round(lag, 3),
        "draining": round(total["draining"], 3),
        "other": round(other, 3),
        "total": round(total["replicas"] - total["floor_continuous"], 3),
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a 24-minute day at scale 0.25")
    p.add_argument("--hour", type=float, default=3600.0, help="seconds of one of the day's 24 hours")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies rate and adapters")
    p.add_argument("--router", default="affinity_load")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-replicas", type=int, default=40)
    p.add_argument("--target-tokens", type=float, default=SEED_POLICY.target_tokens)
    p.add_argument("--upscale-delay", type=float, default=SEED_POLICY.upscale_delay_s)
    p.add_argument("--downscale-delay", type=float, default=SEED_POLICY.downscale_delay_s)
    p.add_argument("--headroom", type=float, default=SEED_POLICY.headroom)
    p.add_argument("--smoothing", type=float, default=SEED_POLICY.smoothing_s)
    p.add_argument("--lead", type=float, default=SEED_POLICY.lead_s)
    p.add_argument("--join", type=float, default=ScalingConfig().join_s, help="seconds a replica loads the base")
    a = p.parse_args()
    if a.quick:  # a day 60 times shorter: the base load, waits and smoothing about 60 times shorter too,
        # and headroom 0.3: at 0.2 a ramp 60 times a day's misses an evening hour (warm p95 1.2 s)
        a.hour, a.scale, a.join, a.upscale_delay, a.downscale_delay, a.smoothing, a.lead = 60.0, 0.25, 1, 1, 8, 3, 1
        a.headroom = 0.3
    print_json(main(a), default=str)
