"""The lent tail lane's bound (``--lane-lend-max-tokens``) under sustained load, on the simulator's
virtual clock (deterministic: no wall time, so the machine does not matter).

Three tenants send ``--rate`` requests a second (100: above capacity) for 5 hot adapters (prompts
16-128 tokens, outputs ``--min-out``-``--max-out`` tokens) on 4 lanes (one reserved for the tail, ``max_num_seqs`` 32);
a single-request adapter arrives every half second from t=2. For each bound (0: off) and seed:
mean rows per step and the share of full steps after t=1, the preemptions the bound caused, and
the singles' worst and median wait for admission (queue wait, virtual seconds; a lane's wait plus
the adapter's load). ``tests/scheduler/test_vtc_lanes.py`` runs the same workload at 20-60 tokens.

    python bench/bench_tail_bound.py [--seeds 4 5 6] [--bounds 0 8 16 32] [--min-out 20 --max-out 60] [--rate 100]
"""

from __future__ import annotations

import argparse
import random
import statistics

from harness import print_json, table

from lorapage.scheduler import VtcConfig, make_policy
from lorapage.sim import SimConfig, SimRequest, Simulator


def trace(seed: int, min_out: int, max_out: int, rate: float = 100.0) -> tuple[list[SimRequest], list[SimRequest]]:
    rng = random.Random(seed)
    hot, t, i = [], 0.0, 0
    while t < 12.0:
        t += rng.expovariate(rate)
        hot.append(SimRequest(f"h{i}", f"t{i % 3}", f"hot{rng.randrange(5)}", t, rng.randint(16, 128),
                              rng.randint(min_out, max_out)))  # fmt: skip
        i += 1
    singles = [SimRequest(f"s{k}", "tail", f"single{k}", 2.0 + 0.5 * k, 64, 32) for k in range(16)]
    return hot + singles, singles


def run(seed: int, bound: int, min_out: int, max_out: int, rate: float) -> dict[str, float]:
    requests, singles = trace(seed, min_out, max_out, rate)
    vtc = VtcConfig(max_loras=4, reserved_tail_lanes=1, age_deadline_s=5.0, lend_max_tokens=bound)
    sim = Simulator(make_policy("vtc", vtc=vtc), SimConfig(max_num_seqs=32), requests)
    rows: list[int] = []
    sim.run(until=12.0, on_step=lambda s: rows.append(s.last_batch_size) if s.now > 1 else None)
    waits = [r.queue_wait for r in singles if r.admitted_at is not None]
    return {
        "rows": sum(rows) / len(rows),
        "full": sum(r == 32 for r in rows) / len(rows),
        "preemptions": sim.preemptions,
        "admitted": len(waits),
        "max_wait_s": max(waits),
        "median_wait_s": statistics.median(waits),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[4, 5, 6])
    parser.add_argument("--bounds", type=int, nargs="+", default=[0, 8, 16, 32])
    parser.add_argument("--min-out", type=int, default=20)
    parser.add_argument("--max-out", type=int, default=60)
    parser.add_argument("--rate", type=float, default=100.0, help="hot requests a second")
    args = parser.parse_args()
    results = {(s, b): run(s, b, args.min_out, args.max_out, args.rate) for s in args.seeds for b in args.bounds}
    header = ["seed", "bound", "rows/step", "full steps", "preemptions", "singles in", "max wait s", "median wait s"]
    body = [
        [
            s,
            b or "off",
            f"{r['rows']:.3f}",
            f"{r['full']:.3f}",
            r["preemptions"],
            r["admitted"],
            f"{r['max_wait_s']:.3f}",
            f"{r['median_wait_s']:.3f}",
        ]  # fmt: skip
        for (s, b), r in results.items()
    ]
    print(
        f"{args.rate:g} hot requests/s, outputs {args.min_out}-{args.max_out} tokens, 5 hot adapters on 4 lanes (1 tail), a single every 0.5 s"
    )
    print(table(header, body, "rrrrrrrr"))
    print_json(
        {
            "outputs": [args.min_out, args.max_out],
            "runs": [{"seed": s, "bound": b, **r} for (s, b), r in results.items()],
        }
    )


if __name__ == "__main__":
    main()
