"""``affinity_load`` against ``affinity`` at every fleet size on the seed trace (issue 42, item 3).

The seed trace (``lorapage replay gen`` defaults, 90 s, first 30 s warm-up), simulated at each size
for both routers in the same run; virtual time, so the figures do not depend on the machine.

    python bench/bench_router_sizes.py [--max-num-seqs 32] [--sizes 12,13,...,26]

Prints one row per size (spills, warm p95 / p99, cold p95, goodput, pool hits, SLO met) and a
JSON last line.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from harness import machine_info, print_json

from lorapage.replay.generator import GenConfig, generate
from lorapage.sim.fleet import SEED_SLO, SimFleetConfig, simulate
from lorapage.sim.simulator import SimConfig

ROUTERS = ("affinity", "affinity_load")


def main(args: argparse.Namespace) -> dict:
    trace = generate(GenConfig(seed=args.seed, duration_s=args.duration))
    engine = SimConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192)
    base = replace(SimFleetConfig(), warmup_s=args.warmup, seed=args.seed, engine=engine)
    rows = []
    print(f"seed trace: {len(trace)} requests, max_num_seqs {args.max_num_seqs}")
    print("| replicas | router | spills | warm p95 | warm p99 | cold p95 | goodput | pool hits | SLO met |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for k in (int(x) for x in args.sizes.split(",")):
        for name in ROUTERS:
            s = simulate(trace, replace(base, replicas=k, router=name)).summary(SEED_SLO)
            row = {
                "replicas": k,
                "router": name,
                "spills": s["spills"],
                "warm_p95_s": s["ttft"]["warm"]["p95"],
                "warm_p99_s": s["ttft"]["warm"]["p99"],
                "cold_p95_s": s["ttft"]["cold"]["p95"],
                "goodput": round(s["goodput_fraction"], 4),
                "pool_hits": round(s["hit_rate"]["gpu"], 4),
                "meets_slo": s["meets_slo"],
            }
            rows.append(row)
            print(
                f"| {k} | {name} | {row['spills']} | {row['warm_p95_s']:.3f} | {row['warm_p99_s']:.3f} | "
                f"{row['cold_p95_s']:.3f} | {row['goodput']:.1%} | {row['pool_hits']:.1%} | "
                f"{'yes' if row['meets_slo'] else 'no'} |",
                flush=True,
            )
    fewest = {
        n: min((r["replicas"] for r in rows if r["router"] == n and r["meets_slo"]), default=None) for n in ROUTERS
    }
    print(f"fewest replicas meeting the SLO: {fewest}")
    return {
        "bench": "router_sizes",
        "max_num_seqs": args.max_num_seqs,
        "rows": rows,
        "fewest": fewest,
        **machine_info(),
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=90.0)
    p.add_argument("--warmup", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--sizes", default="12,13,14,15,16,17,18,19,20,22,24,26")
    print_json(main(p.parse_args()))
