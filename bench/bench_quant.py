"""Quantized bases (``quantization int8``: weight-only; ``w8a8``: int8 weights and per-token int8
activations) against the float32 one: tokens per second, base alone and mixed over adapters, and
what quantization costs in accuracy.

On a generated Llama-shaped model (the 512-wide bench model, or ``--size user``: 1,024 wide, 8
layers, 16 heads / 8 KV heads, vocab 8,192) with 8 rank-16 adapters on every module, each engine
(float32, int8, w8a8; the same checkpoint) runs one batch of 32 requests submitted together, 16-token
prompts, 32 greedy tokens each (EOS ignored): on the base alone, and mixed (request i on adapter i
mod 8). Variants and modes interleaved round by round; tok/s medians of the rounds, by the wall clock
and by this process's CPU time (tokens over the CPU seconds the batch took, every thread: on a
shared, loaded machine the figure that moves least with the other jobs).

Accuracy, each quantized base against float32 on the same requests: greedy agreement (requests whose tokens are
identical, and tokens before each request's first difference), the largest |d logprob| of the
chosen tokens where both runs agree so far, and the perplexity of each on a fixed text
(teacher-forced prompt logprobs).

    python bench/bench_quant.py [--rounds N] [--threads T] [--size bench|user] [--quick]

Prints the machine line, a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import tempfile
import time
from pathlib import Path

import torch
from harness import interleaved, machine_info, machine_line, median, print_json, table
from make_llama import write_adapter, write_model

from lorapage import Engine, EngineConfig, RequestOutput, SamplingParams

SIZES = {
    "bench": dict(hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1408, vocab=4096),
    "user": dict(hidden=1024, layers=8, heads=16, kv_heads=8, intermediate=2816, vocab=8192),
}
ADAPTERS, RANK, REQUESTS, PROMPT_LEN, NEW_TOKENS = 8, 16, 32, 16, 32
VARIANTS = ("float32", "int8", "w8a8")
QUANTIZED = VARIANTS[1:]
MODES = ("base", "mixed")
TEXT = (
    "The engine keeps one base model and many small adapters in a single pool of pages. Each step "
    "reads the base weights once for every row of the batch, and each adapter's pages once for the "
    "rows that use it. A quantized base halves or quarters the bytes a step reads for the base, "
    "while the adapters and the attention stay in the model's own precision."
)


def prompt(i: int, vocab: int) -> list[int]:
    return [(i * 37 + k * 11) % (vocab - 2) + 1 for k in range(PROMPT_LEN)]


def requests(mode: str, vocab: int) -> list[tuple[list[int], str | None]]:
    return [(prompt(i, vocab), None if mode == "base" else f"a{i % ADAPTERS}") for i in range(REQUESTS)]


async def run_batch(engine: Engine, batch: list[tuple[list[int], str | None]], new_tokens: int) -> tuple[float, float]:
    """Tokens per second of the batch: by the wall clock, and by this process's CPU time."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    async def one(ids: list[int], adapter: str | None) -> int:
        last = None
        async for last in engine.generate(ids, adapter, params):
            pass
        assert last is not None
        return len(last.token_ids)

    start, cpu = time.perf_counter(), time.process_time()
    tokens = sum(await asyncio.gather(*(one(ids, a) for ids, a in batch)))
    return tokens / (time.perf_counter() - start), tokens / (time.process_time() - cpu)


def agreement(wide: list[RequestOutput], quant: list[RequestOutput]) -> dict[str, float]:
    """Requests with identical tokens, tokens before the first difference, and the largest |d logprob|
    of the chosen tokens up to it."""
    same, shared, total, worst = 0, 0, 0, 0.0
    for w, q in zip(wide, quant, strict=True):
        n = next((k for k, (a, b) in enumerate(zip(w.token_ids, q.token_ids)) if a != b), len(w.token_ids))
        same += n == len(w.token_ids)
        shared, total = shared + n, total + len(w.token_ids)
        assert w.logprobs is not None and q.logprobs is not None
        worst = max([worst, *(abs(a.logprob - b.logprob) for a, b in zip(w.logprobs[:n], q.logprobs[:n]))])
    return {"requests_identical": same / len(wide), "tokens_agreeing": shared / total, "max_abs_dlogprob": worst}


async def outputs(engine: Engine, batch: list[tuple[list[int], str | None]], params: SamplingParams):
    return await asyncio.gather(*(engine.run_to_end(ids, a, params) for ids, a in batch))


async def perplexity(engine: Engine) -> float:
    ids = engine.tokenizer.encode(TEXT)
    out = (await outputs(engine, [(ids, None)], SamplingParams(max_tokens=1, prompt_logprobs=0)))[0]
    assert out.prompt_logprobs is not None
    lps = [lp.logprob for lp in out.prompt_logprobs if lp is not None]
    return math.exp(-sum(lps) / len(lps))


