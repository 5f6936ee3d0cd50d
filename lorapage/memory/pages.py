"""Which pool pages are free: the allocator, without the pool's tensor (no torch).

KV blocks take single pages from the high end; adapters take the lowest contiguous run that
fits (so their reads are zero-copy views of the pool) and scattered pages otherwise. Page 0 is
never handed out. :class:`~lorapage.memory.pool.PagePool` is this allocator over one
preallocated tensor; the residency rules (:mod:`lorapage.adapters.residency`) and the simulator
use the allocator alone.
"""

from __future__ import annotations

from enum import Enum

import numpy as np


class PageKind(Enum):
    """Who holds a page: a sequence's KV block, or a resident adapter."""

    KV = "kv"
    ADAPTER = "adapter"


class PageAllocator:
    """A free map over ``num_pages`` pages (page 0 reserved) and the count each kind holds."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"the pool needs at least 2 pages (page 0 is reserved); got {num_pages}")
        self.num_pages = num_pages
        self._free = np.ones(num_pages, dtype=bool)
        self._free[0] = False
        self._num_free = num_pages - 1
        self.used = {PageKind.KV: 0, PageKind.ADAPTER: 0}

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (all but the reserved page 0)."""
        return self.num_pages - 1

    def allocate(self, n: int, kind: PageKind) -> list[int] | None:
        """``n`` pages for ``kind``, or ``None`` (nothing taken) when fewer than ``n`` are free."""
        if n > self._num_free:
            return None
        if n == 0:
            return []
        free = np.flatnonzero(self._free)
        if kind is PageKind.KV:
            pages = free[-n:]
        else:
            pages = self._first_run(free, n)
        self._free[pages] = False
        self._num_free -= n
        self.used[kind] += n
        return pages.tolist()

    def free(self, pages: list[int], kind: PageKind) -> None:
        """Give ``pages`` back. Freeing a page twice is a bug and raises."""
        if not pages:
            return
        idx = np.asarray(pages, dtype=np.int64)
        if self._free[idx].any() or (idx == 0).any():
            raise RuntimeError(f"double free or reserved page in {pages}")
        self._free[idx] = True
        self._num_free += len(pages)
        self.used[kind] -= len(pages)

    @staticmethod
    def _first_run(free: np.ndarray, n: int) -> np.ndarray:
        """The lowest run of ``n`` consecutive free pages, or the ``n`` lowest free pages."""
        if n > 1:
            breaks = np.flatnonzero(np.diff(free) != 1)
            starts = np.concatenate(([0], breaks + 1))
            ends = np.concatenate((breaks + 1, [len(free)]))
            fits = np.flatnonzero(ends - starts >= n)
            if len(fits):
                s = starts[fits[0]]
                return free[s : s + n]
        return free[:n]
