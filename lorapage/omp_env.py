"""How long an idle OpenMP worker spins before it sleeps: read once, when torch loads libgomp.

A decode step is ~60 parallel regions (oneDNN's GEMMs, the C LoRA and attention kernels, torch's
small ops) with a little serial work between them. libgomp's worker sleeps after a short spin
(``GOMP_SPINCOUNT``, 300,000 by default), so with 2 intra-op threads nearly every region first
waits for the kernel to wake its worker, and on the 2-core bench VM 2 threads ran *slower* than one
(bench/RESULTS.md, round 3). Spinning 10x longer (a few milliseconds) keeps the worker awake across
a step: the llama.cpp bench's 2-thread lorapage figures rose 14% (mixed) and 10% (base) and passed
the 1-thread ones. The variable must be set before libgomp loads, so ``lorapage``'s command sets it
first thing (an operator's own value wins); an embedding program calls :func:`configure_threads`
before it imports torch.

That spin is libgomp's only while the process's OpenMP worker threads number no more than its
CPUs: past that it spins 100 times before sleeping (its "throttled" count, which no variable sets).
Each thread that runs a parallel region gets a team of workers of its own, kept until the thread
ends: the caller's thread building the engine (weights packed on 2 threads), an I/O thread copying
an adapter. One such extra team on 2 cores and the forward's worker slept between most regions
again: the engine's 2-thread steps ran 1.0-1.2x its 1-thread ones, and 1.45-1.7x once the extra
teams were let go (the 512-wide bench model, 32 rows; bench/RESULTS.md, 2026-12-07). So the engine
keeps one team, the forward thread's: the threads that build it and its I/O threads give theirs back
when their work is done (:func:`release_thread_team`, :class:`TeamlessPool`). A program
embedding the engine that runs multi-threaded torch work on threads of its own brings the
throttle back while those teams live. No torch is imported here.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

SPINCOUNT_ENV = "GOMP_SPINCOUNT"
SPINCOUNT = "3000000"  # spins (~1-3 ms) before an idle worker sleeps
THREADS_ENV = "OMP_NUM_THREADS"


class ThreadsConfiguredTooLate(RuntimeWarning):
    """:func:`configure_threads` ran after libgomp had loaded: its spin setting cannot apply."""


def default_spin() -> None:
    """``GOMP_SPINCOUNT`` set to :data:`SPINCOUNT` unless the environment names one already."""
    os.environ.setdefault(SPINCOUNT_ENV, SPINCOUNT)


def spin_setting() -> str:
    """The spin count libgomp read (or will read): the environment's value, or its default."""
    return os.environ.get(SPINCOUNT_ENV, "libgomp's default")


def openmp_loaded() -> bool:
    """Whether libgomp has read its environment already: torch imported, or (on Linux) any
    library that mapped libgomp into this process."""
    if "torch" in sys.modules:
        return True
    maps = Path("/proc/self/maps")
    return maps.exists() and "libgomp" in maps.read_text()


def configure_threads(num_threads: int | None = None) -> bool:
    """Give an embedding program the ``lorapage`` command's OpenMP settings; call it before
    anything imports torch. True when they reach libgomp.

    Sets ``GOMP_SPINCOUNT`` to :data:`SPINCOUNT` (an operator's own value wins) and, when
    ``num_threads`` is given, ``OMP_NUM_THREADS`` (the forward's intra-op threads; also applied
    through ``torch.set_num_threads`` if torch is loaded). libgomp reads the spin count once,
    when it loads: called after that, this warns :class:`ThreadsConfiguredTooLate` and returns
    False, and the engine's 2-thread steps wait for a sleeping worker in most parallel regions
    (docs/benchmarks.md). Set the variable in the shell then, or call this first thing.
    """
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    late = openmp_loaded()
    named = SPINCOUNT_ENV in os.environ
    default_spin()
    if num_threads is not None:
        os.environ[THREADS_ENV] = str(num_threads)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(num_threads)
    if late and not named:
        warnings.warn(
            f"lorapage.configure_threads() ran after torch (libgomp) loaded: {SPINCOUNT_ENV}={SPINCOUNT} "
            "cannot take effect in this process; call it before importing torch, or set the variable "
            "in the environment",
            ThreadsConfiguredTooLate,
            stacklevel=2,
        )
        return False
    return True


OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: a thread team's workers end; they start again on the next region


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime loaded in this process (torch's libgomp on its Linux wheels), None where
    none is found (then nothing is released)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    for line in maps.read_text().splitlines():
        path = line.rsplit(" ", 1)[-1]
        if os.path.basename(path).startswith(("libgomp", "libiomp", "libomp")) and ".so" in path:
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            if hasattr(lib, "omp_pause_resource_all"):
                return lib
    return None


def release_thread_team() -> None:
    """Let the calling thread's OpenMP workers end (``omp_pause_resource_all``, OpenMP 5.0; for
    libgomp the calling thread's team only). Its next parallel region starts them again. A thread
    whose work is done calls it, so the forward's team is the only one left (see above)."""
    lib = _openmp_runtime()
    if lib is not None:
        lib.omp_pause_resource_all(OMP_PAUSE_SOFT)


def call_then_release(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, then :func:`release_thread_team` on this thread (a task for a
    thread pool whose threads should keep no OpenMP team: ``asyncio.to_thread(call_then_release, fn)``)."""
    try:
        return fn(*args, **kwargs)
    finally:
        release_thread_team()


class TeamlessPool(ThreadPoolExecutor):
    """A thread pool whose threads give their OpenMP workers back after each task
    (:func:`release_thread_team`): the engine's I/O and copy threads."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        return super().submit(call_then_release, fn, *args, **kwargs)
