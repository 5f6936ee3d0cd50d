"""What constrained rows cost a mixed batch: decode steps of 32 rows with 8 of them under a JSON
schema, against the same 32 rows all free.

On the bench's generated Llama-shaped model (make_llama.py; float32, CPU), 32 greedy requests of
16-token prompts on 8 distinct rank-16 adapters decode 32 tokens each (EOS ignored; the schema's
string outlasts the budget, so every row decodes all 32 tokens either way). The two cases
alternate round by round in one process; decode tokens/s counts the tokens after each row's
first. Target: constrained >= 0.90 x free (the issue's "no more than their own mask").

    .venv/bin/python bench/bench_structured.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from harness import interleaved, machine_info, machine_line, median, print_json
from make_llama import write_adapter, write_model

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.structured import StructuredSpec

ROWS, CONSTRAINED, ADAPTERS, NEW_TOKENS = 32, 8, 8, 32
SCHEMA = {
    "type": "object",
    "properties": {"note": {"type": "string", "minLength": 200, "maxLength": 400}, "n": {"type": "integer"}},
    "required": ["note", "n"],
    "additionalProperties": False,
}


def prompt(i: int) -> list[int]:
    return [(7 * i + j) % 200 + 3 for j in range(16)]


async def decode_rate(engine: Engine, constrained: int) -> float:
    free = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    spec = StructuredSpec("json", json.dumps(SCHEMA))
    bound = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, structured=spec)
    firsts, lasts, counts = [], [], []

    async def one(i: int) -> None:
        params = bound if i < constrained else free
        async for out in engine.generate(prompt(i), f"a{i % ADAPTERS}", params):
            if len(out.token_ids) == 1:
                firsts.append(time.perf_counter())
        lasts.append(time.perf_counter())
        counts.append(len(out.token_ids))

    await asyncio.gather(*(one(i) for i in range(ROWS)))
    assert all(c == NEW_TOKENS for c in counts), counts
    return ROWS * (NEW_TOKENS - 1) / (max(lasts) - max(firsts))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small model, 2 rounds")
    p.add_argument("--rounds", type=int, default=6, help="rounds, each running both cases")
    args = p.parse_args()
    shape = (
        dict(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=4096)
        if args.quick
        else dict(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=32000)
    )
    rounds = 2 if args.quick else args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "model", **shape)
        engine = Engine(
            EngineConfig(model=str(model), max_loras=ADAPTERS, max_lora_rank=16, max_num_seqs=ROWS,
                         enable_prefix_caching=False)
        )  # fmt: skip
        for a in range(ADAPTERS):
            engine.add_adapter(f"a{a}", write_adapter(Path(tmp) / f"a{a}", model, rank=16, seed=a))
        rates: dict[int, list[float]] = {0: [], CONSTRAINED: []}

        async def run() -> None:
            await decode_rate(engine, CONSTRAINED)  # warm-up: loads, grammar cache, mask thread
            for _, case in interleaved(rounds, (0, CONSTRAINED)):
                rates[case].append(await decode_rate(engine, case))
            await engine.close()

        asyncio.run(run())
    free, bound = median(rates[0]), median(rates[CONSTRAINED])
    ratio = bound / free
    print(machine_line())
    print(f"{ROWS} rows on {ADAPTERS} adapters, {NEW_TOKENS} tokens each, medians of {rounds} rounds")
    print(f"{'case':<32} {'decode tok/s':>13}")
    print(f"{'all rows free':<32} {free:>13.1f}")
    print(f"{f'{CONSTRAINED} rows under a JSON schema':<32} {bound:>13.1f}")
    print(f"constrained / free: {ratio:.3f} (target >= 0.90)")
    print_json(
        {
            "bench": "structured",
            "free_tok_s": round(free, 1),
            "constrained_tok_s": round(bound, 1),
            "ratio": round(ratio, 3),
            "target_ratio": 0.9,
            "rounds": rounds,
            "pass": ratio >= 0.9,
            **machine_info(),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
