"""The adapter cost model against this CPU: projected vs measured decode overhead, by shape.

The projection (``lorapage.adapters.cost``, the design's arithmetic) is the extra bytes a decode
step reads, in % of the base's: each distinct adapter in the batch is read once per step, the base
once for everyone, so ``D`` distinct adapters of ``W_a`` bytes cost ``100 * D * W_a / W_base``. It
is measured as the design defines it: one decode batch of 32 rows, every row on its own adapter
(32 ids registered on the shape's files, each resident in its own pages), against the same 32
requests on the base; and, beside it, the 32 rows on one adapter of the shape (``D = 1``).
Every shape's adapters are resident at once. One full decode step of each mix (the base; per
shape, distinct and one) is captured from the engine (requests decoded through it) and the nine
are then run in turns on the engine's forward thread, timed, ``--repeats`` turns after a few
untimed ones: the steps of a turn run back to back, so on shared cores each meets what the others
meet. Measured overhead = the median over turns of (mix step / base step of the same turn) - 1.

Shapes: attention-only rank 8 and 16, all modules rank 16 and 64, on the ~100M bench model
(``make_llama``: hidden 768, 12 layers, MLP 2,048, vocab 32,000, fp32). The ranking of projected
and measured must agree. A second projection for this machine is printed too: the distinct
adapters' bytes read at the bandwidth a ``sum`` streams here, over the measured base step. The
design's projection assumes a memory-bound base step, which a GPU decode step is; on this CPU the
base step is compute-bound, so it overstates the overhead (the ratio is printed).

    python bench/bench_cost.py [--quick] [--repeats N]

Prints a table, then one JSON line with every figure and its target.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from harness import machine_info, machine_line, median, print_json
from make_llama import MODULES, write_adapter, write_model
from workloads import decode_rate, stream_bandwidth

from lorapage import Engine, EngineConfig
from lorapage.model.runner import StepPlan

BATCH = 32
SHAPE = dict(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=32000)
ATTENTION = MODULES[:4]
SHAPES = {  # name: (rank, modules), in the order the design ranks them
    "attention r8": (8, ATTENTION),
    "attention r16": (16, ATTENTION),
    "all r16": (16, MODULES),
    "all r64": (64, MODULES),
}
PROMPT_LEN = 16
CAPTURE_TOKENS = 4  # tokens per request in the passes whose decode steps are captured
WARMUP_TURNS = 5  # turns run before the timed ones


def make_engine(model: Path, dirs: dict[str, Path]) -> tuple[Engine, dict[str, list[str]]]:
    """One engine with ``BATCH`` ids per shape, each id a distinct adapter over the shape's files,
    with lora slots (and pool pages) for all of them at once."""
    engine = Engine(
        EngineConfig(
            model=str(model),
            max_loras=BATCH * len(SHAPES),  # every shape's adapters resident at once
            max_lora_rank=64,
            shared_envelope="all:64",  # the bench costs shapes outside the default envelope on purpose
            max_cpu_loras=BATCH * len(SHAPES),
            max_num_seqs=BATCH,
            max_model_len=128,
            scheduler="fcfs",
            enable_prefix_caching=False,  # every pass reuses its prompts
        )
    )
    names: dict[str, list[str]] = {}
    for shape, path in dirs.items():
        checked = engine.admin.catalog.preparer.check(path)
        tag = shape.replace(" ", "-")
        names[shape] = [f"{tag}-{i}" for i in range(BATCH)]
        for name in names[shape]:
            engine.admin.catalog.add(name, path, checked=checked)
    return engine, names


class PlanCapture:
    """Keeps the last full decode step (``BATCH`` rows, no prompt tokens) the engine's runner
    executes, so it can be run again and again, timed, after its requests finish."""

    def __init__(self, engine: Engine) -> None:
        runner = engine.debug.runner
        self.execute = runner.execute
        self.last: StepPlan | None = None

        def capture(plan: StepPlan) -> Any:
            if plan.num_decode == len(plan.block_tables) == BATCH:
                self.last = plan
            return self.execute(plan)

        runner.execute = capture  # type: ignore[method-assign]

    async def plan_of(self, engine: Engine, rows: list[str | None]) -> StepPlan:
        """A full decode step of ``rows``, from running them."""
        self.last = None
        await decode_rate(engine, rows, PROMPT_LEN, CAPTURE_TOKENS)
        if self.last is None:
            raise RuntimeError(f"no decode step of {BATCH} rows came out of the pass")
        return self.last


async def measure(engine: Engine, names: dict[str, list[str]], repeats: int) -> dict[str, list[float]]:
    """Every shape's adapters resident at once: one full decode step each of the base and, per
    shape, the rows on distinct adapters and the rows on one adapter, captured from the engine,
    then run in turns on the forward thread, timed, after ``WARMUP_TURNS`` untimed ones. A turn
    runs every step back to back (starting one further along each turn), so on shared cores each
    meets what the others meet; returns the base's step seconds and each mix's step time over the
    base step of its turn, per turn."""
    capture = PlanCapture(engine)
    loop = asyncio.get_running_loop()
    await asyncio.gather(*(engine.admin.load(n) for ids in names.values() for n in ids))
    await decode_rate(engine, [None] * 4, PROMPT_LEN, 3)  # warm-up
    plans = {"base": await capture.plan_of(engine, [None] * BATCH)}
    for shape, ids in names.items():
        plans[f"{shape}|distinct"] = await capture.plan_of(engine, list(ids))
        plans[f"{shape}|one"] = await capture.plan_of(engine, [ids[0]] * BATCH)
    assert all(
        engine.debug.residency.tier(engine.admin.catalog.resolve_version(n)) == "gpu"
        for ids in names.values()
        for n in ids
    )
    order = list(plans)
    out: dict[str, list[float]] = {}
    for turn in range(WARMUP_TURNS + repeats):
        k = turn % len(order)
        times = {}
        for mix in order[k:] + order[:k]:
            times[mix] = await loop.run_in_executor(engine.debug.step_loop.forward, timed, capture.execute, plans[mix])
        if turn >= WARMUP_TURNS:
            out.setdefault("base_step_s", []).append(times["base"])
            for mix in order[1:]:
                out.setdefault(mix, []).append(times[mix] / times["base"])
    return out


def timed(execute: Any, plan: StepPlan) -> float:
    start = time.perf_counter()
    execute(plan)
    return time.perf_counter() - start


def ranks_of(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    return [order.index(i) for i in range(len(values))]


def report(engine_costs: dict, rates: dict[str, float], stream: float, repeats: int) -> dict:
    """``rates``: the base's step seconds, and each mix's overhead over it (medians)."""
    step_s = rates["base_step_s"]
    print(
        f"one decode step of {BATCH} rows, on {torch.get_num_threads()} CPU threads: median over {repeats} turns "
        "of (step / base step of the same turn) - 1"
    )
    print(f"base: {step_s * 1e3:.0f} ms per decode step; memory streams at {stream / 1e9:.1f} GB/s")
    head = (
        f"{'shape':<15}{'adapter MB':>11}{'projected':>11}{'measured':>10}{'meas/proj':>10}"
        f"{'this CPU':>10}{'proj. 1':>9}{'meas. 1':>9}"
    )
    print(f"{'':<15}{'':>11}{'-- 32 rows on 32 distinct adapters --':>41}{'-- on one --':>18}")
    print(head)
    rows = {}
    for shape, cost in engine_costs.items():
        distinct, one = rates[f"{shape}|distinct"], rates[f"{shape}|one"]
        projected = cost.bytes_pct_at(BATCH) / 100
        this_cpu = BATCH * cost.adapter_bytes / stream / step_s
        rows[shape] = {
            "adapter_bytes": cost.adapter_bytes,
            "projected_pct": 100 * projected,
            "measured_pct": 100 * distinct,
            "measured_over_projected": distinct / projected,
            "this_cpu_pct": 100 * this_cpu,
            "projected_one_pct": cost.bytes_pct_at(1),
            "measured_one_pct": 100 * one,
        }
        print(
            f"{shape:<15}{cost.adapter_bytes / 1e6:>11.1f}{100 * projected:>10.1f}%{100 * distinct:>9.1f}%"
            f"{distinct / projected:>10.2f}{100 * this_cpu:>9.1f}%{cost.bytes_pct_at(1):>8.1f}%{100 * one:>8.1f}%"
        )
    projected = [r["projected_pct"] for r in rows.values()]
    measured = [r["measured_pct"] for r in rows.values()]
    agree = ranks_of(projected) == ranks_of(measured)
    ratios = [r["measured_over_projected"] for r in rows.values()]
    print(
        f"ranking agrees: {'yes' if agree else 'no'} (target: yes); measured / projected "
        f"{min(ratios):.2f}-{max(ratios):.2f} (the design's projection assumes a memory-bound base step)"
    )
    # This CPU's calibration: measured = fixed + slope x projected over every mix (distinct and one).
    xs = [r[k] for r in rows.values() for k in ("projected_pct", "projected_one_pct")]
    ys = [r[k] for r in rows.values() for k in ("measured_pct", "measured_one_pct")]
    slope, fixed = statistics.linear_regression(xs, ys)
    worst = max(abs(y - (fixed + slope * x)) for x, y in zip(xs, ys))
    print(
        f"calibrated for this CPU: measured = {fixed:.1f}% + {slope:.3f} x projected (the LoRA path's fixed "
        f"cost per step, then bytes); worst residual {worst:.1f} points over the 8 mixes"
    )
    return {
        "bench": "cost",
        "batch": BATCH,
        "base_step_s": step_s,
        "stream_bytes_per_s": stream,
        "shapes": rows,
        "ranking_agrees": agree,
        "measured_over_projected": {"min": min(ratios), "max": max(ratios)},
        "calibration": {"fixed_pct": fixed, "slope": slope, "worst_residual_points": worst},
        "repeats": repeats,
        "targets": {"ranking_agrees": True},
    }


async def main(repeats: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="lorapage-bench-cost-") as tmp:
        root = Path(tmp)
        model = write_model(root / "base", **SHAPE)
        dirs = {
            shape: write_adapter(root / shape.replace(" ", "-"), model, rank=rank, seed=i, targets=modules)
            for i, (shape, (rank, modules)) in enumerate(SHAPES.items())
        }
        engine, names = make_engine(model, dirs)
        costs = {shape: engine.admin.info(ids[0]).cost for shape, ids in names.items()}
        samples = await measure(engine, names, repeats)
        await engine.close()
    rates = {k: median(v) - (k != "base_step_s") for k, v in samples.items()}
    return report(costs, rates, stream_bandwidth(BATCH * costs["all r16"].adapter_bytes), repeats)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 turns per shape: a smoke run")
    ap.add_argument("--repeats", type=int, default=60, help="timed turns (each runs every mix's step once)")
    args = ap.parse_args()
    print(machine_line())
    print_json(asyncio.run(main(5 if args.quick else args.repeats)) | machine_info(), default=float)