async def measure(root: Path, size: str, rounds: int, threads: int, new_tokens: int) -> dict:
    shape = SIZES[size]
    model = write_model(root / "base", **shape)
    paths = [write_adapter(root / f"a{k}", model, rank=RANK, seed=k) for k in range(ADAPTERS)]
    engines = {}
    for v in VARIANTS:
        config = EngineConfig(
            model=str(model),
            quantization=None if v == "float32" else v,
            num_threads=threads,
            max_loras=ADAPTERS,
            max_lora_rank=RANK,
            max_num_seqs=REQUESTS,
        )
        engines[v] = Engine(config)
        for k, p in enumerate(paths):
            engines[v].add_adapter(f"a{k}", str(p))
    for v in VARIANTS:  # warm: adapters resident, kernels built
        await run_batch(engines[v], requests("mixed", shape["vocab"]), 4)
    runs: dict[tuple[str, str], list[float]] = {(v, m): [] for v in VARIANTS for m in MODES}
    cpu_runs: dict[tuple[str, str], list[float]] = {(v, m): [] for v in VARIANTS for m in MODES}
    for _, (v, m) in interleaved(rounds, [(v, m) for m in MODES for v in VARIANTS]):
        wall, cpu = await run_batch(engines[v], requests(m, shape["vocab"]), new_tokens)
        runs[v, m].append(wall)
        cpu_runs[v, m].append(cpu)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    accuracy: dict[str, dict[str, dict[str, float]]] = {v: {} for v in QUANTIZED}
    for m in MODES:
        outs = {v: await outputs(engines[v], requests(m, shape["vocab"]), params) for v in VARIANTS}
        for v in QUANTIZED:
            accuracy[v][m] = agreement(outs["float32"], outs[v])
    ppl = {v: await perplexity(engines[v]) for v in VARIANTS}
    for e in engines.values():
        await e.close()
    tok_s = {f"{v}_{m}": median(runs[v, m]) for v in VARIANTS for m in MODES}
    cpu_tok_s = {f"{v}_{m}": median(cpu_runs[v, m]) for v in VARIANTS for m in MODES}
    return {"tok_s": tok_s, "cpu_tok_s": cpu_tok_s, "accuracy": accuracy, "perplexity": ppl}


def report(r: dict, size: str, rounds: int, threads: int, new_tokens: int) -> dict:
    print(machine_line())
    shape = SIZES[size]
    print(
        f"int8 and w8a8 vs float32 base: hidden {shape['hidden']} x {shape['layers']} layers, vocab {shape['vocab']}; "
        f"{REQUESTS} requests of {PROMPT_LEN} prompt tokens, {new_tokens} greedy tokens; {ADAPTERS} rank-{RANK} "
        f"adapters on every module (mixed); {threads} thread(s); median of {rounds} interleaved rounds"
    )
    t, c, acc = r["tok_s"], r["cpu_tok_s"], r["accuracy"]
    rows = [
        [
            m,
            v,
            f"{t[f'{v}_{m}']:.0f}",
            f"{t[f'{v}_{m}'] / t[f'float32_{m}']:.2f}",
            f"{c[f'{v}_{m}']:.0f}",
            f"{c[f'{v}_{m}'] / c[f'float32_{m}']:.2f}",
            *(
                [f"{acc[v][m]['requests_identical']:.2f}", f"{acc[v][m]['tokens_agreeing']:.3f}"]
                + [f"{acc[v][m]['max_abs_dlogprob']:.3g}"]
                if v in acc
                else ["-", "-", "-"]
            ),
        ]
        for m in MODES
        for v in VARIANTS
    ]
    header = ["mode", "base", "tok/s", "/ float32", "CPU tok/s", "/ float32", "reqs identical", "tokens agreeing"]
    print(table([*header, "max |dlp|"], rows, "llrrrrrrr"))
    ppl = r["perplexity"]
    print("perplexity on the fixed text: " + ", ".join(f"{v} {ppl[v]:.3f}" for v in VARIANTS))
    return {
        "bench": "quant",
        "size": size,
        "threads": threads,
        "rounds": rounds,
        "new_tokens": new_tokens,
        "tok_s": {k: round(v, 1) for k, v in t.items()},
        "ratio_base": {v: round(t[f"{v}_base"] / t["float32_base"], 3) for v in QUANTIZED},
        "ratio_mixed": {v: round(t[f"{v}_mixed"] / t["float32_mixed"], 3) for v in QUANTIZED},
        "cpu_tok_s": {k: round(v, 1) for k, v in c.items()},
        "cpu_ratio_base": {v: round(c[f"{v}_base"] / c["float32_base"], 3) for v in QUANTIZED},
        "cpu_ratio_mixed": {v: round(c[f"{v}_mixed"] / c["float32_mixed"], 3) for v in QUANTIZED},
        "accuracy": {v: {m: {k: round(x, 6) for k, x in a.items()} for m, a in per.items()} for v, per in acc.items()},
        "perplexity": {k: round(v, 4) for k, v in ppl.items()},
        **machine_info(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; figures are their medians")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of the forward pass")
    parser.add_argument("--size", choices=tuple(SIZES), default="bench", help="the model's shape")
    parser.add_argument("--quick", action="store_true", help="one round, 8 tokens")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds, new_tokens = (1, 8) if args.quick else (args.rounds, NEW_TOKENS)
    with tempfile.TemporaryDirectory(prefix="lorapage-bench-quant-") as tmp:
        results = asyncio.run(measure(Path(tmp), args.size, rounds, args.threads, new_tokens))
    print_json(report(results, args.size, rounds, args.threads, new_tokens))


if __name__ == "__main__":
    main()
