"""Tensor parallelism on this CPU: TP=1 against TP=2 (gloo) on one Llama-shaped model (hidden 512,
4 layers, 8 heads / 4 KV heads, intermediate 1,536, float32) with 8 rank-16 all-module adapters.

Per round and configuration: one engine, 16 requests (two per adapter) of 16 prompt tokens, 32
greedy tokens each, all submitted at once; the figure is the wall time per decode step (the
batch's time over its steps, prefill included) and the tokens/s. Also printed: the base's bytes
per rank (projections split, the embedding and lm_head vocabulary-parallel, norms whole), the
pool's page and total bytes per rank (2,048 pages, each holding a KV block of the rank's KV heads),
the pages (and bytes) one adapter takes on each rank (fully sharded: 1/k of every matrix, in pages
1/k as wide) and how many such adapters the pool holds. Rounds alternate the order
(harness.interleaved); medians are reported. Greedy tokens are checked equal between the two.

On a 2-core machine TP=2 cannot be faster: both ranks share the same two cores that TP=1's one
forward uses, and every layer adds its collectives over loopback (two all-reduces of the hidden
states; with adapters in the step, two all-gathers and two all-reduces of LoRA shrinks; the step's
logits gathered to rank 0). What it shows is the overhead of the collectives and the per-step plan,
and the per-rank memory, which is what TP buys.

    python bench/bench_tp.py [--rounds N] [--tokens N] [--device cpu|cuda]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch
from harness import interleaved, machine_line, median, print_json, table
from make_llama import write_adapter, write_model

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.model.config import ModelConfig
from lorapage.model.loader import load_state_dict
from lorapage.parallel.shards import shard_base

ADAPTERS, REQUESTS, PROMPT, PAGES = 8, 16, 16, 2048


def run(model: Path, adapters: list[Path], tp: int, tokens: int, device: str) -> dict:
    config = EngineConfig(
        model=str(model), tensor_parallel_size=tp, max_lora_rank=16, num_pages=PAGES, device=device, enforce_eager=True
    )
    engine = Engine(config)
    for i, path in enumerate(adapters):
        engine.add_adapter(f"a{i}", str(path))
    rows = [([(7 * r + j) % 4000 + 1 for j in range(PROMPT)], f"a{r % ADAPTERS}") for r in range(REQUESTS)]
    sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.generate_batch(rows[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # loads, warm-up
    started = time.perf_counter()
    outs = engine.generate_batch(rows, sampling)
    seconds = time.perf_counter() - started
    sizing = engine._sizing
    out = {
        "step_ms": 1e3 * seconds / tokens,
        "tokens_per_s": REQUESTS * tokens / seconds,
        "page_bytes": sizing.page_size * 4 * sizing.shard_model.num_layers,
        "adapter_pages": engine.admin.info("a0").num_pages,
        "tokens": [o.token_ids for o in outs],
    }
    asyncio.run(engine.close())
    return out


def base_bytes(model: Path, tp: int) -> int:
    """Bytes of rank 0's shard of the base (float32)."""
    state = shard_base(load_state_dict(model, torch.float32), 0, tp, ModelConfig.from_dir(model))
    return sum(t.numel() * t.element_size() for t in state.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--device", default="cpu", help="cpu (gloo), or cuda: ranks on cuda:0 and cuda:1 (NCCL)")
    args = p.parse_args()
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_model(root / "base", hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1536, vocab=4096)
        adapters = [write_adapter(root / f"a{i}", model, rank=16, seed=i) for i in range(ADAPTERS)]
        base_mib = {tp: base_bytes(model, tp) / 2**20 for tp in (1, 2)}
        results: dict[int, list[dict]] = {1: [], 2: []}
        for _, tp in interleaved(args.rounds, [1, 2]):
            results[tp].append(run(model, adapters, tp, args.tokens, args.device))
    same = all(r["tokens"] == results[1][0]["tokens"] for r in results[1] + results[2])
    summary = {}
    rows = []
    for tp, rs in results.items():
        step = median(r["step_ms"] for r in rs)
        rate = median(r["tokens_per_s"] for r in rs)
        page, pages, base = rs[0]["page_bytes"], rs[0]["adapter_pages"], base_mib[tp]
        pool_mib = PAGES * page / 2**20
        rows.append(
            [tp, f"{step:.1f}", f"{rate:.0f}", f"{base:.1f}", f"{page:,}", f"{pool_mib:.0f}", pages,
             f"{pages * page / 1024:.0f}", PAGES // pages]
        )  # fmt: skip
        summary[f"tp{tp}"] = {
            "step_ms": step,
            "tokens_per_s": rate,
            "base_mib_per_rank": base,
            "page_bytes": page,
            "pool_mib_per_rank": pool_mib,
            "adapter_pages": pages,
            "adapter_kib_per_rank": pages * page / 1024,
        }
    header = [
        "TP",
        "step ms",
        "tokens/s",
        "base MiB / rank",
        "page bytes / rank",
        "pool MiB / rank",
        "adapter pages / rank",
        "adapter KiB / rank",
        "adapters the pool holds",
    ]
    print(table(header, rows, "rrrrrrrrr"))
    print(f"greedy tokens identical across TP=1 and TP=2 and rounds: {same}")
    print_json(
        {
            "bench": "tp",
            "device": args.device,
            "rounds": args.rounds,
            "tokens": args.tokens,
            "tokens_identical": same,
            **summary,
        }
    )


if __name__ == "__main__":
    main()
