"""Scheduling overhead per step: VTC with 256 running requests and 1,000 tenants, with 5,000
adapters registered against 50. Only the policy's own calls are timed (schedule, one on_service
per running request, on_finish, add); the fake engine around them is not.

    .venv/bin/python bench/bench_scheduler.py [--steps N] [--repeats R] [--long [--long-steps N]]

Both configurations are stepped alternately in one process, so other load on the machine lands
on both alike, over several seeds (tenant weights, arrivals, adapter draws). One seed's ratio says
little: its two workloads take different paths through the policy, and per-seed ratios of one tree
spread from about 0.7 to 1.7. The figure is the pooled ratio: the per-step cost at 5,000 adapters
summed over the seeds, over the same sum at 50 (the per-seed spread is printed beside it).

``--long`` then runs the 5,000-adapter workload for 200,000 steps (many minutes) and times a
window near step 2,000 against one near the end, stepped alternately like the pair: the cost must
not grow with how long the server has run (target ratio <= 1.2). It also prints the sizes of the
policy's lazy heaps at the end, beside what they index.

Prints a table, then one JSON line with the figures and the targets (< 1 ms per step, ratio
< 1.2: the cost must not grow with the number of adapters registered).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import random
import time

from harness import machine_info, machine_line, print_json

from lorapage.scheduler import VtcConfig, VtcScheduler
from lorapage.sim import SimRequest as Req

ROWS = 256
TENANTS = 1000
BACKLOG = 4096  # waiting requests kept in the queue (deep enough to keep all 256 rows busy)
STEP_S = 0.025  # virtual time per step
LOAD_S = 0.05  # an adapter is ready this long after its first request
TARGET_US, TARGET_RATIO = 1000.0, 1.2
LONG_ADAPTERS = 5000
EARLY_STEP = 2000  # the long run's early window starts here
WINDOW = 1000  # steps timed in each window of the long run
TARGET_LONG_RATIO = 1.2


class FakeEngine:
    """Rows are the only capacity; adapters load once and stay resident."""

    def __init__(self) -> None:
        self.ready_at: dict[str, float] = {}
        self.now = 0.0
        self.free_rows = ROWS

    def adapter_ready(self, req: Req) -> bool:
        return req.adapter is None or self.ready_at[req.adapter] <= self.now

    def try_admit(self, req: Req) -> bool:
        if self.free_rows == 0:
            return False
        self.free_rows -= 1
        return True


def zipf_sampler(n: int, rng: random.Random, s: float = 1.1):
    cdf = list(itertools.accumulate(1.0 / (k + 1) ** s for k in range(n)))
    return lambda: f"lora-{bisect.bisect_left(cdf, rng.random() * cdf[-1])}"


class Workload:
    """A VTC policy in steady state: 256 rows kept busy, ``BACKLOG`` requests kept waiting."""

    def __init__(self, num_adapters: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.pick_adapter = zipf_sampler(num_adapters, self.rng)
        weights = {f"t{i}": self.rng.choice([1.0, 1.0, 2.0, 4.0]) for i in range(TENANTS)}
        self.policy: VtcScheduler[Req] = VtcScheduler(VtcConfig(max_loras=32), weights)
        self.engine = FakeEngine()
        self.ids = itertools.count()
        self.running: list[Req] = []
        self.arrivals = [self.new_request() for _ in range(BACKLOG)]
        self.timed = {"schedule": 0.0, "service": 0.0, "add_finish": 0.0}
        self.rows = self.distinct = 0
        self.steps = 0

    def new_request(self) -> Req:
        rng, engine = self.rng, self.engine
        adapter = self.pick_adapter()
        engine.ready_at.setdefault(adapter, engine.now + LOAD_S)
        return Req(
            f"r{next(self.ids)}",
            f"t{rng.randrange(TENANTS)}",
            adapter,
            engine.now,
            rng.randint(16, 512),
            rng.randint(32, 256),
        )

    def step(self, record: bool) -> None:
        policy, engine = self.policy, self.engine
        t0 = time.perf_counter()
        for req in self.arrivals:
            policy.add(req, engine.now)
        t1 = time.perf_counter()
        admitted = policy.schedule(engine.now, engine)
        t2 = time.perf_counter()
        engine.now += STEP_S
        for req in admitted:
            policy.on_service(req, req.num_prompt_tokens, 1, engine.now)
        for req in self.running:
            policy.on_service(req, 0, 1, engine.now)
        t3 = time.perf_counter()
        self.running += admitted
        for req in self.running:
            req.generated += 1
        done = [r for r in self.running if r.generated >= r.max_tokens]
        t4 = time.perf_counter()
        for req in done:
            policy.on_finish(req, engine.now)
        t5 = time.perf_counter()
        if done:
            self.running = [r for r in self.running if r.generated < r.max_tokens]
            engine.free_rows += len(done)
        self.arrivals = [self.new_request() for _ in range(BACKLOG - policy.num_waiting())]
        if record:
            self.timed["schedule"] += t2 - t1
            self.timed["service"] += t3 - t2
            self.timed["add_finish"] += (t1 - t0) + (t5 - t4)
            self.rows += len(self.running)
            self.distinct += policy.lanes.distinct()
            self.steps += 1

    def result(self) -> dict[str, float]:
        out = {k: v / self.steps * 1e6 for k, v in self.timed.items()}
        out["total"] = sum(out.values())
        out["rows"] = self.rows / self.steps
        out["distinct"] = self.distinct / self.steps
        return out


def run_pair(steps: int, seed: int) -> dict[int, dict[str, float]]:
    """Both workloads stepped alternately, so load from other processes hits both alike."""
    pair = {n: Workload(n, seed) for n in (50, 5000)}
    for i in range(steps // 5 + steps):
        for w in pair.values():
            w.step(record=i >= steps // 5)
    return {n: w.result() for n, w in pair.items()}


def pooled(results: list[dict[str, float]]) -> dict[str, float]:
    """Per-step figures over every run's steps (each run measured the same number of steps)."""
    return {key: sum(r[key] for r in results) / len(results) for key in results[0]}


