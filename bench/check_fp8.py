"""fp8 weight-only (``quantization fp8``, kernels/linear_fp8.py) against the same engine unquantized:
the built-in tiny model with its demo adapters in bfloat16, greedy tokens of a few requests (base
and each adapter) compared, and one projection's GEMM timed both ways at a Llama-2-7B size
(x [rows, 4096] @ W.T, W [11008, 4096]; ``--tiny``: [rows, 256] @ [512, 256]).

    python bench/check_fp8.py [--device cuda|cpu] [--tiny] [--rows N]

The tokens are a sanity check, not a correctness proof (tests/model/test_quantized_checkpoint.py
compares fp8 with transformers in float32): e4m3 rounds each weight within 2^-4, so a tiny random
model's near-tied tokens may move. Prints a table, then one JSON line; exits 1 when fewer than half
the requests agree or the fp8 engine fails.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from harness import machine_line, median, print_json, table

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.kernels.linear_fp8 import Fp8Rows, linear_fp8, pack_fp8
from lorapage.tiny import demo_adapter_dirs

PROMPTS = [[5, 9, 17, 33, 60, 2, 8], [100, 3, 41], [7, 7, 12, 90, 15]]


def greedy(device: str, quantization: str | None, tokens: int) -> tuple[list[list[int]], list[list[float]], bool]:
    engine = Engine(EngineConfig(dtype="bfloat16", device=device, quantization=quantization, max_lora_rank=64))
    names = [None, *sorted(demo_adapter_dirs())]
    for name in names[1:]:
        engine.add_adapter(name, str(demo_adapter_dirs()[name]))
    requests = [(p, name) for name in names for p in PROMPTS]
    outs = engine.generate_batch(requests, SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=0))
    packed = isinstance(engine.debug.runner.ctx.model.layers[0]["qkv"], Fp8Rows)
    return [o.token_ids for o in outs], [[x.logprob for x in o.logprobs] for o in outs], packed


def time_us(fn, device: torch.device, reps: int) -> float:
    """Median microseconds of ``fn()`` over ``reps`` runs (CUDA events on a GPU)."""
    times = []
    for _ in range(reps + 3):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            import time

            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
    return median(times[3:])


def gemm(device: torch.device, rows: int, tiny: bool) -> dict:
    d_in, d_out = (256, 512) if tiny else (4096, 11008)
    torch.manual_seed(0)
    w = (torch.randn(d_out, d_in, device=device) * 0.02).to(torch.bfloat16)
    x = torch.randn(rows, d_in, device=device, dtype=torch.bfloat16)
    q = pack_fp8(w)
    y8, y16 = linear_fp8(x, q), F.linear(x, w)
    reps = 5 if tiny else 50
    return {
        "gemm_shape": f"{rows}x{d_in} @ {d_out}x{d_in}",
        "gemm_bf16_us": time_us(lambda: F.linear(x, w), device, reps),
        "gemm_fp8_us": time_us(lambda: linear_fp8(x, q), device, reps),
        "gemm_rel_err": float((y8.float() - y16.float()).norm() / y16.float().norm()),
        "weight_bytes_bf16": w.numel() * 2,
        "weight_bytes_fp8": q.numel() + q.scales.numel() * 4,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="small GEMM, few tokens: checks the script")
    ap.add_argument("--rows", type=int, default=32)
    args = ap.parse_args()
    tokens = 4 if args.tiny else 16
    print(machine_line())
    base_tokens, base_lps, _ = greedy(args.device, None, tokens)
    fp8_tokens, fp8_lps, packed = greedy(args.device, "fp8", tokens)
    agree = sum(a == b for a, b in zip(base_tokens, fp8_tokens, strict=True))
    dlp = [abs(a[i] - b[i]) for a, b, ta, tb in zip(base_lps, fp8_lps, base_tokens, fp8_tokens, strict=True)
           for i in range(next((k for k, (u, v) in enumerate(zip(ta, tb)) if u != v), len(ta)))]  # fmt: skip
    figures = {
        "bench": "fp8",
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "requests": len(base_tokens),
        "requests_agree": agree,
        "max_abs_dlogprob": max(dlp, default=0.0),
        "fp8_rows": packed,
        **gemm(torch.device(args.device), args.rows, args.tiny),
    }
    print(
        table(
            ["", "value"],
            [
                ["greedy requests agreeing (fp8 / bf16)", f"{agree} / {len(base_tokens)}"],
                ["max abs dlogprob while agreeing", f"{figures['max_abs_dlogprob']:.3g}"],
                [f"GEMM {figures['gemm_shape']} bf16 / fp8 us", f"{figures['gemm_bf16_us']:.1f} / {figures['gemm_fp8_us']:.1f}"],
                ["GEMM fp8 relative error", f"{figures['gemm_rel_err']:.2e}"],
            ],
            "lr",
        )
    )  # fmt: skip
    print_json(figures)
    return 0 if packed and 2 * agree >= len(base_tokens) else 1


if __name__ == "__main__":
    sys.exit(main())
