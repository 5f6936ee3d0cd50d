"""Compiling the CPU path's C kernels (``lora_cpu.c`` with ``lora_cpu_body.h``, ``attention_cpu.h`` and
``linear_w8a8.h``, ``step_cpu.h``) once per variant, and loading them.

A variant (``cpu_isa.py``) is the kernels built for one ISA level (baseline x86-64, AVX, AVX2,
AVX-512; a portable build elsewhere); :func:`cpu_kernels` loads the best one this CPU runs, or
the one ``$LORAPAGE_CPU_KERNELS`` names. Each is built with the system C compiler (``$CC``, else
``cc``) into a cache keyed by the variant, its flags, the source and the compiler, and loaded
with ``ctypes``. Its OpenMP loops link the ``libgomp`` torch ships, so they share torch's
threads. Where that cannot be done (no compiler, torch without a bundled libgomp, no variant
builds) :func:`cpu_kernels` returns None and says why once in the log: the CPU path then runs
the PyTorch ops alone.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from lorapage.kernels import cpu_isa
from lorapage.kernels.cpu_isa import Variant

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("lora_cpu.c")
SOURCES = (
    SOURCE,
    *(SOURCE.with_name(f) for f in ("lora_cpu_body.h", "attention_cpu.h", "linear_w8a8.h", "step_cpu.h")),
)
FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp")  # then the variant's
_P, _I, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# Argument types, in the order of lora_cpu.c's signatures: pool slab, page stride, page size,
# page table and its stride, then the cells (count and three tables).
_CELLS = [_P, _I, _I, _P, _I, _I, _P, _P, _P]
_SHRINK = [_P, _I, _P, _I, _I, *_CELLS, _P, _I, _P, _I, _I, _INT]  # h, x, d_in; cells; A tables
_EXPAND = [_P, _I, _P, _I, *_CELLS, _I, _P, _P, _P, _P, _P, _I, _I, _INT]  # y, h; cells; B tables
# y, h, x, d_in; cells; A tables; B tables; the highest rank, threads (lora_group: shrink then expand)
_GROUP = [_P, _I, _P, _I, _P, _I, _I, *_CELLS, _P, _I, _P, _I, _I, _P, _P, _P, _P, _P, _I, _I, _INT]
# One set per page dtype the kernels read (float32 activations always).
WEIGHT_DTYPES = {
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.int8: "i8",
}  # int8: per-row scales
# The KV page dtypes decode attention reads (float32 queries always): kv_cache_dtype.
KV_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_F = ctypes.c_float
# out, its row stride, q, its row stride; the KV slab, page stride, block size, KV heads, head dim,
# heads; block table, its stride; context lengths, rows, scale, window (0: none), soft-cap (0: none), threads.
_DECODE_ATTENTION = [_P, _I, _P, _I, _P, _I, _I, _I, _I, _I, _P, _I, _P, _I, _F, _I, _F, _INT]
# step_cpu.h: out, x, residual (each with its row stride), weight, rows, dim, eps, threads;
# out, gate_up (each with its row stride), rows, intermediate size, threads; x, row stride, heads,
# head dim, cos, sin (a row per token), their row stride, rotated columns, rows, threads; the KV slab, page
# stride, block size, width, k, its stride, v, its stride, slots, rows; logits, their row stride,
# rows, vocabulary, the picked indices, threads.
_STEP = {
    "rms_norm_f32": [_P, _I, _P, _I, _P, _I, _P, _I, _I, _F, _INT],
    "silu_mul_f32": [_P, _I, _P, _I, _I, _I, _INT],
    "rope_f32": [_P, _I, _I, _I, _P, _P, _I, _I, _I, _INT],
    "write_kv_f32": [_P, _I, _I, _I, _P, _I, _P, _I, _P, _I],
    "greedy_rows_f32": [_P, _I, _I, _I, _P, _INT],
}
# name: (argument types, result type)
SIGNATURES: dict[str, tuple[list, type | None]] = {
    **{
        f"lora_{op}_{w}": (args, None)
        for w in WEIGHT_DTYPES.values()
        for op, args in (("shrink", _SHRINK), ("expand", _EXPAND), ("group", _GROUP))
    },
    **{f"decode_attention_{kv}": (_DECODE_ATTENTION, ctypes.c_int) for kv in KV_DTYPES.values()},
    # linear_w8a8.h: x, its row stride, rows, d_in, q, scales, threads; acc, rows, d_out, s_x, s_w, bias, threads
    "w8a8_quantize_rows": ([_P, _I, _I, _I, _P, _P, _INT], None),
    "w8a8_rescale": ([_P, _I, _I, _P, _P, _P, _INT], None),
    # x, its row stride, rows, d_in, out, scales, threads; y, rows, d_out, scales, bias, threads
    "w8a8_unit_rows": ([_P, _I, _I, _I, _P, _P, _INT], None),
    "w8a8_scale_rows": ([_P, _I, _I, _P, _P, _INT], None),
    **{name: (args, None) for name, args in _STEP.items()},
}


@dataclass(frozen=True)
class _Toolchain:
    compiler: str
    version: str  # its --version: part of the cache key
    gomp: Path  # torch's libgomp, which the kernels link


def cache_dir() -> Path:
    """Where built libraries are kept: ``$LORAPAGE_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/lorapage/kernels``."""
    if env := os.environ.get("LORAPAGE_KERNEL_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lorapage" / "kernels"


@functools.cache
def cpu_kernels() -> ctypes.CDLL | None:
    """The loaded library of the chosen variant, built first if the cache has none; None when it cannot be.
    Raises ValueError when ``$LORAPAGE_CPU_KERNELS`` names a variant this CPU cannot run."""
    loaded = _chosen()
    return None if loaded is None else loaded[1]


def kernel_variant() -> str | None:
    """The name of the variant :func:`cpu_kernels` runs (None: none built here)."""
    loaded = _chosen()
    return None if loaded is None else loaded[0].name


def load_variant(name: str) -> ctypes.CDLL:
    """The kernels of variant ``name``, built first if needed: for tests and benches that run each
    variant. Raises ValueError if this CPU cannot run it, RuntimeError if it does not build."""
    (variant,) = cpu_isa.choose(name, cpu_isa.cpu_flags())
    return _load(variant=variant)


def load_from(directory: Path, variant: str | None = None) -> ctypes.CDLL:
    """The kernels built from the sources in ``directory`` (``lora_cpu.c`` and what it includes,
    by the names in :data:`SOURCES`) for ``variant`` (default: the one :func:`cpu_kernels` runs),
    cached as :func:`cpu_kernels` caches its own. For A/B runs of two revisions of the kernels in
    one process (``bench/bench_ab.py``); raises where :func:`cpu_kernels` would return None."""
    chosen = cpu_isa.choose(variant or kernel_variant(), cpu_isa.cpu_flags())[0]
    return _load(directory, chosen)


def machine_info() -> dict[str, object]:
    """What a benchmark ran on: the CPU's model, its ISA level, the cores this process may use,
    and the C kernels' variant (None: not built). Benchmarks print it and put it in their JSON."""
    return {
        "cpu": cpu_isa.cpu_model(),
        "isa": cpu_isa.isa_level(cpu_isa.cpu_flags()),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "kernel_variant": kernel_variant(),
    }


