"""Engine throughput with heterogeneous adapters, and the cost of making an adapter resident.

On a generated Llama-shaped model of about 100M parameters (fp32, CPU by default), decode
tokens/s of 32 requests (one batch of 32 unless said otherwise) for:
  (a) base only, (b) 32 rows on one adapter, (c) 32 rows on 32 distinct adapters (rank 16, all
  modules), (d) the baseline without multi-LoRA batching (PEFT's ``set_adapter``, vLLM before
  multi-LoRA): the same (prompt, adapter) requests as (c), grouped by adapter and run one batch per
  distinct adapter, one after another, each batch holding all of that adapter's requests. (c) has 32
  distinct adapters, so (d) is 32 batches of one; the table and the JSON give the batch sizes.
  (e) 32 rows over 8 adapters with a fixed Zipf-like skew (12, 7, 4, 3, 2, 2, 1, 1 requests),
  interleaved in one batch, and (f) (e)'s requests, same prompts, one batch per adapter (batches
  of 12, 7, 4, ... run one after another): the same baseline as (d), with real batches.
Then the time to make a rank-16 all-module adapter resident (file -> host RAM -> pool, and host
RAM -> pool alone) with 1 and with 200 other adapters registered and resident, against a raw
``copy_`` of the same bytes.

``--prefill`` adds the prefill-heavy figures: prompt tokens/s of 32 prompts of 32-128 tokens
(each asking for one token) for base only, one adapter and 32 distinct adapters. ``--scattered``
first cycles twice as many adapters through the pool (loads that evict idle ones), so the 32
measured adapters sit at scattered pages with other adapters' pages between them and their slots
out of page order, as after evictions, instead of loaded back to back. ``--skip-residency`` skips
the residency timings. (a), (b), (c), (e) and the prefill figures are each the median of
``--rounds`` passes (default 5) taken in turn; prefix caching is off, since every pass reuses its
prompts.

``--families`` measures only the family column instead: (a) and (c) and c/a per family
(Llama, Qwen3, Phi-3 with fused modules and fused-module adapters, Gemma 2, Qwen3-MoE with expert
LoRA) at the same shape (bench/families.py).

    python bench/bench_engine.py [--quick] [--prefill] [--scattered] [--skip-residency] [--rounds N] [--families]

Prints a table, then one JSON line with every figure and its target.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from families import family_rates, print_families
from harness import machine_info, machine_line, median, print_json
from make_llama import write_adapter, write_model
from safetensors.torch import load_file
from workloads import decode_rate, prompt, stream_bandwidth

from lorapage import Engine, EngineConfig, SamplingParams

BATCH = 32
# Requests per adapter in (e)/(f), fixed so runs compare: Zipf-like (Zipf(1.0) over 8 adapters expects
# 11.8, 5.9, 3.9, 2.9, 2.4, 2.0, 1.7, 1.5), so the one-batch-per-adapter baseline gets one large batch,
# a few mid-sized ones and a tail of singles.
SKEW_COUNTS = (12, 7, 4, 3, 2, 2, 1, 1)
# --scattered: filler adapters loaded between the measured ones; a third of them stay resident.
SCATTER_FILLERS = 16


def prefill_prompt(i: int) -> list[int]:
    """Request ``i``'s prompt in the prefill-heavy mode: 32 to 128 tokens, fixed per ``i``."""
    return prompt(i, 32 + (37 * i) % 97)


