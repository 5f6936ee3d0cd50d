"""c/a (32 rows on 32 distinct adapters over the base) with adapter pages in each ``--lora-dtype``,
side by side (issue 40, item 4).

The engine bench's model and adapters (bench_engine.py: ~100M parameters, float32, rank-16
all-module adapters, 32 requests, 16 prompt and 16 new tokens, FCFS, no prefix caching), one
engine per adapter dtype in one process. Each round measures every engine's (a) base-only and
(c) 32-distinct-adapter decode rates back to back, the engines' order alternating by round
(harness.interleaved); each dtype's c/a is the median of its per-round ratios, so a round that
the shared cores' load slowed counts against (a) and (c) alike. Also printed per dtype: the bytes
of one adapter, the pages it takes, the adapters a fixed pool budget holds, and the floor of c/a
(the base step plus reading the 32 adapters once at the bandwidth measured in this run).

Accuracy beside speed: each dtype's greedy tokens and logprobs on the 32 requests (each on its own
adapter) against the float32 engine's, which equal transformers + PEFT's on the float32 adapters
(tests/engine/test_parity.py): how many requests give the very same tokens, and the largest
|dlogprob| over the positions before a request's first differing token.

On shared cores the wall-clock rates swing with whatever else runs, so beside them the bench
reports each pass's median forward-thread CPU time per decode step (``time.thread_time`` around
the runner's ``execute``), and c/a by CPU: (a)'s step over (c)'s. CPU time leaves out the time other
processes held the core, though not their traffic on the memory bus.

    OMP_NUM_THREADS=1 python bench/bench_lora_dtype.py [--rounds 5] [--dtypes float32,bfloat16,int8]

Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch
from harness import interleaved, machine_line, median, print_json, table
from make_llama import write_adapter, write_model
from workloads import SHAPE, decode_rate, prompt, stream_bandwidth

from lorapage import Engine, EngineConfig, SamplingParams

BATCH = 32
PROMPT, NEW = 16, 16


def timed(eng: Engine) -> list[float]:
    """The forward thread's CPU seconds of each decode-only step ``eng`` runs from now on, appended
    to the list returned (the runner's ``execute`` wrapped on the instance)."""
    steps: list[float] = []
    runner = eng._runner
    execute = runner.execute

    def wrapped(plan):
        start = time.thread_time()
        out = execute(plan)
        if plan.num_decode == len(plan.block_tables):
            steps.append(time.thread_time() - start)
        return out

    runner.execute = wrapped  # type: ignore[method-assign]
    return steps


async def cpu_step(eng: Engine, steps: list[float], rows: list[str | None]) -> tuple[float, float]:
    """(decode tokens/s, median forward-thread CPU seconds per decode step) of one pass over ``rows``."""
    steps.clear()
    rate = await decode_rate(eng, rows, PROMPT, NEW)
    return rate, statistics.median(steps)


async def greedy(eng: Engine, rows: list[str]) -> list[tuple[list[int], list[float]]]:
    """Each row's greedy tokens and their logprobs (request ``i``'s prompt on adapter ``rows[i]``)."""
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0)

    async def one(i: int, adapter: str) -> tuple[list[int], list[float]]:
        last = None
        async for out in eng.generate(prompt(i, PROMPT), adapter, params):
            last = out
        assert last is not None and last.logprobs is not None
        return last.token_ids, [lp.logprob for lp in last.logprobs]

    return list(await asyncio.gather(*(one(i, a) for i, a in enumerate(rows))))


def agreement(got: list[tuple[list[int], list[float]]], want: list[tuple[list[int], list[float]]]) -> dict:
    """Requests with identical tokens, and the largest |dlogprob| before each one's first differing token."""
    same, worst = 0, 0.0
    for (gt, gl), (wt, wl) in zip(got, want, strict=True):
        same += gt == wt
        upto = next((k for k, (a, b) in enumerate(zip(gt, wt)) if a != b), len(gt))
        worst = max([worst, *(abs(a - b) for a, b in zip(gl[:upto], wl[:upto]))])
    return {"identical_requests": same, "requests": len(got), "max_abs_dlogprob": worst}


def engine(model: Path, adapters: list[Path], lora_dtype: str) -> Engine:
    eng = Engine(
        EngineConfig(
            model=str(model),
            lora_dtype=lora_dtype,
            max_loras=BATCH + 2,
            max_resident_loras=BATCH + 2,
            max_lora_rank=16,
            max_cpu_loras=BATCH + 2,
            max_num_seqs=BATCH,
            max_model_len=256,
            scheduler="fcfs",
            enable_prefix_caching=False,
            lora_side_thread=False,  # c/a per thread: the LoRA on the forward's thread, as the base's work
        )
    )
    for i, path in enumerate(adapters):
        eng.add_adapter(f"a{i}", path)
    return eng


