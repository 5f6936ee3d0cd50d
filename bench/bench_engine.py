"""Engine throughput with heterogeneous adapters, and the cost of making an adapter resident.

On a generated Llama-shaped model of about 100M parameters (fp32, CPU by default), decode
tokens/s at batch 32 for:
  (a) base only, (b) 32 rows on one adapter, (c) 32 rows on 32 distinct adapters (rank 16, all
  modules), (d) the same 32 requests served one adapter per batch.
Then the time to make a rank-16 all-module adapter resident (file -> host RAM -> pool, and host
RAM -> pool alone) with 1 and with 200 other adapters registered and resident, against a raw
``copy_`` of the same bytes.

    python bench/bench_engine.py [--quick]

Prints a table, then one JSON line with every figure and its target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from make_llama import write_adapter, write_model  # noqa: E402

from lorapage import Engine, EngineConfig, SamplingParams  # noqa: E402

BATCH = 32


async def decode_rate(engine: Engine, rows: list[str | None], prompt_len: int, new_tokens: int) -> float:
    """Decode tokens/s of ``rows`` run together: tokens after each row's first, over that span."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    firsts, lasts = [], []

    async def one(i: int, adapter: str | None) -> None:
        prompt = [(7 * i + j) % 200 + 3 for j in range(prompt_len)]
        async for out in engine.generate(prompt, adapter, params):
            if len(out.token_ids) == 1:
                firsts.append(time.perf_counter())
        lasts.append(time.perf_counter())

    await asyncio.gather(*(one(i, a) for i, a in enumerate(rows)))
    return len(rows) * (new_tokens - 1) / (max(lasts) - max(firsts))


async def one_adapter_per_batch(engine: Engine, rows: list[str], prompt_len: int, new_tokens: int) -> float:
    """Each adapter's requests as a batch of their own, one batch after another."""
    spans = []
    for adapter in dict.fromkeys(rows):
        group = [a for a in rows if a == adapter]
        rate = await decode_rate(engine, group, prompt_len, new_tokens)
        spans.append(len(group) * (new_tokens - 1) / rate)
    return len(rows) * (new_tokens - 1) / sum(spans)


async def residency(engine: Engine, name: str, repeats: int) -> dict:
    """Median ms for file -> pool and host RAM -> pool of ``name``, and a raw copy of its bytes."""
    cache = engine.adapters
    full, from_ram = [], []
    for _ in range(repeats):
        await engine.unload_adapter(name)
        cache._host.pop(name, None)  # force the file read
        t = time.perf_counter()
        await engine.load_adapter(name)
        full.append(time.perf_counter() - t)
        await engine.unload_adapter(name)
        t = time.perf_counter()
        await engine.load_adapter(name)  # host-RAM copy is kept
        from_ram.append(time.perf_counter() - t)
    packed = cache._host[name]
    entry = cache.get(name)
    dst = torch.empty_like(packed)
    raw, copy_in = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(packed)
        raw.append(time.perf_counter() - t)
        t = time.perf_counter()
        cache._copy_in(entry, packed, entry.slot, entry.pages)  # rewrites its own pages: harmless
        copy_in.append(time.perf_counter() - t)
    ms = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
    return {"file_to_pool_ms": ms(full), "ram_to_pool_ms": ms(from_ram), "page_copy_ms": ms(copy_in),
            "raw_copy_ms": ms(raw), "bytes": packed.numel() * packed.element_size()}