async def prefill_rate(engine: Engine, rows: Sequence[str | None]) -> float:
    """Prompt tokens/s of ``rows`` submitted together, each asking for one token: all prompt tokens
    over the time until the last first token."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()

    async def one(i: int, adapter: str | None) -> None:
        async for _ in engine.generate(prefill_prompt(i), adapter, params):
            pass

    await asyncio.gather(*(one(i, a) for i, a in enumerate(rows)))
    return sum(len(prefill_prompt(i)) for i in range(len(rows))) / (time.perf_counter() - start)


async def scatter(engine: Engine, names: list[str], fillers: list[str]) -> dict:
    """Place ``names`` as evictions leave adapters: load filler and measured adapters in turn,
    unload two fillers in three, then load the remaining measured ones (last first). They fill
    the freed pages and slots, so the measured adapters sit with fillers between them and slots
    out of page order. Returns where they sit."""
    half = len(fillers)
    for f, n in zip(fillers, names):
        await engine.admin.load(f)
        await engine.admin.load(n)
    for i, f in enumerate(fillers):
        if i % 3:
            await engine.admin.unload(f)
    for n in names[half:][::-1]:
        await engine.admin.load(n)
    entries = [engine.debug.residency.get(engine.admin.catalog.resolve_version(n)) for n in names]
    placed = sorted((e.page_ids[0], e.slot) for e in entries)
    firsts, slots = [p for p, _ in placed], [s for _, s in placed]
    pages = engine.admin.info(names[0]).num_pages
    return {
        "first_pages": firsts,
        "gaps_between_measured": sum(b - a != pages for a, b in zip(firsts, firsts[1:])),
        "slots_in_page_order": slots == sorted(slots),
    }


async def one_batch_per_adapter(
    engine: Engine, rows: list[str], prompt_len: int, new_tokens: int
) -> tuple[float, list[int]]:
    """The requests of ``rows`` (request ``i`` on adapter ``rows[i]``, as in :func:`decode_rate`)
    grouped by adapter: one batch per distinct adapter holding all of its requests, with their own
    prompts, batches run one after another. Returns decode tokens/s over the summed decode spans,
    and the batch sizes in the order run."""
    groups: dict[str, list[int]] = {}
    for i, adapter in enumerate(rows):
        groups.setdefault(adapter, []).append(i)
    spans = []
    for adapter, ids in groups.items():
        rate = await decode_rate(engine, [adapter] * len(ids), prompt_len, new_tokens, ids)
        spans.append(len(ids) * (new_tokens - 1) / rate)
    return len(rows) * (new_tokens - 1) / sum(spans), [len(ids) for ids in groups.values()]


def skewed_rows(names: list[str]) -> list[str]:
    """(e)'s adapter per request: ``SKEW_COUNTS[k]`` requests on ``names[k]``, dealt round-robin so
    adapters interleave as arrivals would, and ``names[k]`` first appears before ``names[k + 1]``."""
    return [names[k] for turn in range(max(SKEW_COUNTS)) for k, n in enumerate(SKEW_COUNTS) if turn < n]


async def residency(engine: Engine, name: str, repeats: int) -> dict:
    """Median ms for file -> pool and host RAM -> pool of ``name``, and a raw copy of its bytes."""
    cache = engine.debug.adapters
    key = engine.admin.catalog.resolve_version(name)  # the cache holds versions (id@N)
    full, from_ram = [], []
    for _ in range(repeats):
        await engine.admin.unload(name)
        cache._host.pop(key, None)  # force the file read
        t = time.perf_counter()
        await engine.admin.load(name)
        full.append(time.perf_counter() - t)
        await engine.admin.unload(name)
        t = time.perf_counter()
        await engine.admin.load(name)  # host-RAM copy is kept
        from_ram.append(time.perf_counter() - t)
    packed = cache._host[key]
    entry = cache.get(key)
    dst = torch.empty_like(packed)
    raw, copy_in = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(packed)
        raw.append(time.perf_counter() - t)
        t = time.perf_counter()
        cache._copy_in(entry, packed, entry.slot, entry.pages)  # rewrites its own pages: harmless
        copy_in.append(time.perf_counter() - t)
    ms = lambda xs: 1000 * median(xs)  # noqa: E731
    return {
        "file_to_pool_ms": ms(full),
        "ram_to_pool_ms": ms(from_ram),
        "page_copy_ms": ms(copy_in),
        "raw_copy_ms": ms(raw),
        "bytes": packed.numel() * packed.element_size(),
    }


async def main(quick: bool, prefill: bool, scattered: bool, residency_too: bool, rounds: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="lorapage-bench-") as tmp:  # ~2.7 GB of model and adapters
        return await _measure(Path(tmp), quick, prefill, scattered, residency_too, rounds)


SHAPE = dict(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=32000)


async def families(quick: bool, rounds: int) -> dict:
    """The family column (bench/families.py) at the bench's shape; prints it, returns the JSON."""
    with tempfile.TemporaryDirectory(prefix="lorapage-bench-") as tmp:
        rates = await family_rates(Path(tmp), SHAPE, 16, 8 if quick else 16, rounds)
    print(machine_line())
    print_families(rates)
    return {"bench": "engine_families", "families": rates, "rounds": rounds} | machine_info()


