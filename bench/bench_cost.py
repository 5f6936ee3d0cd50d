"""The adapter cost model against this CPU: projected vs measured decode overhead, by shape.

The projection (``lorapage.adapters.cost``, the design's arithmetic) is the extra bytes a decode
step reads, in % of the base's: each distinct adapter in the batch is read once per step, the base
once for everyone, so ``D`` distinct adapters of ``W_a`` bytes cost ``100 * D * W_a / W_base``. It
is measured as the design defines it: one decode batch of 32 rows, every row on its own adapter
(32 ids registered on the shape's files, each resident in its own pages), against the same 32
requests on the base; and, beside it, the 32 rows on one adapter of the shape (``D = 1``).
Measured overhead = base tokens/s / adapter tokens/s - 1 (extra step time), the median of
``--rounds`` passes taken in turn.

Shapes: attention-only rank 8 and 16, all modules rank 16 and 64, on the ~100M bench model
(``make_llama``: hidden 768, 12 layers, MLP 2,048, vocab 32,000, fp32). The ranking of projected
and measured must agree. A second projection for this machine is printed too: the distinct
adapters' bytes read at the bandwidth a ``sum`` streams here, over the measured base step. The
design's projection assumes a memory-bound base step, which a GPU decode step is; on this CPU the
base step is compute-bound, so it overstates the overhead (the ratio is printed).

    python bench/bench_cost.py [--quick] [--rounds N] [--tokens N]

Prints a table, then one JSON line with every figure and its target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import decode_rate, stream_bandwidth  # noqa: E402
from make_llama import MODULES, write_adapter, write_model  # noqa: E402

from lorapage import Engine, EngineConfig  # noqa: E402

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


def make_engine(model: Path, dirs: dict[str, Path]) -> tuple[Engine, dict[str, list[str]]]:
    """One engine with ``BATCH`` ids per shape, each id a distinct adapter over the shape's files."""
    engine = Engine(
        EngineConfig(
            model=str(model),
            max_loras=BATCH,
            max_lora_rank=64,
            shared_envelope="all:64",  # the bench costs shapes outside the default envelope on purpose
            max_cpu_loras=BATCH,
            max_num_seqs=BATCH,
            max_model_len=128,
            scheduler="fcfs",
            enable_prefix_caching=False,  # every pass reuses its prompts
        )
    )
    names: dict[str, list[str]] = {}
    for shape, path in dirs.items():
        checked = engine.catalog.prepare(path, sha256=None, expected_base_digest=None)
        tag = shape.replace(" ", "-")
        names[shape] = [f"{tag}-{i}" for i in range(BATCH)]
        for name in names[shape]:
            engine.catalog.register_prepared(name, path, checked)
    return engine, names


async def measure(engine: Engine, names: dict[str, list[str]], rounds: int, tokens: int) -> dict[str, list[float]]:
    """Decode tokens/s per mix, ``rounds`` passes each, the mixes in turn within a round."""
    samples: dict[str, list[float]] = {}
    await decode_rate(engine, [None] * 4, PROMPT_LEN, 3)  # warm-up
    for _ in range(rounds):
        samples.setdefault("base", []).append(await decode_rate(engine, [None] * BATCH, PROMPT_LEN, tokens))
        for shape, ids in names.items():
            await asyncio.gather(*(engine.load_adapter(n) for n in ids))  # evicts the previous shape's
            samples.setdefault(f"{shape}|distinct", []).append(await decode_rate(engine, ids, PROMPT_LEN, tokens))
            one = [ids[0]] * BATCH
            samples.setdefault(f"{shape}|one", []).append(await decode_rate(engine, one, PROMPT_LEN, tokens))
    return samples


def ranks_of(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    return [order.index(i) for i in range(len(values))]


def report(engine_costs: dict, rates: dict[str, float], stream: float, rounds: int) -> dict:
    base = rates["base"]
    step_s = BATCH / base
    print(f"decode, {BATCH} rows, on {torch.get_num_threads()} CPU threads; medians of {rounds} rounds")
    print(f"base: {base:.1f} tokens/s ({step_s * 1e3:.0f} ms per step); memory streams at {stream / 1e9:.1f} GB/s")
    head = (
        f"{'shape':<15}{'adapter MB':>11}{'projected':>11}{'measured':>10}{'meas/proj':>10}"
        f"{'this CPU':>10}{'proj. 1':>9}{'meas. 1':>9}"
    )
    print(f"{'':<15}{'':>11}{'-- 32 rows on 32 distinct adapters --':>41}{'-- on one --':>18}")
    print(head)
    rows = {}
    for shape, cost in engine_costs.items():
        distinct = base / rates[f"{shape}|distinct"] - 1
        one = base / rates[f"{shape}|one"] - 1
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
    return {
        "bench": "cost",
        "batch": BATCH,
        "base_tokens_per_s": base,
        "stream_bytes_per_s": stream,
        "shapes": rows,
        "ranking_agrees": agree,
        "measured_over_projected": {"min": min(ratios), "max": max(ratios)},
        "rounds": rounds,
        "targets": {"ranking_agrees": True},
    }


async def main(rounds: int, tokens: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="lorapage-bench-cost-") as tmp:
        root = Path(tmp)
        model = write_model(root / "base", **SHAPE)
        dirs = {
            shape: write_adapter(root / shape.replace(" ", "-"), model, rank=rank, seed=i, targets=modules)
            for i, (shape, (rank, modules)) in enumerate(SHAPES.items())
        }
        engine, names = make_engine(model, dirs)
        costs = {shape: engine.adapter_info(ids[0]).cost for shape, ids in names.items()}
        samples = await measure(engine, names, rounds, tokens)
        await engine.close()
    rates = {key: statistics.median(v) for key, v in samples.items()}
    summary = report(costs, rates, stream_bandwidth(BATCH * costs["all r16"].adapter_bytes), rounds)
    return summary | {"tokens_per_s": rates}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds of 6 tokens: a smoke run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=12, help="tokens each request decodes per pass")
    args = ap.parse_args()
    rounds, tokens = (2, 6) if args.quick else (args.rounds, args.tokens)
    print(json.dumps(asyncio.run(main(rounds, tokens)), default=float))