def machine_line() -> str:
    """:func:`machine_info` as one line for a benchmark's header."""
    m = machine_info()
    return f"CPU: {m['cpu']} ({m['isa']}, {m['cores']} cores); C kernels: {m['kernel_variant'] or 'not built'}"


@functools.cache
def _chosen() -> tuple[Variant, ctypes.CDLL] | None:
    """The best variant that builds of those :func:`cpu_isa.choose` offers, and its library."""
    tries = cpu_isa.choose(os.environ.get(cpu_isa.ENV), cpu_isa.cpu_flags())
    failed: list[str] = []
    try:
        toolchain = _toolchain()
        for variant in tries:
            try:
                return variant, _load(variant=variant, toolchain=toolchain)
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                failed.append(f"{variant.name}: {e}")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        failed.append(str(e))
    log.warning("CPU LoRA kernels unavailable (%s); the CPU path runs the PyTorch ops alone", "; ".join(failed))
    return None


def _toolchain() -> _Toolchain:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC)")
    gomp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if "OpenMP" not in torch.__config__.parallel_info() or not gomp.exists():
        raise RuntimeError("torch has no bundled libgomp to share its threads with")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    return _Toolchain(compiler, version, gomp)


def _load(
    directory: Path = SOURCE.parent, variant: Variant | None = None, toolchain: _Toolchain | None = None
) -> ctypes.CDLL:
    variant = variant or cpu_isa.choose(os.environ.get(cpu_isa.ENV), cpu_isa.cpu_flags())[0]
    toolchain = toolchain or _toolchain()
    sources = [directory / f.name for f in SOURCES]
    flags = (*FLAGS, *variant.flags)
    texts = (f.read_text() if f.exists() else "" for f in sources)
    parts = (*texts, variant.name, " ".join(flags), toolchain.version, str(toolchain.gomp))
    key = hashlib.sha256(b"\0".join(s.encode() for s in parts)).hexdigest()[:16]
    target = cache_dir() / f"lora_cpu-{variant.name}-{key}.so"
    if not target.exists():
        try:
            _build(toolchain, flags, target, sources[0])
        except PermissionError:  # a read-only home: build for this user under the temp dir
            target = Path(tempfile.gettempdir()) / f"lorapage-kernels-{os.getuid()}" / target.name
            if not target.exists():
                _build(toolchain, flags, target, sources[0])
    lib = ctypes.CDLL(str(target))
    for name, (argtypes, restype) in SIGNATURES.items():
        if not hasattr(lib, name):  # an older revision's sources (bench_ab.py) lack the newer kernels
            continue
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def _build(toolchain: _Toolchain, flags: tuple[str, ...], target: Path, source: Path = SOURCE) -> None:
    """Compile into a temporary file beside ``target``, then rename: concurrent builders each
    finish whole, and a reader never sees a partial library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    gomp = toolchain.gomp
    try:
        cmd = [toolchain.compiler, *flags, str(source), "-o", tmp, str(gomp), f"-Wl,-rpath,{gomp.parent}", "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