async def _measure(root: Path, quick: bool, prefill: bool, scattered: bool, residency_too: bool, rounds: int) -> dict:
    shape = SHAPE
    model = write_model(root / "base", **shape)
    n_params = sum(t.numel() for t in load_file(model / "model.safetensors").values())
    n_extra = 20 if quick else 200
    adapters = [write_adapter(root / f"a{i}", model, rank=16, seed=i) for i in range(BATCH + n_extra + 1)]
    prompt_len, new_tokens = 16, 8 if quick else 16
    cfg = EngineConfig(
        model=str(model),
        max_loras=BATCH + (SCATTER_FILLERS // 2 if scattered else 2),
        max_resident_loras=BATCH + (SCATTER_FILLERS // 2 if scattered else 2),  # slots as when measured before
        max_lora_rank=16,
        max_cpu_loras=BATCH + SCATTER_FILLERS,
        max_num_seqs=BATCH,
        max_model_len=256,
        scheduler="fcfs",
        lora_side_thread=False,  # figures per forward thread: the LoRA updates on it too
        # Every mode reuses its prompts: cached prefixes would leave prefill figures measuring
        # cache hits (unevenly: the warm-up's base prompts) rather than prompt compute.
        enable_prefix_caching=False,
    )
    engine = Engine(cfg)
    names = [f"a{i}" for i in range(BATCH)]
    for n, path in zip(names, adapters):
        engine.add_adapter(n, path)
    placement = None
    if scattered:
        fillers = [f"a{i}" for i in range(BATCH, BATCH + SCATTER_FILLERS)]
        for n in fillers:
            engine.add_adapter(n, adapters[int(n[1:])])
        placement = await scatter(engine, names, fillers)
    for n in names:
        await engine.admin.load(n)
    assert all(engine.debug.residency.tier(engine.admin.catalog.resolve_version(n)) == "gpu" for n in names)
    await decode_rate(engine, [None] * 4, prompt_len, 3)  # warm-up
    c_rows = names  # (c): request i on adapter c_rows[i]; (d) runs these same requests
    e_rows = skewed_rows(names)  # (e): request i on adapter e_rows[i]; (f) runs these same requests
    # (a), (b), (c), (e) and the prefill figures are measured `rounds` times in turn, each figure
    # the median of its rounds: on shared cores a single pass picks up whatever else was running.
    mixes: dict[str, Sequence[str | None]] = {
        "a_base": [None] * BATCH,
        "b_one_adapter": [names[0]] * BATCH,
        "c_distinct": c_rows,
        "e_skewed_mixed": e_rows,
    }
    samples: dict[str, list[float]] = {}
    for _ in range(rounds):
        for key, rows in mixes.items():
            samples.setdefault(key, []).append(await decode_rate(engine, rows, prompt_len, new_tokens))
    if prefill:
        await prefill_rate(engine, [None] * 4)  # warm-up
        for _ in range(rounds):
            for key, rows in (
                ("pa_prefill_base", [None] * BATCH),
                ("pb_prefill_one_adapter", [names[0]] * BATCH),
                ("pc_prefill_distinct", names),
            ):
                samples.setdefault(key, []).append(await prefill_rate(engine, rows))
    rates = {key: median(v) for key, v in samples.items()}
    rates["d_one_adapter_per_batch"], d_batches = await one_batch_per_adapter(engine, c_rows, prompt_len, new_tokens)
    rates["f_skewed_one_batch_per_adapter"], f_batches = await one_batch_per_adapter(
        engine, e_rows, prompt_len, new_tokens
    )
    probe_pages = engine.admin.info(names[0]).num_pages
    per_adapter = engine.admin.info(names[0]).size_bytes
    await engine.close()
    out = {
        "n_params": n_params,
        "adapter_bytes": per_adapter,
        "stream_bytes_per_s": stream_bandwidth(BATCH * per_adapter),
        "rates": rates,
        "d_batches": d_batches,
        "f_batches": f_batches,
        "placement": placement,
        "residency": None,
        "n_extra": n_extra,
        "rounds": rounds,
        "ratios_per_round": {
            key: [c / a for c, a in zip(samples[key], samples[base])]
            for key, base in (
                ("c_distinct", "a_base"),
                ("e_skewed_mixed", "a_base"),
                ("pc_prefill_distinct", "pa_prefill_base"),
            )
            if key in samples
        },
    }
    if not residency_too:
        return out

    # Residency with 1 and with n_extra other adapters resident.
    pages = 1 + (n_extra + 2) * probe_pages + 64
    res = {}
    for others in (1, n_extra):
        eng = Engine(
            EngineConfig(
                model=str(model),
                max_loras=others + 2,
                max_resident_loras=others + 2,
                max_lora_rank=16,
                max_cpu_loras=others + 2,
                max_num_seqs=4,
                max_model_len=256,
                num_pages=pages,
            )
        )
        for i in range(others):
            eng.add_adapter(f"o{i}", adapters[BATCH + i])
        await asyncio.gather(*(eng.admin.load(f"o{i}") for i in range(others)))
        eng.add_adapter("probe", adapters[-1])
        res[others] = await residency(eng, "probe", 3 if quick else 7)
        assert len(eng.stats().resident_adapters) == others + 1
        await eng.close()
    return out | {"residency": res}


def report(r: dict) -> dict:
    rates = r["rates"]
    a, b, c, d = (rates[k] for k in ("a_base", "b_one_adapter", "c_distinct", "d_one_adapter_per_batch"))
    e, f = rates["e_skewed_mixed"], rates["f_skewed_one_batch_per_adapter"]
    sizes = r["d_batches"]
    # Target for c/d. (d) is what serving without multi-LoRA batching does with these requests, so
    # mixing adapters in one batch must at least match it: c/d >= 1 whatever the mix. Where every
    # adapter has one request (as in (c) now) (d) is batch 32 against batch 1 and the bar is >= 8.
    d_target = ">=8" if max(sizes) == 1 else ">=1.0"
    d_shape = ", ".join(f"{sizes.count(n)} of {n} request{'s' * (n > 1)}" for n in sorted(set(sizes), reverse=True))
    print(machine_line())
    print(
        f"model: {r['n_params'] / 1e6:.0f}M params fp32 on {torch.get_num_threads()} CPU threads; "
        f"adapter rank 16 all modules = {r['adapter_bytes'] / 1e6:.1f} MB"
    )
    if r["placement"] is not None:
        p = r["placement"]
        print(
            f"adapters scattered: first pages {p['first_pages'][:6]}...; {p['gaps_between_measured']} gaps "
            f"between the 32 measured ones; slots in page order: {p['slots_in_page_order']}"
        )
    print(f"{'decode, 32 requests':<44}{'tokens/s':>10}")
    for label, v in (
        ("(a) base only", a),
        ("(b) 32 rows, one adapter", b),
        ("(c) 32 rows, 32 distinct adapters", c),
        ("(d) (c)'s requests, one batch per adapter", d),
        (f"(e) 32 rows, {len(SKEW_COUNTS)} adapters, Zipf-skewed mix", e),
        ("(f) (e)'s requests, one batch per adapter", f),
    ):
        print(f"  {label:<42}{v:>10.1f}")
    print(f"      (d) = {len(sizes)} batches, one per distinct adapter ({d_shape})")
    print(
        f"      (e) requests per adapter = {', '.join(map(str, SKEW_COUNTS))}; "
        f"(f) = {len(r['f_batches'])} batches of {', '.join(map(str, r['f_batches']))}"
    )
    per_round = "; ".join(f"{k}: {', '.join(f'{v:.2f}' for v in vs)}" for k, vs in r["ratios_per_round"].items())
    print(f"      medians of {r['rounds']} rounds; per round, over base: {per_round}")
    print(
        f"  c/a = {c / a:.2f} (target >= 0.85)   e/a = {e / a:.2f}   c/b = {c / b:.2f} (target >= 0.8)   "
        f"c/d = {c / d:.1f} (target {d_target.replace('>=', '>= ')})"
    )
    # The floor of (c): the base step plus reading each distinct adapter's weights once, at the
    # bandwidth measured in this run. No LoRA path can do better than this c/a.
    step_a = BATCH / a
    read_s = BATCH * r["adapter_bytes"] / r["stream_bytes_per_s"]
    floor = step_a / (step_a + read_s)
    print(
        f"  floor of c/a = {floor:.2f}: a {step_a * 1e3:.0f} ms base step + {BATCH * r['adapter_bytes'] / 1e6:.0f} MB "
        f"of distinct adapters read at {r['stream_bytes_per_s'] / 1e9:.1f} GB/s ({read_s * 1e3:.0f} ms); "
        f"c/a is {c / a / floor:.0%} of it"
    )
    # (f) is PEFT ``set_adapter``-style serving of a realistic mix: mixing must at least match it.
    print(
        f"  e/f = {e / f:.2f} (target >= 1.0: mixing adapters in one batch is at least as fast as "
        f"serving them one adapter at a time)"
    )
    summary = {
        "bench": "engine",
        "n_params": r["n_params"],
        "tokens_per_s": rates,
        "c_over_a": c / a,
        "c_over_a_floor": floor,
        "stream_bytes_per_s": r["stream_bytes_per_s"],
        "e_over_a": e / a,
        "c_over_b": c / b,
        "c_over_d": c / d,
        "d_batch_sizes": sizes,
        "e_over_f": e / f,
        "f_batch_sizes": r["f_batches"],
        "scattered": r["placement"] is not None,
        "rounds": r["rounds"],
        "ratios_per_round": r["ratios_per_round"],
        "targets": {"c_over_a": ">=0.85", "c_over_b": ">=0.8", "c_over_d": d_target, "e_over_f": ">=1.0"},
    }
    if "pa_prefill_base" in rates:
        pa, pb, pc = rates["pa_prefill_base"], rates["pb_prefill_one_adapter"], rates["pc_prefill_distinct"]
        print(f"{'prefill, 32 prompts of 32-128 tokens':<44}{'prompt tokens/s':>16}")
        for label, v in (("base only", pa), ("one adapter", pb), ("32 distinct adapters", pc)):
            print(f"  {label:<42}{v:>16.1f}")
        print(f"  distinct / base = {pc / pa:.2f} (target >= 0.85)")
        summary["prefill_distinct_over_base"] = pc / pa
        summary["targets"]["prefill_distinct_over_base"] = ">=0.85"
    if r["residency"] is not None:
        figures, targets = residency_report(r)
        summary |= figures
        summary["targets"] |= targets
    return summary | machine_info()


def residency_report(r: dict) -> tuple[dict, dict]:
    one, many = r["residency"][1], r["residency"][r["n_extra"]]
    print(f"{'make a rank-16 adapter resident':<44}{'1 other':>10}{str(r['n_extra']) + ' others':>14}")
    for key, label in (
        ("file_to_pool_ms", "file -> host RAM -> pool (ms)"),
        ("ram_to_pool_ms", "host RAM -> pool (ms)"),
        ("page_copy_ms", "  of which page copy + table rows (ms)"),
        ("raw_copy_ms", "raw copy_ of the same bytes (ms)"),
    ):
        print(f"  {label:<42}{one[key]:>10.2f}{many[key]:>14.2f}")
    ram_vs_copy = many["ram_to_pool_ms"] / many["raw_copy_ms"]
    growth = many["ram_to_pool_ms"] / one["ram_to_pool_ms"]
    print(
        f"  host RAM -> pool / raw copy = {ram_vs_copy:.2f} (target <= 2)   "
        f"{r['n_extra']} vs 1 resident = {growth:.2f} (target: no growth)"
    )
    figures = {
        "residency_ms": {str(k): v for k, v in r["residency"].items()},
        "ram_to_pool_over_raw_copy": ram_vs_copy,
        "residency_growth": growth,
    }
    return figures, {"ram_to_pool_over_raw_copy": "<=2", "residency_growth": "~1 (no growth)"}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer tokens and 20 resident adapters (smoke run)")
    parser.add_argument("--prefill", action="store_true", help="also the prefill-heavy figures")
    parser.add_argument("--scattered", action="store_true", help="measured adapters scattered in the pool")
    parser.add_argument("--skip-residency", action="store_true", help="throughput figures only")
    parser.add_argument("--rounds", type=int, default=5, help="passes over (a), (b), (c), (e) and prefill (median)")
    parser.add_argument(
        "--families", action="store_true", help="only c/a per family (Llama, Qwen3, Phi-3, Gemma 2, Qwen3-MoE)"
    )
    args = parser.parse_args()
    if args.families:
        print_json(asyncio.run(families(args.quick, args.rounds)))
    else:
        result = asyncio.run(main(args.quick, args.prefill, args.scattered, not args.skip_residency, args.rounds))
        print_json(report(result))