async def main(quick: bool) -> dict:
    root = Path(tempfile.mkdtemp(prefix="lorapage-bench-"))
    shape = dict(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=32000)
    model = write_model(root / "base", **shape)
    n_params = sum(t.numel() for t in load_file(model / "model.safetensors").values())
    n_extra = 20 if quick else 200
    adapters = [write_adapter(root / f"a{i}", model, rank=16, seed=i) for i in range(BATCH + n_extra + 1)]
    prompt_len, new_tokens = 16, 8 if quick else 16
    cfg = EngineConfig(model=str(model), max_loras=BATCH + 2, max_lora_rank=16, max_cpu_loras=BATCH + 2,
                       max_num_seqs=BATCH, max_model_len=256, scheduler="fcfs")
    engine = Engine(cfg)
    names = [f"a{i}" for i in range(BATCH)]
    for n, path in zip(names, adapters):
        engine.add_adapter(n, path)
    for n in names:
        await engine.load_adapter(n)
    await decode_rate(engine, [None] * 4, prompt_len, 3)  # warm-up
    rates = {
        "a_base": await decode_rate(engine, [None] * BATCH, prompt_len, new_tokens),
        "b_one_adapter": await decode_rate(engine, [names[0]] * BATCH, prompt_len, new_tokens),
        "c_distinct": await decode_rate(engine, names, prompt_len, new_tokens),
        "d_one_adapter_per_batch": await one_adapter_per_batch(engine, names, prompt_len, new_tokens),
    }
    probe_pages = engine.adapter_info(names[0]).num_pages
    per_adapter = engine.adapter_info(names[0]).size_bytes
    await engine.close()

    # Residency with 1 and with n_extra other adapters resident.
    pages = 1 + (n_extra + 2) * probe_pages + 64
    res = {}
    for others in (1, n_extra):
        eng = Engine(EngineConfig(model=str(model), max_loras=others + 2, max_lora_rank=16,
                                  max_cpu_loras=others + 2, max_num_seqs=4, max_model_len=256, num_pages=pages))
        for i in range(others):
            eng.add_adapter(f"o{i}", adapters[BATCH + i])
        await asyncio.gather(*(eng.load_adapter(f"o{i}") for i in range(others)))
        eng.add_adapter("probe", adapters[-1])
        res[others] = await residency(eng, "probe", 3 if quick else 7)
        assert len(eng.stats()["resident_adapters"]) == others + 1
        await eng.close()
    return {"n_params": n_params, "adapter_bytes": per_adapter, "rates": rates, "residency": res, "n_extra": n_extra}


def report(r: dict) -> dict:
    a, b, c, d = (r["rates"][k] for k in ("a_base", "b_one_adapter", "c_distinct", "d_one_adapter_per_batch"))
    one, many = r["residency"][1], r["residency"][r["n_extra"]]
    print(f"model: {r['n_params'] / 1e6:.0f}M params fp32 on {torch.get_num_threads()} CPU threads; "
          f"adapter rank 16 all modules = {r['adapter_bytes'] / 1e6:.1f} MB")
    print(f"{'decode at batch 32':<44}{'tokens/s':>10}")
    for label, v in (("(a) base only", a), ("(b) 32 rows, one adapter", b), ("(c) 32 rows, 32 distinct adapters", c),
                     ("(d) same 32 requests, one adapter per batch", d)):
        print(f"  {label:<42}{v:>10.1f}")
    print(f"  c/a = {c / a:.2f}   c/b = {c / b:.2f} (target >= 0.8)   c/d = {c / d:.1f} (target >= 8)")
    print(f"{'make a rank-16 adapter resident':<44}{'1 other':>10}{str(r['n_extra']) + ' others':>14}")
    for key, label in (("file_to_pool_ms", "file -> host RAM -> pool (ms)"), ("ram_to_pool_ms", "host RAM -> pool (ms)"),
                       ("page_copy_ms", "  of which page copy + table rows (ms)"),
                       ("raw_copy_ms", "raw copy_ of the same bytes (ms)")):
        print(f"  {label:<42}{one[key]:>10.2f}{many[key]:>14.2f}")
    ram_vs_copy = many["ram_to_pool_ms"] / many["raw_copy_ms"]
    growth = many["ram_to_pool_ms"] / one["ram_to_pool_ms"]
    print(f"  host RAM -> pool / raw copy = {ram_vs_copy:.2f} (target <= 2)   "
          f"{r['n_extra']} vs 1 resident = {growth:.2f} (target: no growth)")
    return {
        "bench": "engine", "n_params": r["n_params"], "tokens_per_s": r["rates"],
        "c_over_a": c / a, "c_over_b": c / b, "c_over_d": c / d,
        "residency_ms": {str(k): v for k, v in r["residency"].items()},
        "ram_to_pool_over_raw_copy": ram_vs_copy, "residency_growth": growth,
        "targets": {"c_over_b": ">=0.8", "c_over_d": ">=8", "ram_to_pool_over_raw_copy": "<=2",
                    "residency_growth": "~1 (no growth)"},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer tokens and 20 resident adapters (smoke run)")
    args = parser.parse_args()
    summary = report(asyncio.run(main(args.quick)))
    print(json.dumps(summary))
