"""Compile every Triton kernel for a CUDA target without a GPU, from the launchers' real calls.

The interpreter (what the CPU suite runs) executes kernel bodies as Python, so it never meets
Triton's compiler: code it accepts can still fail to compile, or compile into something a GPU
refuses to launch. This script closes that gap on any machine with the ``triton`` wheel (which
ships ``ptxas``): it calls the real launchers (``lora_shrink``, ``lora_expand``, ``write_kv``,
``paged_decode_attention``, ``prefill_attention``) on CPU tensors shaped like real models, records each kernel launch
instead of running it, lets Triton's own binder specialize the arguments as a launch would, and
compiles each distinct specialization to a cubin. It then reads each cubin's resource usage and
checks that a block fits one SM (registers x threads, shared memory).

Run it in a process of its own (``TRITON_INTERPRET`` must be off before triton is imported)::

    TRITON_INTERPRET=0 python tests/kernel_compile.py --arch 90

It uses Triton's launch internals (``create_function_from_signature``, ``JITFunction._pack_args``);
when the installed Triton lacks them it exits with code 77 and says so. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels, even on a machine without CUDA

import torch  # noqa: E402
import triton  # noqa: E402

from lorapage.kernels import (  # noqa: E402
    LoraIndices,  # noqa: E402
    attention_triton,
    lora_triton,
)

SKIP = 77
KERNELS = {
    lora_triton: ("_bgmv_shrink_kernel", "_sgmv_shrink_kernel", "_bgmv_expand_kernel", "_sgmv_expand_kernel"),
    attention_triton: ("_write_kv_kernel", "_paged_decode_kernel", "_paged_prefill_kernel"),
}
# Per SM on sm_80 / sm_90: 64K 32-bit registers, and up to 227 KiB of shared memory per block.
REGISTERS_PER_SM = 65536
SHARED_PER_BLOCK = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


@dataclass(frozen=True)
class Shape:
    """The sizes of one model that decide the kernels' specializations."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    dtype: torch.dtype
    block_size: int = 16
    max_rank: int = 64


SHAPES = (
    Shape("llama-2-7b", 4096, 32, 32, 128, 11008, torch.bfloat16),
    Shape("llama-3-8b", 4096, 32, 8, 128, 14336, torch.bfloat16),
    Shape("llama-2-7b-fp16", 4096, 32, 32, 128, 11008, torch.float16),
    Shape("tiny", 64, 4, 2, 16, 176, torch.float32),
)


class Recorder:
    """Stands in for a ``JITFunction`` in its module: ``kernel[grid](*args)`` records the launch."""

    def __init__(self, fn, calls: list) -> None:
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.fn, grid, args, kwargs))