async def measure(root: Path, dtypes: list[str], rounds: int) -> dict:
    model = write_model(root / "base", **SHAPE)
    adapters = [write_adapter(root / f"a{i}", model, rank=16, seed=i) for i in range(BATCH)]
    names = [f"a{i}" for i in range(BATCH)]
    engines = {d: engine(model, adapters, d) for d in dtypes}
    info = {}
    for d, eng in engines.items():
        for n in names:
            await eng.admin.load(n)
        await decode_rate(eng, [None] * 4, PROMPT, 3)  # warm-up
        await decode_rate(eng, names[:4], PROMPT, 3)
        a0 = eng.admin.info(names[0])
        # What a step reads of each adapter: its pages (int8's hold its scales too).
        pool = eng.debug.pool
        page_bytes = pool.storage.shape[0] * pool.page_size * pool.storage.element_size()
        info[d] = {"adapter_bytes": a0.num_pages * page_bytes, "adapter_pages": a0.num_pages}
    tokens = {d: await greedy(eng, names) for d, eng in engines.items()}
    if "float32" in tokens:
        for d in dtypes:
            info[d]["against_float32"] = agreement(tokens[d], tokens["float32"])
    steps = {d: timed(eng) for d, eng in engines.items()}
    samples: dict[str, dict[str, list[float]]] = {d: {"a": [], "c": [], "a_cpu": [], "c_cpu": []} for d in dtypes}
    for _, d in interleaved(rounds, dtypes):
        for key, rows in (("a", [None] * BATCH), ("c", names)):
            rate, cpu = await cpu_step(engines[d], steps[d], rows)
            samples[d][key].append(rate)
            samples[d][f"{key}_cpu"].append(cpu)
    for eng in engines.values():
        await eng.close()
    out = {}
    for d in dtypes:
        a, c = samples[d]["a"], samples[d]["c"]
        nbytes = BATCH * info[d]["adapter_bytes"]
        bw = stream_bandwidth(nbytes)
        step_a = BATCH / median(a)
        out[d] = info[d] | {
            "a": a,
            "c": c,
            "c_over_a_per_round": [ci / ai for ci, ai in zip(c, a)],
            "c_over_a": median(ci / ai for ci, ai in zip(c, a)),
            "a_cpu_ms": [x * 1e3 for x in samples[d]["a_cpu"]],
            "c_cpu_ms": [x * 1e3 for x in samples[d]["c_cpu"]],
            "c_over_a_cpu": median(ai / ci for ai, ci in zip(samples[d]["a_cpu"], samples[d]["c_cpu"])),
            "floor": step_a / (step_a + nbytes / bw),
            "stream_gb_per_s": bw / 1e9,
        }
    return out


def _agreement_cell(a: dict | None) -> str:
    return "-" if a is None else f"{a['identical_requests']}/{a['requests']}, {a['max_abs_dlogprob']:.2g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtypes", default="float32,bfloat16,int8", help="comma-separated lora_dtype values")
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        r = asyncio.run(measure(Path(tmp), dtypes, args.rounds))
    print(machine_line())
    print(f"{torch.get_num_threads()} threads, {args.rounds} rounds, engines' order alternating by round")
    rows = [
        [
            d,
            f"{median(v['a']):.1f}",
            f"{median(v['c']):.1f}",
            f"**{v['c_over_a']:.2f}** ({', '.join(f'{x:.2f}' for x in v['c_over_a_per_round'])})",
            f"{median(v['a_cpu_ms']):.1f} / {median(v['c_cpu_ms']):.1f}",
            f"**{v['c_over_a_cpu']:.2f}**",
            f"{v['floor']:.2f}",
            f"{v['adapter_bytes'] / 1e6:.1f} MB / {v['adapter_pages']}",
            _agreement_cell(v.get("against_float32")),
        ]
        for d, v in r.items()
    ]
    header = [
        "lora_dtype",
        "(a) base tok/s",
        "(c) 32 distinct tok/s",
        "c/a (rounds)",
        "CPU ms / step (a) / (c)",
        "c/a by CPU",
        "floor",
        "adapter / pages",
        "vs float32: same tokens, max abs dlogprob",
    ]
    print(table(header, rows, "lrrrrrrrr"))
    print_json({"bench": "lora_dtype", "rounds": args.rounds, "threads": torch.get_num_threads(), "results": r})


if __name__ == "__main__":
    main()
