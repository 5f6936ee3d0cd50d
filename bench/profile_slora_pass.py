"""Where one pass of the S-LoRA headline spends its time: the forward, the LoRA ops, the steps'
shapes, and every adapter load by stage.

Runs one pass of `bench_replay.py`'s S-LoRA trace (192 requests, 32 in flight) per configuration
given, each on a fresh engine, with timers wrapped around the engine's own methods (nothing is
replaced: the pass is the benchmark's). Use it to see why the 2,000-adapter pass is slower than
the 5-adapter one; the headline ratio itself is `bench_replay.py --only slora`'s.

    python bench/profile_slora_pass.py [--cases 5,2000] [--warm-host]

``--warm-host`` reads every adapter of the trace into host RAM before the pass (S-LoRA's own
setting: all adapters in host memory), so only copies into the pool remain of its loads.
The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import workloads
from harness import machine_info, machine_line, print_json, table as harness_table

from lorapage.adapters import (
    cache as cache_mod,
    layout as layout_mod,
    loader as loader_mod,
)
from lorapage.adapters.prefetch import PREFETCH_QUEUE_LEN
from lorapage.config import LORA_DTYPE_NAMES
from lorapage.model import (
    forward as forward_mod,
    llama as llama_mod,
    runner as runner_mod,
)


class Timers:
    """Seconds (wall or this thread's CPU) per key, from methods wrapped in place."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self.steps: list[tuple[int, int, int, int, float]] = []  # decode rows, prefills, prefill tokens, slots, s
        self.loads: list[float] = []

    def wrap(self, owner: Any, name: str, key: str, clock: Callable[[], float] = time.perf_counter) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[key] += clock() - start

        setattr(owner, name, timed)

    def wrap_execute(self) -> None:
        inner = runner_mod.ModelRunner.execute

        def execute(runner: Any, plan: Any) -> Any:
            start = time.perf_counter()
            out = inner(runner, plan)
            prefills = len(plan.sequences) - plan.num_decode
            tokens = len(plan.input_ids) - plan.num_decode
            slots = len(set(plan.token_slot))
            self.steps.append((plan.num_decode, prefills, tokens, slots, time.perf_counter() - start))
            return out

        runner_mod.ModelRunner.execute = execute  # type: ignore[method-assign]

    def wrap_load(self) -> None:
        inner = cache_mod.AdapterCache._copy

        async def load(cache: Any, *args: Any) -> None:
            start = time.perf_counter()
            await inner(cache, *args)
            self.loads.append(time.perf_counter() - start)

        cache_mod.AdapterCache._copy = load  # type: ignore[method-assign]


def install(t: Timers) -> None:
    t.wrap(forward_mod.ForwardContext, "forward", "forward")
    t.wrap(llama_mod.LlamaModel, "_lora", "lora")
    t.wrap_execute()
    t.wrap_load()
    cpu = time.thread_time
    t.wrap(loader_mod, "read_weights_stamped", "load: read", cpu)
    t.wrap(loader_mod, "bytes_digest", "load: sha256", cpu)
    t.wrap(loader_mod, "load_adapter_tensors", "load: parse", cpu)
    t.wrap(layout_mod.AdapterLayout, "join", "load: pack", cpu)  # the full path's and a recipe's copy
    t.wrap(loader_mod.AdapterLoader, "write_pages", "load: copy in", cpu)


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else 0.0


async def one_pass(case: int, warm_host: bool, root: Path, t: Timers, lora_dtype: str = "auto") -> dict:
    model, dirs = root / "base", [root / f"d{i}" for i in range(workloads.ADAPTER_DIRS)]
    small, big = workloads.slora_traces(192)
    trace = small if case == 5 else big
    engine, _ = workloads.engine_for(model, dirs, [f"a{k:04d}" for k in range(case)], lora_dtype=lora_dtype)
    if warm_host:  # the cache's own prefetches, a queue's worth at a time, until every one is in host RAM
        cache = engine.debug.adapters
        keys = [engine.admin.catalog.resolve_version(name) for name in dict.fromkeys(r.model for r in trace)]
        for i in range(0, len(keys), PREFETCH_QUEUE_LEN):
            cache.prewarm(keys[i : i + PREFETCH_QUEUE_LEN])
            while cache._prefetches:
                await asyncio.sleep(0.01)
        assert all(key in cache._host for key in keys), "the host LRU holds fewer than the trace's adapters"
    for part in (t.seconds, t.steps, t.loads):
        part.clear()
    cpu, wall = time.process_time(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lorapage-profile-") as out:
        report = await workloads.run(engine, trace, workloads.SLORA_OPTIONS, Path(out), f"c{case}")
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    recipes = engine.debug.adapters.loader.recipes.hits  # loads packed as byte runs (pack_recipe.py)
    decode = [s for s in t.steps if s[1] == 0]
    mixed = [s for s in t.steps if s[1] > 0]
    loads = len(t.loads)
    return {
        "case": case,
        "tokens_per_s": report["throughput"]["output_tokens_per_s"],
        "wall_s": wall,
        "process_cpu_s": cpu,
        "forward_s": t.seconds["forward"],
        "lora_s": t.seconds["lora"],
        "steps": len(t.steps),
        "decode_steps": len(decode),
        "decode_rows_mean": statistics.mean(s[0] for s in decode) if decode else 0.0,
        "decode_step_ms": 1e3 * statistics.mean(s[4] for s in decode) if decode else 0.0,
        "prefill_steps": len(mixed),
        "prefill_seqs_mean": statistics.mean(s[1] for s in mixed) if mixed else 0.0,
        "prefill_step_ms": 1e3 * statistics.mean(s[4] for s in mixed) if mixed else 0.0,
        "distinct_slots_per_step": statistics.mean(s[3] for s in t.steps) if t.steps else 0.0,
        "loads": loads,
        "recipe_packs": recipes,
        "load_wall_p50_ms": 1e3 * pct(t.loads, 0.5),
        "load_wall_p90_ms": 1e3 * pct(t.loads, 0.9),
        **{
            f"{k.removeprefix('load: ').replace(' ', '_')}_cpu_ms_per_load": 1e3 * v / max(1, loads)
            for k, v in t.seconds.items()
            if k.startswith("load: ")
        },
    }


def table(title: str, headers: list[str], rows: list[dict], cells: Callable[[dict], list[str]]) -> None:
    """A markdown table of ``rows``, one per pass, led by its adapter count."""
    print(f"\n{title}")
    body = [[f"{r['case']:,}", *cells(r)] for r in rows]
    print(harness_table(["adapters", *headers], body, "r" * (len(headers) + 1)))


async def main(args: argparse.Namespace) -> dict:
    t = Timers()
    install(t)
    rows = []
    with tempfile.TemporaryDirectory(prefix="lorapage-bench-model-") as tmp:
        workloads.make_assets(Path(tmp))
        for case in (int(c) for c in args.cases.split(",")):
            rows.append(await one_pass(case, args.warm_host, Path(tmp), t, args.lora_dtype))
    cols = [
        ("tok/s", "tokens_per_s", 1),
        ("wall s", "wall_s", 1),
        ("CPU s", "process_cpu_s", 1),
        ("forward s", "forward_s", 2),
        ("LoRA s", "lora_s", 2),
        ("steps", "steps", 0),
        ("decode ms", "decode_step_ms", 0),
        ("prefill steps", "prefill_steps", 0),
        ("prefills/step", "prefill_seqs_mean", 1),
        ("slots/step", "distinct_slots_per_step", 1),
        ("loads", "loads", 0),
        ("by recipe", "recipe_packs", 0),
        ("load p50 ms", "load_wall_p50_ms", 0),
    ]
    print(machine_line())
    title = f"One pass per configuration{' (adapters warm in host RAM)' if args.warm_host else ''}"
    table(title, [c for c, _, _ in cols], rows, lambda r: [f"{r[k]:.{d}f}" for _, k, d in cols])
    stages = ["read", "sha256", "parse", "pack", "copy_in"]
    table(
        "CPU per load by stage (ms, the thread's own time)",
        stages,
        rows,
        lambda r: [f"{r.get(f'{s}_cpu_ms_per_load', 0.0):.1f}" for s in stages],
    )
    figures: dict = {
        "bench": "profile_slora_pass",
        "warm_host": args.warm_host,
        "lora_dtype": args.lora_dtype,
        "passes": rows,
        **machine_info(),
    }
    if len(rows) == 2 and rows[0]["tokens_per_s"]:
        figures["ratio"] = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
        print(f"\n{rows[1]['case']:,} / {rows[0]['case']:,} throughput, this one pass: {figures['ratio']:.3f}")
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="5,2000", help="registered adapters of each pass, in order")
    parser.add_argument("--warm-host", action="store_true", help="every trace adapter in host RAM before the pass")
    parser.add_argument("--lora-dtype", default="auto", choices=LORA_DTYPE_NAMES, help="the engines' lora_dtype")
    print_json(asyncio.run(main(parser.parse_args())))
