"""Pre-quantized (compressed-tensors) checkpoints against quantizing at load and against float32.

On the 512-wide bench model (hidden 512, 4 layers, 8 heads / 4 KV heads, vocab 4,096) with 8
rank-16 adapters on every module, the float32 checkpoint is compressed by compressed-tensors' own
API (int8 W8A16, W8A8 int8 with dynamic per-token activations, fp8 weight-only; per-channel scales
as llm-compressor's min-max observer sets them, float32 scales from a float32 model). Each variant
(float32; int8, w8a8, fp8 each quantized at load and served from its checkpoint) runs the same mixed
batch: 32 requests submitted together (request i on adapter i mod 8), 16-token prompts, greedy
tokens with EOS ignored. Reported per variant: the weight file's bytes, the engine's start-up time,
mixed tok/s (median of interleaved rounds), agreement with float32 (requests identical, tokens
before each request's first difference, the largest |d logprob| up to it) and perplexity on a
fixed text (teacher-forced prompt logprobs).

    python bench/bench_ckpt.py [--rounds N] [--threads T] [--tokens N]

Needs transformers and compressed-tensors (the dev extra). Prints the machine line, a table, then
one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import tempfile
import time
from pathlib import Path

import torch
from harness import interleaved, machine_line, median, print_json, table
from make_llama import write_adapter, write_model

from lorapage import Engine, EngineConfig, RequestOutput, SamplingParams

SHAPE = dict(hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1408, vocab=4096)
ADAPTERS, RANK, REQUESTS, PROMPT_LEN = 8, 16, 32, 16
SCHEMES = {"int8": ("int", False), "w8a8": ("int", True), "fp8": ("float", False)}
TEXT = (
    "The engine keeps one base model and many small adapters in a single pool of pages. Each step "
    "reads the base weights once for every row of the batch, and each adapter's pages once for the "
    "rows that use it. A quantized base halves or quarters the bytes a step reads for the base."
)


def compress(src: Path, out: Path, weight_type: str, activations: bool) -> Path:
    """``src`` written by compressed-tensors as an 8-bit per-channel checkpoint (tests/ct_checkpoints.py
    does the same for the tests)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    weights = QuantizationArgs(num_bits=8, type=weight_type, symmetric=True, strategy="channel")
    acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts if activations else None)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.data
            scale, zero = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), weights)
            module.weight_scale.data.copy_(scale)
            module.weight_zero_point.data.copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(
        model, quantization_format="int-quantized" if weight_type == "int" else "float-quantized"
    )
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, out / f)
    return out


def requests() -> list[tuple[list[int], str]]:
    vocab = SHAPE["vocab"]
    return [
        ([(i * 37 + k * 11) % (vocab - 2) + 1 for k in range(PROMPT_LEN)], f"a{i % ADAPTERS}") for i in range(REQUESTS)
    ]


async def outputs(engine: Engine, params: SamplingParams) -> list[RequestOutput]:
    return await asyncio.gather(*(engine.run_to_end(ids, a, params) for ids, a in requests()))


def agreement(wide: list[RequestOutput], quant: list[RequestOutput]) -> dict[str, float]:
    same, shared, total, worst = 0, 0, 0, 0.0
    for w, q in zip(wide, quant, strict=True):
        n = next((k for k, (a, b) in enumerate(zip(w.token_ids, q.token_ids)) if a != b), len(w.token_ids))
        same, shared, total = same + (n == len(w.token_ids)), shared + n, total + len(w.token_ids)
        assert w.logprobs is not None and q.logprobs is not None
        worst = max([worst, *(abs(a.logprob - b.logprob) for a, b in zip(w.logprobs[:n], q.logprobs[:n]))])
    return {"requests_identical": same / len(wide), "tokens_agreeing": shared / total, "max_abs_dlogprob": worst}


async def perplexity(engine: Engine) -> float:
    ids = engine.tokenizer.encode(TEXT)
    out = await engine.run_to_end(ids, None, SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert out.prompt_logprobs is not None
    lps = [lp.logprob for lp in out.prompt_logprobs if lp is not None]
    return math.exp(-sum(lps) / len(lps))


async def measure(root: Path, rounds: int, threads: int, tokens: int) -> dict:
    src = write_model(root / "float32", **SHAPE)
    adapters = [write_adapter(root / f"a{k}", src, rank=RANK, seed=k) for k in range(ADAPTERS)]
    variants: dict[str, tuple[Path, str | None]] = {"float32": (src, None)}
    for name, (kind, acts) in SCHEMES.items():
        variants[f"{name} at load"] = (src, name)
        variants[f"{name} checkpoint"] = (compress(src, root / name, kind, acts), None)
    engines, figures = {}, {}
    for v, (path, quantization) in variants.items():
        start = time.perf_counter()
        engines[v] = Engine(
            EngineConfig(
                model=str(path), quantization=quantization, num_threads=threads, max_loras=ADAPTERS,
                max_lora_rank=RANK, max_num_seqs=REQUESTS, allow_unbound=True,
            )
        )  # fmt: skip
        bytes_on_disk = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        figures[v] = {"startup_s": time.perf_counter() - start, "weight_file_bytes": bytes_on_disk}
        for k, p in enumerate(adapters):
            engines[v].add_adapter(f"a{k}", str(p))
    fast = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for e in engines.values():  # warm: adapters resident, kernels built
        await outputs(e, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    runs: dict[str, list[float]] = {v: [] for v in variants}
    for _, v in interleaved(rounds, list(variants)):
        start = time.perf_counter()
        done = await outputs(engines[v], fast)
        runs[v].append(sum(len(o.token_ids) for o in done) / (time.perf_counter() - start))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = {v: await outputs(e, params) for v, e in engines.items()}
    for v, e in engines.items():
        figures[v] |= {"mixed_tok_s": median(runs[v]), "perplexity": await perplexity(e)}
        figures[v] |= agreement(outs["float32"], outs[v])
        await e.close()
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        figures = asyncio.run(measure(Path(tmp), args.rounds, args.threads, args.tokens))
    print(machine_line())
    f32 = figures["float32"]
    rows = [
        [
            v,
            f"{f['weight_file_bytes'] / 2**20:.1f}",
            f"{f['startup_s']:.2f}",
            f"{f['mixed_tok_s']:.0f}",
            f"{f['mixed_tok_s'] / f32['mixed_tok_s']:.2f}",
            f"{f['requests_identical']:.0%}",
            f"{f['tokens_agreeing']:.0%}",
            f"{f['max_abs_dlogprob']:.3g}",
            f"{f['perplexity']:.3f}",
        ]
        for v, f in figures.items()
    ]
    header = ["variant", "MiB", "start s", "mixed tok/s", "/ f32", "reqs = f32", "tokens = f32", "max abs dlp", "ppl"]
    print(table(header, rows, "lrrrrrrrr"))
    print_json({"bench": "ckpt", "rounds": args.rounds, "threads": args.threads, "tokens": args.tokens, **figures})


if __name__ == "__main__":
    main()
