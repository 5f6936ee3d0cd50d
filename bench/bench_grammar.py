"""The two maintained grammar engines side by side on this CPU: llguidance (lorapage's) and xgrammar.

For a 32,000-token byte-level BPE vocabulary (trained here on Python's own sources, so it looks
like a real model's) and the tiny model's 261-token one, it measures what structured output costs
a serving engine: the first compile of each schema (what a new schema's first request waits),
and the per-step mask of a batch of constrained rows (what every decode step pays), for several
JSON schemas, one row after another and as a batch. Both engines walk the same greedy-random
token sequence (each step's token drawn among the tokens both allow).

    pip install xgrammar   # not a lorapage dependency: the peer measured here
    .venv/bin/python bench/bench_grammar.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
from harness import machine_info, machine_line, median, print_json
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lorapage.structured.masks import bitmask_words
from lorapage.tiny import TINY_BASE_DIR

OUT = Path(__file__).resolve().parent / "out"
SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["name", "age", "ok"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "email": {"type": "string", "format": "email"}},
                "required": ["id", "email"],
            },
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                        "qty": {"type": "integer"},
                    },
                    "required": ["sku", "qty"],
                },
            },
            "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
        },
        "required": ["user", "items", "status"],
    },
    "tool_call": {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
}


def bpe_tokenizer(vocab: int) -> Tokenizer:
    """A byte-level BPE of ``vocab`` tokens trained on the standard library's sources (cached)."""
    path = OUT / f"bpe-{vocab}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:1500]:
            yield f.read_bytes().decode("utf-8", errors="ignore")

    tok.train_from_iterator(texts(), trainer)
    OUT.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok


def llguidance_engine(tok: Tokenizer):
    import llguidance

    eos = tok.token_to_id("<|endoftext|>")
    llt = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=eos)

    def compile_(schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
        return lambda: llguidance.LLMatcher(llt, grammar, log_level=0)

    def fill(matcher, row):
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def consume(matcher, token):
        matcher.consume_token(token)

    return compile_, fill, consume


def xgrammar_engine(tok: Tokenizer):
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tok.get_vocab_size())

    def compile_(schema):
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # a first compile each time
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        return lambda: xgr.GrammarMatcher(compiled)

    def fill(matcher, row):
        if matcher.is_terminated():  # took its stop token: nothing may follow
            row.zero_()
        else:
            matcher.fill_next_token_bitmask(row.view(1, -1), 0)

    def consume(matcher, token):
        matcher.accept_token(token)

    return compile_, fill, consume


def allowed(row: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab].bool()


def measure(engines, tok: Tokenizer, rows: int, steps: int, seed: int) -> dict:
    """Per schema and engine: first compile (ms) and mask time per step for ``rows`` rows (ms)."""
    vocab = tok.get_vocab_size()
    out = {}
    for name, schema in SCHEMAS.items():
        made = {}
        for ename, (compile_, _, _) in engines.items():
            t0 = time.perf_counter()
            factory = compile_(schema)
            made[ename] = ([factory() for _ in range(rows)], (time.perf_counter() - t0) * 1e3)
        gen = torch.Generator().manual_seed(seed)
        per_step = {e: [] for e in engines}
        masks = {e: torch.zeros(rows, bitmask_words(vocab), dtype=torch.int32) for e in engines}
        for _ in range(steps):
            for ename, (_, fill, _) in engines.items():
                t0 = time.perf_counter()
                for r, m in enumerate(made[ename][0]):
                    fill(m, masks[ename][r])
                per_step[ename].append((time.perf_counter() - t0) * 1e3)
            both = torch.ones(rows, vocab, dtype=torch.bool)
            for ename in engines:
                both &= torch.stack([allowed(masks[ename][r], vocab) for r in range(rows)])
            if not both.any(dim=1).all():
                break  # an engine done (or the two disagree at an end): stop walking
            scores = torch.rand(rows, vocab, generator=gen).masked_fill(~both, -1.0)
            tokens = scores.argmax(dim=1).tolist()
            for ename, (_, _, consume) in engines.items():
                for m, t in zip(made[ename][0], tokens):
                    consume(m, t)
        out[name] = {
            e: {"compile_ms": made[e][1], "mask_ms_per_step": median(per_step[e]), "steps": len(per_step[e])}
            for e in engines
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and a smaller trained vocabulary")
    p.add_argument("--rows", type=int, default=8, help="constrained rows per step")
    args = p.parse_args()
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        print("bench_grammar: pip install xgrammar (the peer this compares with)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    steps = 20 if args.quick else 60
    vocabs = {"tiny (261)": Tokenizer.from_file(str(TINY_BASE_DIR / "tokenizer.json"))}
    vocabs["bpe-32000" if not args.quick else "bpe-8000"] = bpe_tokenizer(8000 if args.quick else 32000)
    results = {}
    print(machine_line())
    print(f"{args.rows} constrained rows, masks one row after another on one thread, medians over up to {steps} steps")
    print(f"{'vocabulary':<12} {'schema':<10} {'engine':<11} {'first compile ms':>17} {'mask ms / step':>15}")
    for vname, tok in vocabs.items():
        engines = {"llguidance": llguidance_engine(tok), "xgrammar": xgrammar_engine(tok)}
        res = measure(engines, tok, args.rows, steps, seed=0)
        results[vname] = res
        for schema, by_engine in res.items():
            for ename, r in by_engine.items():
                print(f"{vname:<12} {schema:<10} {ename:<11} {r['compile_ms']:>17.1f} {r['mask_ms_per_step']:>15.3f}")
    big = results[list(vocabs)[-1]]
    ratio_mask = statistics.mean(
        big[s]["xgrammar"]["mask_ms_per_step"] / big[s]["llguidance"]["mask_ms_per_step"] for s in big
    )
    ratio_compile = statistics.mean(big[s]["xgrammar"]["compile_ms"] / big[s]["llguidance"]["compile_ms"] for s in big)
    print(
        f"\nbig vocabulary, xgrammar / llguidance: first compile x{ratio_compile:.2f}, mask per step x{ratio_mask:.2f}"
    )
    print_json(
        {
            "bench": "grammar",
            "rows": args.rows,
            "results": results,
            "xgrammar_over_llguidance_compile": round(ratio_compile, 3),
            "xgrammar_over_llguidance_mask": round(ratio_mask, 3),
            **machine_info(),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
