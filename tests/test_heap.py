"""The startup heap frozen out of the oldest generation's collections (lorapage/heap.py): what is
alive then is left alone by the collector, what comes after is collected as usual, and a frozen
block leaves the heap collectable after it."""

from __future__ import annotations

import gc
import weakref

import pytest

import lorapage
from lorapage.heap import gc_heap_frozen


class Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def thawed():
    yield
    gc.unfreeze()


def test_freezing_moves_what_is_alive_out_of_collections():
    kept = [Node() for _ in range(100)]
    assert lorapage.freeze_gc_heap() > len(kept)
    assert sum(gc.get_count()) < gc.get_freeze_count()  # the generations hold little beside it


def test_a_cycle_alive_at_the_freeze_outlives_collections_until_the_block_ends():
    old = Node()
    alive = weakref.ref(old)
    with gc_heap_frozen() as frozen:
        assert frozen > 0
        del old
        gc.collect()
        assert alive() is not None  # frozen: no collection looks at it
        Node()  # made after the freeze and dropped: collected as usual
        assert gc.collect() >= 1
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None
