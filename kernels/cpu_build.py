"""Compiling the CPU path's C kernels (``lora_cpu.c`` with ``lora_cpu_body.h``) once per machine, and loading them.

The library is built with the system C compiler (``$CC``, else ``cc``) for this CPU
(``-march=native``) into a cache keyed by the source, the flags, the compiler and the CPU, and
loaded with ``ctypes``. Its OpenMP loops link the ``libgomp`` torch ships, so they share torch's
threads. Where that cannot be done (no compiler, torch without a bundled libgomp, a failed
build) :func:`cpu_kernels` returns None and says why once in the log: the CPU path then runs the
PyTorch ops alone.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("lora_cpu.c")
SOURCES = (SOURCE, SOURCE.with_name("lora_cpu_body.h"))  # what the build reads: the cache key
FLAGS = ("-O3", "-march=native", "-std=gnu11", "-fPIC", "-shared", "-fopenmp")
_P, _I, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# Argument types, in the order of lora_cpu.c's signatures: pool slab, page stride, page size,
# page table and its stride, then the cells (count and three tables).
_CELLS = [_P, _I, _I, _P, _I, _I, _P, _P, _P]
_SHRINK = [_P, _I, _P, _I, _I, *_CELLS, _P, _I, _P, _I, _I, _INT]  # h, x, d_in; cells; A tables
_EXPAND = [_P, _I, _P, _I, *_CELLS, _I, _P, _P, _P, _P, _P, _I, _I, _INT]  # y, h; cells; B tables
# One pair per page dtype the kernels read (float32 activations always).
WEIGHT_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
SIGNATURES = {
    f"lora_{op}_{w}": args for w in WEIGHT_DTYPES.values() for op, args in (("shrink", _SHRINK), ("expand", _EXPAND))
}


def cache_dir() -> Path:
    """Where built libraries are kept: ``$LORAPAGE_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/lorapage/kernels``."""
    if env := os.environ.get("LORAPAGE_KERNEL_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lorapage" / "kernels"


@functools.cache
def cpu_kernels() -> ctypes.CDLL | None:
    """The loaded library, built first if this machine has none; None when it cannot be."""
    try:
        return _load()
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("CPU LoRA kernels unavailable (%s); the CPU path runs the PyTorch ops alone", e)
        return None


def load_from(directory: Path) -> ctypes.CDLL:
    """The kernels built from the sources in ``directory`` (``lora_cpu.c`` and what it includes,
    by the names in :data:`SOURCES`), cached as :func:`cpu_kernels` caches its own. For A/B runs
    of two revisions of the kernels in one process (``bench/bench_ab.py``); raises where
    :func:`cpu_kernels` would return None."""
    return _load(directory)


def _load(directory: Path = SOURCE.parent) -> ctypes.CDLL:
    sources = [directory / f.name for f in SOURCES]
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC)")
    gomp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if "OpenMP" not in torch.__config__.parallel_info() or not gomp.exists():
        raise RuntimeError("torch has no bundled libgomp to share its threads with")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    key = hashlib.sha256(
        b"\0".join(
            s.encode()
            for s in (
                *(f.read_text() if f.exists() else "" for f in sources),
                " ".join(FLAGS),
                version,
                _cpu_name(),
                str(gomp),
            )
        )
    ).hexdigest()[:16]
    target = cache_dir() / f"lora_cpu-{key}.so"
    if not target.exists():
        try:
            _build(compiler, gomp, target, sources[0])
        except PermissionError:  # a read-only home: build for this user under the temp dir
            target = Path(tempfile.gettempdir()) / f"lorapage-kernels-{os.getuid()}" / target.name
            if not target.exists():
                _build(compiler, gomp, target, sources[0])
    lib = ctypes.CDLL(str(target))
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    return lib


def _build(compiler: str, gomp: Path, target: Path, source: Path = SOURCE) -> None:
    """Compile into a temporary file beside ``target``, then rename: concurrent builders each
    finish whole, and a reader never sees a partial library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        cmd = [compiler, *FLAGS, str(source), "-o", tmp, str(gomp), f"-Wl,-rpath,{gomp.parent}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _cpu_name() -> str:
    """The CPU's model and flags: what ``-march=native`` compiled for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    return "\n".join(line for line in lines if line.startswith(("model name", "flags")))
