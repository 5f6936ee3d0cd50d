"""A mixture of experts under tensor parallelism on this CPU: TP=1 against TP=2 (gloo) on a small
random Mixtral (hidden 256, 2 layers, 8 heads / 4 KV heads, 8 experts of intermediate 512, top 2,
float32) with 4 rank-8 adapters on attention and every expert (PEFT's fused ``target_parameters``).

Per round and configuration: one engine, 8 requests (two per adapter) of 16 prompt tokens, 16
greedy tokens each, all submitted at once; the figure is the wall time per decode step (prefill
included). Also printed: the pages one adapter takes per rank (its expert LoRA fully sharded: as
many pages per rank as on one device, each page half as wide). Rounds alternate the order;
medians are reported; greedy tokens are checked equal between the two.

On 2 cores TP=2 cannot be faster (both ranks share the cores TP=1 uses; per MoE layer one
all-reduce, plus with expert LoRA in the step one all-gather and one all-reduce of the experts'
shrinks): the overhead is what it shows.

    python bench/bench_tp_moe.py [--rounds N] [--tokens N]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import torch
from harness import interleaved, machine_line, median, print_json, table

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.tiny import TINY_BASE_DIR

ADAPTERS, REQUESTS, PROMPT = 4, 8, 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_mixtral(path: Path) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=261, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
        eos_token_id=257, bos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    model = MixtralForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() >= 2 else p.fill_(1.0)
    model.save_pretrained(path)
    for f in TOKENIZER_FILES:
        if (TINY_BASE_DIR / f).exists():
            shutil.copy(TINY_BASE_DIR / f, path / f)
    return path


def write_adapter(base: Path, path: Path, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0,
        init_lora_weights=False, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )  # fmt: skip
    get_peft_model(model, config).save_pretrained(path)
    return path


def run(model: Path, adapters: list[Path], tp: int, tokens: int) -> dict:
    engine = Engine(EngineConfig(model=str(model), tensor_parallel_size=tp, max_lora_rank=8, enforce_eager=True))
    for i, path in enumerate(adapters):
        engine.add_adapter(f"a{i}", str(path))
    rows = [([(7 * r + j) % 250 + 1 for j in range(PROMPT)], f"a{r % ADAPTERS}") for r in range(REQUESTS)]
    engine.generate_batch(rows[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # loads, warm-up
    started = time.perf_counter()
    outs = engine.generate_batch(rows, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    seconds = time.perf_counter() - started
    out = {
        "step_ms": 1e3 * seconds / tokens,
        "adapter_pages": engine.admin.info("a0").num_pages,
        "page_bytes": engine._sizing.page_size * 4 * engine._sizing.shard_model.num_layers,
        "tokens": [o.token_ids for o in outs],
    }
    asyncio.run(engine.close())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args()
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_mixtral(root / "base")
        adapters = [write_adapter(model, root / f"a{i}", seed=i) for i in range(ADAPTERS)]
        results: dict[int, list[dict]] = {1: [], 2: []}
        for _, tp in interleaved(args.rounds, [1, 2]):
            results[tp].append(run(model, adapters, tp, args.tokens))
    same = all(r["tokens"] == results[1][0]["tokens"] for r in results[1] + results[2])
    rows, summary = [], {}
    for tp, rs in results.items():
        step, pages, page = median(r["step_ms"] for r in rs), rs[0]["adapter_pages"], rs[0]["page_bytes"]
        rows.append([tp, f"{step:.1f}", f"{page:,}", pages, f"{pages * page / 1024:.0f}"])
        summary[f"tp{tp}"] = {"step_ms": step, "page_bytes": page, "adapter_pages": pages}
    print(table(["TP", "step ms", "page bytes / rank", "adapter pages / rank", "adapter KiB / rank"], rows, "rrrrr"))
    print(f"greedy tokens identical across TP=1 and TP=2 and rounds: {same}")
    print_json({"bench": "tp_moe", "rounds": args.rounds, "tokens": args.tokens, "tokens_identical": same, **summary})


if __name__ == "__main__":
    main()
