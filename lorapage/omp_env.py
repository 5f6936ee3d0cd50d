"""How long an idle OpenMP worker spins before it sleeps: read once, when torch loads libgomp.

A decode step is ~60 parallel regions (oneDNN's GEMMs, the C LoRA and attention kernels, torch's
small ops) with a little serial work between them. libgomp's worker sleeps after a short spin
(``GOMP_SPINCOUNT``, 300,000 by default), so with 2 intra-op threads nearly every region first
waits for the kernel to wake its worker, and on the 2-core bench VM 2 threads ran *slower* than one
(bench/RESULTS.md, round 3). Spinning 10x longer (a few milliseconds) keeps the worker awake across
a step: the llama.cpp bench's 2-thread lorapage figures rose 14% (mixed) and 10% (base) and passed
the 1-thread ones. The variable must be set before libgomp loads, so ``lorapage``'s command sets it
first thing (an operator's own value wins); an embedding program sets it itself, before it imports
torch. No torch here.
"""

from __future__ import annotations

import os

SPINCOUNT_ENV = "GOMP_SPINCOUNT"
SPINCOUNT = "3000000"  # spins (~1-3 ms) before an idle worker sleeps


def default_spin() -> None:
    """``GOMP_SPINCOUNT`` set to :data:`SPINCOUNT` unless the environment names one already."""
    os.environ.setdefault(SPINCOUNT_ENV, SPINCOUNT)


def spin_setting() -> str:
    """The spin count libgomp read (or will read): the environment's value, or its default."""
    return os.environ.get(SPINCOUNT_ENV, "libgomp's default")