def run_long(steps: int) -> tuple[dict[str, float], dict[str, float], dict[str, int]]:
    """Per-step figures over ``WINDOW`` steps from ``EARLY_STEP`` and over the last ``WINDOW`` of
    ``steps``, and the policy's heap sizes at the end. Two copies of one workload, the late one
    advanced first, are then stepped alternately, so load from other processes hits both alike."""
    late = Workload(LONG_ADAPTERS, seed=0)
    for _ in range(steps - WINDOW):
        late.step(record=False)
    early = Workload(LONG_ADAPTERS, seed=0)
    for _ in range(EARLY_STEP):
        early.step(record=False)
    for _ in range(WINDOW):
        early.step(record=True)
        late.step(record=True)
    return early.result(), late.result(), late.policy.index_sizes()


def print_long(steps: int, early: dict[str, float], late: dict[str, float], sizes: dict[str, int]) -> float:
    """The long run's table; returns the late / early ratio."""
    print(f"\nLong run: {LONG_ADAPTERS} adapters, {steps} steps; {WINDOW}-step windows")
    print(f"{'from step':>9} {'us/step':>8} {'schedule':>9} {'service':>8} {'add+fin':>8} {'rows':>6} {'distinct':>9}")
    for start, r in ((EARLY_STEP, early), (steps - WINDOW, late)):
        print(
            f"{start:>9} {r['total']:>8.1f} {r['schedule']:>9.1f} {r['service']:>8.1f} {r['add_finish']:>8.1f} {r['rows']:>6.1f} {r['distinct']:>9.1f}"
        )
    ratio = late["total"] / early["total"]
    print(f"ratio near step {steps} / near step {EARLY_STEP}: {ratio:.2f} (target <= {TARGET_LONG_RATIO})")
    print(
        f"heaps at the end: tenants {sizes['tenant_heap_entries']} entries for {sizes['tenants_waiting']} waiting tenants; "
        f"age line {sizes['line_entries']} for {sizes['waiting_or_running']} requests waiting or running; "
        f"groups {sizes['group_heap_entries']} for {sizes['groups']} adapters"
    )
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=8, help="runs with different seeds, pooled")
    parser.add_argument("--long", action="store_true", help="also time early against late steps of one long run")
    parser.add_argument("--long-steps", type=int, default=200_000, help="length of the --long run")
    args = parser.parse_args()
    if args.long and args.long_steps < EARLY_STEP + 2 * WINDOW:
        parser.error(f"--long-steps must be at least {EARLY_STEP + 2 * WINDOW}")
    runs = [run_pair(args.steps, seed) for seed in range(args.repeats)]
    best = {n: pooled([r[n] for r in runs]) for n in (50, 5000)}  # per-step means over every seed's steps
    per_seed = sorted(r[5000]["total"] / r[50]["total"] for r in runs)
    print(machine_line())
    print(
        f"VTC scheduling overhead per step: {ROWS} rows, {TENANTS} tenants, {BACKLOG} waiting; {args.repeats} seeds x {args.steps} steps, pooled"
    )
    print(f"{'adapters':>9} {'us/step':>8} {'schedule':>9} {'service':>8} {'add+fin':>8} {'rows':>6} {'distinct':>9}")
    for n, r in best.items():
        print(
            f"{n:>9} {r['total']:>8.1f} {r['schedule']:>9.1f} {r['service']:>8.1f} {r['add_finish']:>8.1f} {r['rows']:>6.1f} {r['distinct']:>9.1f}"
        )
    ratio = best[5000]["total"] / best[50]["total"]
    print(
        f"ratio 5000 / 50 adapters, pooled: {ratio:.2f} (target < {TARGET_RATIO}); worst us/step {max(r['total'] for r in best.values()):.0f} (target < {TARGET_US:.0f})"
    )
    print(f"per-seed ratios (spread, not the figure): {' '.join(f'{x:.2f}' for x in per_seed)}")
    figures = {
        "bench": "scheduler",
        "us_per_step_50_adapters": round(best[50]["total"], 1),
        "us_per_step_5000_adapters": round(best[5000]["total"], 1),
        "ratio": round(ratio, 3),
        "seeds": args.repeats,
        "per_seed_ratio_min": round(per_seed[0], 3),
        "per_seed_ratio_median": round(per_seed[len(per_seed) // 2], 3),
        "per_seed_ratio_max": round(per_seed[-1], 3),
        "target_us_per_step": TARGET_US,
        "target_ratio": TARGET_RATIO,
        "running": ROWS,
        "tenants": TENANTS,
        "pass": max(r["total"] for r in best.values()) < TARGET_US and ratio < TARGET_RATIO,
        **machine_info(),
    }
    if args.long:
        early, late, sizes = run_long(args.long_steps)
        long_ratio = print_long(args.long_steps, early, late, sizes)
        figures.update({
            "long_steps": args.long_steps,
            "long_us_per_step_early": round(early["total"], 1),
            "long_us_per_step_late": round(late["total"], 1),
            "long_ratio": round(long_ratio, 3),
            "target_long_ratio": TARGET_LONG_RATIO,
            "long_rows_early": round(early["rows"], 1),
            "long_rows_late": round(late["rows"], 1),
            "pass": figures["pass"] and long_ratio <= TARGET_LONG_RATIO,
        })  # fmt: skip
    print_json(figures)


if __name__ == "__main__":
    main()
