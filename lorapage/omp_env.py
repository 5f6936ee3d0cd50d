"""How long an idle OpenMP worker spins before it sleeps: read once, when torch loads libgomp.

A decode step is ~60 parallel regions (oneDNN's GEMMs, the C LoRA and attention kernels, torch's
small ops) with a little serial work between them. libgomp's worker sleeps after a short spin
(``GOMP_SPINCOUNT``, 300,000 by default), so with 2 intra-op threads nearly every region first
waits for the kernel to wake its worker, and on the 2-core bench VM 2 threads ran *slower* than one
(bench/RESULTS.md, round 3). Spinning 10x longer (a few milliseconds) keeps the worker awake across
a step: the llama.cpp bench's 2-thread lorapage figures rose 14% (mixed) and 10% (base) and passed
the 1-thread ones. The variable must be set before libgomp loads, so ``lorapage``'s command sets it
first thing (an operator's own value wins); an embedding program calls :func:`configure_threads`
before it imports torch. No torch here.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

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
