"""Workloads several benchmarks measure with: request prompts and the decode rate of rows run
together (bench_engine, bench_cost, the peer benches), the bandwidth a step's adapter reads are
held against, and the replay benchmarks' ~100M model with the S-LoRA headline's traces
(bench_replay, bench_ab, bench_lora_cpu_pages, profile_slora_pass).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from make_llama import write_adapter, write_model
from msgspec.structs import replace as with_fields

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.heap import gc_heap_frozen
from lorapage.replay import GenConfig, RunOptions, TraceRequest, generate, replay
from lorapage.replay.embedded import EmbeddedTarget
from lorapage.replay.report import build_report, write_report
from lorapage.traces.stats import Slo


def prompt(i: int, prompt_len: int) -> list[int]:
    """Request ``i``'s prompt: the same request index gives the same prompt in every mode."""
    return [(7 * i + j) % 200 + 3 for j in range(prompt_len)]


async def decode_rate(
    engine: Engine, rows: Sequence[str | None], prompt_len: int, new_tokens: int, ids: list[int] | None = None
) -> float:
    """Decode tokens/s of ``rows`` run together: tokens after each row's first, over that span.

    Row ``k`` runs request ``ids[k]``'s prompt (request ``k``'s when ``ids`` is not given).
    """
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = list(range(len(rows))) if ids is None else ids
    firsts, lasts = [], []

    async def one(i: int, adapter: str | None) -> None:
        async for out in engine.generate(prompt(i, prompt_len), adapter, params):
            if len(out.token_ids) == 1:
                firsts.append(time.perf_counter())
        lasts.append(time.perf_counter())

    await asyncio.gather(*(one(i, a) for i, a in zip(ids, rows)))
    return len(rows) * (new_tokens - 1) / (max(lasts) - max(firsts))


def stream_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes per second this machine streams from memory now, on the bench's threads: the fastest
    of ``repeats`` sums over ``nbytes`` of fp32 (what reading the distinct adapters of one decode
    step at least costs)."""
    buf = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


# -- the replay benchmarks' model and the S-LoRA headline ---------------------------------------

SHAPE = dict(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=32000)
ADAPTER_DIRS = 5
SHORT = dict(prompt_mean=32, prompt_sigma=0.3, prompt_max=64, output_mean=16, output_sigma=0.0, output_max=16)


SLORA_ADAPTERS = 2000
SLORA_OPTIONS = RunOptions(concurrency=32, probe_interval_s=0.5)  # closed loop, 32 in flight


def slora_traces(n: int) -> tuple[list[TraceRequest], list[TraceRequest]]:
    """The S-LoRA headline's ``n`` requests over 5 and over 2,000 adapters (names a0000...):
    Zipf(1.0) over 2,000, and the same requests (arrivals, lengths, tenants) with adapter k
    as k mod 5."""
    base = GenConfig(
        seed=11, num_requests=n, duration_s=None, adapters=SLORA_ADAPTERS, zipf_alpha=1.0, tenants=8, **SHORT
    )
    big = generate(replace(base, shared_fraction=0.0))
    width = len(str(SLORA_ADAPTERS - 1))
    small = [with_fields(r, model=f"a{int(r.model[1:]) % 5:0{width}d}") for r in big]
    return small, big


def make_assets(root: Path) -> tuple[Path, list[Path]]:
    model = write_model(root / "base", **SHAPE)
    dirs = [write_adapter(root / f"d{i}", model, rank=16, seed=i) for i in range(ADAPTER_DIRS)]
    return model, dirs


def engine_for(model: Path, dirs: list[Path], names: list[str], **config) -> tuple[Engine, float]:
    """An engine with ``names`` registered on ``dirs`` in turn; returns it and the seconds registration took."""
    cfg = dict(max_loras=32, max_lora_rank=16, max_num_seqs=32, max_model_len=256, max_cpu_loras=128)
    cfg = {**cfg, **config}
    # As many lora slots as one batch's distinct adapters: what max_loras meant when the history in
    # bench/RESULTS.md was measured (the S-LoRA headline's 2,000 adapters cycle through 16 slots).
    cfg.setdefault("max_resident_loras", cfg["max_loras"])
    engine = Engine(EngineConfig(model=str(model), **cfg))
    start = time.perf_counter()
    # Each directory is read and checked once, as add_adapter would for every name; the names
    # are then registered on the checked result, each a distinct adapter of its own.
    checked = [engine.admin.catalog.preparer.check(d) for d in dirs]
    for k, name in enumerate(names):
        engine.admin.catalog.add(name, dirs[k % len(dirs)], checked=checked[k % len(dirs)])
    return engine, time.perf_counter() - start


async def run(engine: Engine, trace: list[TraceRequest], opts: RunOptions, out: Path, label: str, weights=None) -> dict:
    """Warm the engine up on the base, replay ``trace`` with the heap frozen as ``lorapage replay
    run --embedded`` does (lorapage/heap.py), write its report under ``out/label``."""
    warm = [TraceRequest(arrival_s=0.0, tenant="warmup", model="base", max_tokens=4, prompt_len=16)] * 4
    await replay(warm, EmbeddedTarget(engine), RunOptions(concurrency=4, probe_interval_s=None))
    with gc_heap_frozen():
        result = await replay(trace, EmbeddedTarget(engine), opts)
    meta = {"trace": label, "target": EmbeddedTarget(engine).describe()}
    report = build_report(trace, result, meta=meta, slo=Slo(), weights=weights)
    write_report(out / label, result.records, report)
    await engine.close()
    return report
