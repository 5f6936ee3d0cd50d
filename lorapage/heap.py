"""A serving process's startup heap, left out of Python's collections of its oldest generation.

CPython's cyclic collector walks every object of the generations it collects, and the oldest
holds what a server built at startup: the model's modules, the registry's versions, the adapters'
specs and layouts. With 2,000 adapters registered (and the replay harness's modules) that was
~250,000 objects, and one collection of them took 0.26-0.35 s holding the GIL, the forward thread
stopped the while: one such pause a pass of the S-LoRA replay's 2,000-adapter case, none in its
5-adapter case (bench/RESULTS.md, round 4 session 10). ``gc.freeze()`` moves every object alive
into a permanent generation that no collection walks, as vLLM's workers do once warmed up and
SGLang's ``freeze_gc``. An object frozen that later becomes garbage in a reference cycle stays
allocated; reference counting frees the rest as before.

``lorapage serve`` calls :func:`freeze_gc_heap` once its engines are built and its adapters
registered, and ``lorapage replay run --embedded`` runs its trace inside :func:`gc_heap_frozen`;
an embedding program calls either when it is ready to serve (it is the program's heap).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_gc_heap() -> int:
    """Collect once, then freeze everything alive out of later collections; the objects frozen
    so far (``gc.get_freeze_count()``). ``gc.unfreeze()`` undoes it."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def gc_heap_frozen() -> Iterator[int]:
    """:func:`freeze_gc_heap` for the block, ``gc.unfreeze()`` after it: a run inside a process
    that goes on (a command called in-process, a benchmark's rounds) leaves its heap collectable."""
    count = freeze_gc_heap()
    try:
        yield count
    finally:
        gc.unfreeze()
