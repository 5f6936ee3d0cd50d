"""What one long prompt costs the streams already decoding, with and without chunked prefill.

Sixteen streams decode on a generated Llama-shaped model (fp32, CPU by default); once they are
under way a 4,096-token prompt arrives. Without chunking its whole prefill is one step, and every
stream waits for it; with ``max_num_batched_tokens=512`` it is computed 512 tokens a step after
the decodes, so each stream's gap is one chunk's time. Both engines run the same requests in one
run, side by side; the figure is the streams' p99 inter-token latency, without / with chunking
(target >= 4), and both answers' tokens must be equal.

    python bench/bench_chunked.py [--prompt 4096] [--streams 16] [--chunk 512]

Prints a table, then one JSON line with the figures and targets.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from harness import machine_info, machine_line, print_json
from make_llama import write_adapter, write_model

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.traces.stats import percentile

TARGET_RATIO = 4.0


async def run(engine: Engine, args: argparse.Namespace) -> tuple[list[float], list[int], float]:
    """Inter-token gaps of the streams (seconds per token), the long request's tokens, and how
    long its prefill held the first token back."""
    params = SamplingParams(max_tokens=args.stream_tokens, temperature=0.0, ignore_eos=True)
    gaps: list[float] = []
    started = asyncio.Event()

    async def stream(i: int) -> None:
        last, count = None, 0
        prompt = [(11 * i + j) % 200 + 3 for j in range(32)]
        async for out in engine.generate(prompt, "a" if i % 2 else None, params):
            now = time.perf_counter()
            n = len(out.token_ids)
            if last is not None and n > count:
                gaps.append((now - last) / (n - count))  # coalesced outputs: spread over their tokens
            last, count = now, n
            if n >= 4:
                started.set()

    async def long_request() -> tuple[list[int], float]:
        await started.wait()
        prompt = [(5 * j) % 250 + 3 for j in range(args.prompt)]
        t0 = time.perf_counter()
        first = None
        async for out in engine.generate(prompt, "a", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)):
            first = first or time.perf_counter() - t0
        return out.token_ids, first or 0.0

    results = await asyncio.gather(long_request(), *(stream(i) for i in range(args.streams)))
    tokens, ttft = results[0]
    return gaps, tokens, ttft


def engine_for(model: Path, adapter: Path, args: argparse.Namespace, chunked: bool) -> Engine:
    budget = args.chunk if chunked else args.prompt + 64 + args.streams  # unchunked: the whole context fits a step
    engine = Engine(
        EngineConfig(
            model=str(model),
            max_model_len=args.prompt + 64,
            max_num_seqs=args.streams + 1,
            max_num_batched_tokens=budget,
            enable_chunked_prefill=chunked,
            max_loras=2,
            max_lora_rank=16,
            kernel_backend="torch",
        )
    )
    engine.add_adapter("a", adapter)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--stream-tokens", type=int, default=96)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(
            Path(tmp) / "model",
            hidden=384,
            layers=4,
            heads=6,
            kv_heads=2,
            intermediate=1024,
            vocab=4096,
            max_position_embeddings=args.prompt + 64,
        )
        adapter = write_adapter(Path(tmp) / "lora", model, rank=16, seed=1)
        figures = {}
        for name, chunked in (("unchunked", False), ("chunked", True)):
            engine = engine_for(model, adapter, args, chunked)

            async def measure(engine: Engine = engine) -> tuple[list[float], list[int], float]:
                out = await run(engine, args)
                await engine.close()
                return out

            gaps, tokens, ttft = asyncio.run(measure())
            figures[name] = {
                "itl_p50_s": percentile(gaps, 50),
                "itl_p99_s": percentile(gaps, 99),
                "itl_max_s": max(gaps),
                "long_ttft_s": ttft,
                "tokens": tokens,
            }
    a, b = figures["unchunked"], figures["chunked"]
    ratio = a["itl_p99_s"] / b["itl_p99_s"]
    print(machine_line())
    print(f"{args.streams} streams decoding; a {args.prompt}-token prompt arrives (chunk {args.chunk})")
    print(f"{'':<12} {'ITL p50 s':>10} {'ITL p99 s':>10} {'ITL max s':>10} {'long TTFT s':>12}")
    for name, f in figures.items():
        print(
            f"{name:<12} {f['itl_p50_s']:>10.3f} {f['itl_p99_s']:>10.3f} {f['itl_max_s']:>10.3f} {f['long_ttft_s']:>12.2f}"
        )
    same = a["tokens"] == b["tokens"]
    print(f"p99 ITL unchunked / chunked = {ratio:.1f} (target >= {TARGET_RATIO:g}); long answer equal: {same}")
    print_json(
        {
            "bench": "chunked_prefill",
            "prompt_tokens": args.prompt,
            "streams": args.streams,
            "chunk": args.chunk,
            **{f"{n}_{k}": v for n, f in figures.items() for k, v in f.items() if k != "tokens"},
            "p99_itl_ratio": ratio,
            "outputs_equal": same,
            "targets": {"p99_itl_ratio": f">={TARGET_RATIO:g}", "outputs_equal": True},
            "pass": ratio >= TARGET_RATIO and same,
            **machine_info(),
        }
    )


if __name__ == "__main__":
    main()
