"""One projection, float32 against the quantized kernels, at decode and prefill row counts.

``y = x @ W.T`` for ``x`` [M, K] and ``W`` [N, K] (default K = 1,024, N = 4,096; ``--shapes`` for
others), M = 1, 8, 32, 128, 512: oneDNN's float32 GEMM over a packed weight (the float32 engine's),
``int8`` (``torch._weight_int8pack_mm``, bfloat16 activations), ``w8a8`` (kernels/linear_w8a8.py: the
C quantize and rescale passes around ``torch._int_mm``), the same as plain torch ops (its
reference), ``w8a8 FBGEMM`` (kernels/linear_w8a8_fbgemm.py, what a CPU without int8 dot products
runs; where torch has FBGEMM) and the same with its passes around the GEMM as torch ops, and
``torch._int_mm`` alone over pre-quantized activations, with the weight as the transposed view of its [N, K] rows and as a contiguous [K, N] copy. ``--variants``
keeps some (on a CPU without VNNI each ``_int_mm`` call takes 25-60 float32 GEMMs' time). Each figure: the median over
``--rounds`` rounds (variants interleaved within a round) of the mean time of ``--calls`` calls, by
this thread's CPU time (what a loaded machine disturbs least) and by the wall clock.

    python bench/bench_gemm_int8.py [--threads T] [--rounds R] [--shapes 1024x4096,512x2816] [--variants A,B]

Prints the machine line, a table per shape (microseconds), then one JSON line.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from harness import machine_info, machine_line, median, print_json, table

from lorapage.kernels.linear_cpu import linear_cpu, pack_weight
from lorapage.kernels.linear_int8 import linear_int8, pack_int8
from lorapage.kernels.linear_w8a8 import gemm_operands, linear_w8a8, linear_w8a8_ref, quantize_activations
from lorapage.kernels.linear_w8a8_fbgemm import fbgemm_available, linear_w8a8_fbgemm, linear_w8a8_fbgemm_ops

ROWS = (1, 8, 32, 128, 512)


def variants(m: int, k: int, n: int) -> dict[str, Callable[[], object]]:
    torch.manual_seed(m)
    w, x = torch.randn(n, k) * 0.05, torch.randn(m, k)
    packed, quant = pack_weight(w), pack_int8(w)
    q_x, _ = quantize_activations(x)
    q_t, _ = gemm_operands(quant)
    q_kn = q_t.contiguous()
    return {
        "float32 (oneDNN)": lambda: linear_cpu(x, packed),
        "int8 (weight-only)": lambda: linear_int8(x, quant),
        "w8a8": lambda: linear_w8a8(x, quant),
        "w8a8, torch ops": lambda: linear_w8a8_ref(x, quant),
        **(
            {
                "w8a8 FBGEMM": lambda: linear_w8a8_fbgemm(x, quant),
                "w8a8 FBGEMM, passes in torch ops": lambda: linear_w8a8_fbgemm_ops(x, quant),
            }
            if fbgemm_available()
            else {}
        ),
        "_int_mm, q.T view": lambda: torch._int_mm(q_x, q_t),
        "_int_mm, [K, N] copy": lambda: torch._int_mm(q_x, q_kn),
    }


def timed(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """Microseconds per call: CPU time of this thread, wall clock."""
    fn()
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.thread_time() - cpu) / calls * 1e6, (time.perf_counter() - wall) / calls * 1e6


def measure(
    k: int, n: int, rounds: int, calls: int, keep: list[str] | None
) -> dict[int, dict[str, tuple[float, float]]]:
    out: dict[int, dict[str, tuple[float, float]]] = {}
    for m in ROWS:
        runs = {name: fn for name, fn in variants(m, k, n).items() if keep is None or name in keep}
        per: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
        reps = max(1, calls * 32 // max(m, 32))
        for r in range(rounds):
            names = list(runs)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                per[name].append(timed(runs[name], reps))
        out[m] = {name: (median([c for c, _ in v]), median([w for _, w in v])) for name, v in per.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20, help="calls a round at 32 rows (more at fewer rows)")
    parser.add_argument("--shapes", default="1024x4096", help="K x N, comma-separated")
    parser.add_argument("--variants", help="the variants to time, by their names, comma-separated (default: all)")
    args = parser.parse_args()
    keep = None if args.variants is None else ["float32 (oneDNN)", *args.variants.split(",")]
    torch.set_num_threads(args.threads)
    print(machine_line())
    results = {}
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        res = measure(k, n, args.rounds, args.calls, keep)
        results[shape] = {m: {name: [round(c, 1), round(w, 1)] for name, (c, w) in r.items()} for m, r in res.items()}
        names = list(res[ROWS[0]])
        print(f"\nK = {k}, N = {n}, {args.threads} thread(s): us per call, CPU time (wall); median of {args.rounds}")
        rows = [[str(m), *(f"{res[m][v][0]:,.0f} ({res[m][v][1]:,.0f})" for v in names)] for m in ROWS]
        for quick in ("w8a8", "w8a8 FBGEMM"):
            if quick in names:
                rows += [[f"{m}: f32 / {quick} (CPU)", f"{res[m][names[0]][0] / res[m][quick][0]:.2f}"] for m in ROWS]
        print(table(["rows", *names], [r + [""] * (len(names) + 1 - len(r)) for r in rows], "l" + "r" * len(names)))
    print_json({"bench": "gemm_int8", "threads": args.threads, "rounds": args.rounds, "us": results, **machine_info()})


if __name__ == "__main__":
    main()
