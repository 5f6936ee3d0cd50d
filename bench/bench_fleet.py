"""The seed workload on a simulated fleet: does 26 replicas meet p95 TTFT < 1 s warm and < 2 s
cold under each routing policy, and what is the fewest that does?

The trace is the seed design's (``lorapage replay gen`` defaults: 5,000 adapters, Zipf 1.3,
40 req/s Poisson, prompts of 750 and outputs of 250 tokens on average); every replica runs the
real VTC policy with the seed's 7B replica (32 sequences, 250 GPU adapter slots, 400 in host RAM,
1,000 on local disk) and the GPU cost model of ``lorapage.sim.costs.GPU_7B``. The first
``--warmup`` seconds fill the caches and are left out of the figures.

    python bench/bench_fleet.py [--duration 90] [--warmup 30] [--most 26] [--routers ...]

Prints the table; the last line is one JSON object with every figure and the targets.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from harness import machine_info, machine_line, print_json

from lorapage.fleet.routing import ROUTERS
from lorapage.replay.generator import GenConfig, generate
from lorapage.sim.compare import compare_routers, render_table
from lorapage.sim.fleet import SEED_SLO, SimFleetConfig

SEED_REPLICAS = 26


def main(args: argparse.Namespace) -> dict:
    trace = generate(GenConfig(seed=args.seed, duration_s=args.duration))
    config = replace(SimFleetConfig(), replicas=SEED_REPLICAS, warmup_s=args.warmup, seed=args.seed)
    started = time.perf_counter()
    rows = compare_routers(trace, config, args.routers.split(","), find_most=args.most)
    elapsed = time.perf_counter() - started
    print(machine_line())
    print(
        f"seed workload: {len(trace)} requests over {args.duration:g} s (first {args.warmup:g} s warm-up), "
        f"{config.costs.name} costs\n"
    )
    print(render_table(rows))
    print(f"\n({elapsed:.0f} s of simulation)")
    return {
        "bench": "fleet",
        "requests": len(trace),
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "costs": config.costs.name,
        "targets": {
            "ttft_warm_p95_s": SEED_SLO.ttft_s,
            "ttft_cold_p95_s": SEED_SLO.ttft_cold_s,
            "replicas": SEED_REPLICAS,
        },
        "routers": {
            r["router"]: {
                "meets_slo_at_26": r["meets_slo"],
                "fewest_replicas": r.get("fewest_replicas"),
                "ttft_warm_p95_s": r["ttft"]["warm"]["p95"],
                "ttft_cold_p95_s": r["ttft"]["cold"]["p95"],
                "ttft_warm_p99_s": r["ttft"]["warm"]["p99"],
                "pool_hit_rate": r["hit_rate"]["gpu"],
                "goodput_fraction": r["goodput_fraction"],
                "spills": r["spills"],
            }
            for r in rows
        },
        "simulation_s": round(elapsed, 1),
        **machine_info(),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of trace")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds left out of the figures")
    parser.add_argument(
        "--most", type=int, default=SEED_REPLICAS, help="search the fewest replicas up to this; 0: no search"
    )
    parser.add_argument(
        "--routers",
        default=",".join(("affinity_load", "affinity", "ray_default", "least_loaded", "random")),
        help=f"comma-separated subset of {','.join(ROUTERS)}",
    )
    parser.add_argument("--seed", type=int, default=0)
    print_json(main(parser.parse_args()), default=str)