def record_launches(shape: Shape, calls: list) -> None:
    """Drive the launchers as one decode step (BGMV) and one prefill step (SGMV, paged prefill
    attention over a whole prompt and a chunk after a cached prefix) of ``shape`` would."""
    s = shape
    dt = s.dtype
    q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
    page_size = 2 * s.block_size * kv_size
    pool = torch.zeros(6, page_size, dtype=dt)
    slots, pages_per_slot = 4, 8
    page_table = torch.zeros(slots, pages_per_slot, dtype=torch.int32)
    groups = (  # (d_in, module widths) in the model's order: qkv, o, gate_up, down
        (s.hidden, (q_size, kv_size, kv_size)),
        (q_size, (s.hidden,)),
        (s.hidden, (s.intermediate, s.intermediate)),
        (s.intermediate, (s.hidden,)),
    )
    num_modules = sum(len(w) for _, w in groups)
    # Strided views of [layers, slots, groups | modules] tables, exactly as the model slices them.
    a_offset = torch.zeros(2, slots, len(groups), dtype=torch.int64)
    a_rows = torch.zeros(2, slots, len(groups), dtype=torch.int32)
    b_offset = torch.zeros(2, slots, num_modules, dtype=torch.int64)
    rank = torch.zeros(2, slots, num_modules, dtype=torch.int32)
    h_start = torch.zeros(2, slots, num_modules, dtype=torch.int32)
    scale = torch.zeros(2, slots, num_modules, dtype=torch.float32)
    h = torch.zeros(64, 3 * s.max_rank, dtype=dt)
    for tokens, sgmv in ((32, False), (64, True)):
        indices = LoraIndices(torch.zeros(tokens, dtype=torch.int32), ((0, tokens // 2, 1), (tokens // 2, tokens, 2)))
        if sgmv:
            indices = indices.with_segment_table()
        m0 = 0
        for g, (d_in, widths) in enumerate(groups):
            x = torch.zeros(tokens, d_in, dtype=dt)
            y = torch.zeros(tokens, sum(widths), dtype=dt)
            m1 = m0 + len(widths)
            lora_triton.lora_shrink(h[:tokens], x, pool, page_table, indices, a_offset[1, :, g], a_rows[1, :, g])
            starts = tuple(sum(widths[:i]) for i in range(len(widths)))
            lora_triton.lora_expand(
                y,
                h[:tokens],
                pool,
                page_table,
                indices,
                b_offset[1, :, m0:m1],
                rank[1, :, m0:m1],
                h_start[1, :, m0:m1],
                scale[1, :, m0:m1],
                starts,
            )
            m0 = m1
    # Attention reads q, k, v as slices of the fused qkv output, as the model passes them.
    qkv = torch.zeros(32, q_size + 2 * kv_size, dtype=dt)
    q = qkv[:, :q_size].view(32, s.heads, s.head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(32, s.kv_heads, s.head_dim)
    v = qkv[:, q_size + kv_size :].view(32, s.kv_heads, s.head_dim)
    kv = pool.view(pool.shape[0], 2, s.block_size, s.kv_heads, s.head_dim)
    attention_triton.write_kv(kv, k, v, torch.zeros(32, dtype=torch.int64))
    block_tables = torch.zeros(64, 256, dtype=torch.int32)[:32]
    attention_triton.paged_decode_attention(
        torch.empty_like(q), q, kv, block_tables, torch.ones(32, dtype=torch.int32), s.head_dim**-0.5
    )
    qkv = torch.zeros(80, q_size + 2 * kv_size, dtype=dt)
    q = qkv[:, :q_size].view(80, s.heads, s.head_dim)
    attention_triton.prefill_attention(
        torch.empty_like(q), q, kv, block_tables[:2], [0, 16, 80], [16, 1000], s.head_dim**-0.5
    )


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG / SHARED / LOCAL / STACK of a cubin's one function, from the ``cuobjdump`` Triton ships."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    return {key: int(value) for key, value in re.findall(r"\b(REG|SHARED|LOCAL|STACK):(\d+)", text)}


# The distinct specializations and the target, set by main() before it forks the compiling workers.
JOBS: list[tuple] = []
TARGET: list = []


def compile_one(index: int) -> dict:
    """Compile ``JOBS[index]`` to a cubin (in a forked worker) and describe it: one report row, or
    the row's names with ``error`` when Triton refused it."""
    from triton.compiler import ASTSource

    fn, signature, constexprs, attrs, options = JOBS[index]
    pointers = ",".join(t[1:] for t in signature.values() if t.startswith("*"))
    consts = ",".join(
        f"{fn.arg_names[path[0]]}={value}" for path, value in constexprs.items() if fn.arg_names[path[0]].isupper()
    )
    start = time.perf_counter()
    try:
        source = ASTSource(fn, signature, constexprs, attrs)
        compiled = triton.compile(source, target=TARGET[0], options=options.__dict__)
    except Exception as e:  # noqa: BLE001 - report every kernel, then fail
        return dict(kernel=fn.__name__, pointers=pointers, constexprs=consts, error=f"{type(e).__name__}: {e}")
    usage = resource_usage(compiled.asm["cubin"])
    ptx = compiled.asm["ptx"]
    # 16-byte accesses: vector loads, or the async copies software pipelining turns them into.
    wide = len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32|cp\.async\.cg\.shared\.global", ptx))
    return dict(
        kernel=fn.__name__,
        pointers=pointers,
        constexprs=consts,
        num_warps=options.num_warps,
        registers=usage.get("REG", 0),
        shared=compiled.metadata.shared,
        local=usage.get("LOCAL", 0),
        wide_loads=wide,
        seconds=round(time.perf_counter() - start, 2),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    args = parser.parse_args()
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend  # noqa: F401 - compile_one's, checked here
        from triton.runtime.jit import create_function_from_signature
    except ImportError as e:
        print(f"this Triton ({triton.__version__}) lacks the launch internals the check uses: {e}")
        return SKIP
    target = GPUTarget("cuda", args.arch, 32)
    backend = make_backend(target)

    calls: list = []
    for module, names in KERNELS.items():
        for name in names:
            setattr(module, name, Recorder(getattr(module, name), calls))
    for shape in SHAPES:
        record_launches(shape, calls)

    # Bind every launch (cheap, here), then compile the distinct specializations in worker
    # processes forked from this one: each compile is independent and single-threaded.
    jobs: dict[str, tuple] = {}
    for fn, grid, call_args, kwargs in calls:
        if not hasattr(fn, "_pack_args"):
            print(f"this Triton ({triton.__version__}) has no JITFunction._pack_args")
            return SKIP
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*call_args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        key = f"{fn.__name__}|{signature}|{constexprs}|{attrs}|{options.num_warps}"
        jobs.setdefault(key, (fn, signature, constexprs, attrs, options))
    JOBS.extend(jobs.values())
    TARGET.append(target)
    workers = max(1, min(len(JOBS), len(os.sched_getaffinity(0))))
    failures = []
    rows = []
    print(f"triton {triton.__version__}, target sm_{args.arch}, {len(JOBS)} specializations on {workers} processes")
    print(
        f"{'kernel':<22} {'signature (pointers)':<28} {'constexprs':<52} {'regs':>4} {'smem':>6} {'local':>5} "
        f"{'16B':>4} {'s':>5}"
    )
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        for index, row in enumerate(pool.imap(compile_one, range(len(JOBS)))):
            options = JOBS[index][4]
            name, pointers, consts = row["kernel"], row["pointers"], row["constexprs"]
            if "error" in row:
                failures.append(f"{name} ({pointers}; {consts}): {row['error']}")
                print(f"{name:<22} {pointers:<28} {consts:<52} FAILED: {row['error'].split(':')[0]}")
                continue
            rows.append(row)
            print(
                f"{name:<22} {pointers:<28} {consts:<52} {row['registers']:>4} {row['shared']:>6} "
                f"{row['local']:>5} {row['wide_loads']:>4} {row['seconds']:>5}"
            )
            threads = options.num_warps * 32
            if row["registers"] * threads > REGISTERS_PER_SM:
                failures.append(f"{name} ({consts}): {row['registers']} registers x {threads} threads > one SM")
            if row["shared"] > SHARED_PER_BLOCK.get(args.arch, 99 * 1024):
                failures.append(f"{name} ({consts}): {row['shared']} bytes of shared memory > one block's")
    for failure in failures:
        print("FAILED", failure)
    print(
        json.dumps(
            {
                "check": "kernel_compile",
                "triton": triton.__version__,
                "arch": args.arch,
                "compiled": len(rows),
                "failures": failures,
                "kernels": rows,
            }
        )
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
