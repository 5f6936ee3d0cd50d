"""The engine's base path against a plain ``transformers`` generate on the same requests.

On the generated Llama-shaped model of ``bench_engine.py`` (about 100M parameters, fp32, CPU), the
requests of issue 13's trace shape: 64 prompts of 32-128 tokens, each generating 32 tokens greedily
(EOS ignored). Once through the engine (submitted together, batched by its scheduler), once as one
batch through ``LlamaForCausalLM.generate`` (left-padded to the longest prompt, with its attention
mask, as a plain generate must batch them). Generated tokens per second of each, measured in turn
for ``--rounds`` rounds (median); the greedy tokens of both are compared. The engine is meant to
keep at least the 1.2x of plain generate the project started from. ``--uniform`` gives every
prompt 16 tokens instead (no padding: plain generate's best case).

    python bench/bench_base_vs_hf.py [--rounds N]

Prints a table, then one JSON line with the figures and the target.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch
from harness import machine_info, machine_line, median, print_json
from make_llama import write_model

from lorapage import Engine, EngineConfig, SamplingParams

BATCH, NEW = 64, 32


def prompts(uniform: bool) -> list[list[int]]:
    """Request ``i``'s prompt: 32 to 128 tokens (16 when ``uniform``), fixed per ``i``."""
    return [[(7 * i + j) % 200 + 3 for j in range(16 if uniform else 32 + (37 * i) % 97)] for i in range(BATCH)]


async def engine_run(engine: Engine, uniform: bool) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)

    async def one(ids: list[int]) -> list[int]:
        async for out in engine.generate(ids, None, params):
            pass
        return list(out.token_ids)

    start = time.perf_counter()
    tokens = await asyncio.gather(*(one(p) for p in prompts(uniform)))
    return BATCH * NEW / (time.perf_counter() - start), tokens


def hf_run(model, uniform: bool) -> tuple[float, list[list[int]]]:
    rows = prompts(uniform)
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])  # left-padded, as generate needs
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
        )
    rate = BATCH * NEW / (time.perf_counter() - start)
    return rate, out[:, width:].tolist()


async def measure(root: Path, rounds: int, uniform: bool) -> dict:
    from transformers import LlamaForCausalLM

    model_dir = write_model(root / "base", hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=32000)
    engine = Engine(
        EngineConfig(model=str(model_dir), max_num_seqs=BATCH, max_model_len=256, enable_prefix_caching=False)
    )
    hf = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    await engine_run(engine, uniform)  # warm-ups
    hf_run(hf, uniform)
    rates: dict[str, list[float]] = {"engine": [], "transformers": []}
    same = True
    for _ in range(rounds):
        rate, ours = await engine_run(engine, uniform)
        rates["engine"].append(rate)
        rate, theirs = hf_run(hf, uniform)
        rates["transformers"].append(rate)
        same = same and ours == theirs  # padding changes float sums: a tie may break otherwise
    await engine.close()
    return {"rates": rates, "same_tokens": same}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--uniform", action="store_true", help="every prompt 16 tokens (no padding)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="lorapage-bench-") as tmp:
        r = asyncio.run(measure(Path(tmp), args.rounds, args.uniform))
    ours, theirs = (median(r["rates"][k]) for k in ("engine", "transformers"))
    shape = "16-token prompts" if args.uniform else "prompts of 32-128 tokens"
    print(machine_line())
    print(
        f"model: 100M params fp32 on {torch.get_num_threads()} CPU threads; {BATCH} requests, {shape}, {NEW} new tokens"
    )
    print(f"{'base model, greedy':<36}{'generated tokens/s':>20}")
    print(f"  {'lorapage engine':<34}{ours:>20.1f}")
    print(f"  {'transformers generate (one batch)':<34}{theirs:>20.1f}")
    per_round = ", ".join(f"{a / b:.2f}" for a, b in zip(r["rates"]["engine"], r["rates"]["transformers"]))
    print(f"  engine / transformers = {ours / theirs:.2f} (target >= 1.2; per round {per_round})")
    print(f"  same greedy tokens: {r['same_tokens']}")
    summary = {
        "bench": "base_vs_hf",
        "tokens_per_s": {"engine": ours, "transformers": theirs},
        "engine_over_transformers": ours / theirs,
        "rates_per_round": r["rates"],
        "same_tokens": r["same_tokens"],
        "uniform_prompts": args.uniform,
        "targets": {"engine_over_transformers": ">=1.2", "same_tokens": True},
        **machine_info(),
    }
    print_json(summary)


if __name__ == "__main__":
    main()
