"""The unified page pool: one preallocated tensor for every KV block and every resident adapter.

``storage[layer, page]`` is ``page_size`` elements. A page id spans all layers: a KV block owns
page p in every layer (its K and V for ``block_size`` positions), a resident adapter owns its
pages in every layer (that layer's A and B matrices). Page 0 is never handed out: padded rows
write to it and slot 0 / block 0 point at it. See docs/memory.md.

Adapters may be kept in a narrower dtype than KV (``--lora-dtype``): they see the same bytes as
``adapter_storage``, ``storage`` viewed in their dtype, so one page holds ``adapter_page_size``
of their elements (twice ``page_size`` for bfloat16 adapters in a float32 pool).
"""

from __future__ import annotations

from enum import Enum

import numpy as np
import torch


class PageKind(Enum):
    KV = "kv"
    ADAPTER = "adapter"


def adapter_page_size(page_size: int, dtype: torch.dtype, adapter_dtype: torch.dtype) -> int:
    """Adapter elements one page of ``page_size`` ``dtype`` elements holds."""
    if dtype.itemsize % adapter_dtype.itemsize:
        raise ValueError(f"adapter pages in {adapter_dtype} cannot share a {dtype} pool: they must be no wider")
    return page_size * dtype.itemsize // adapter_dtype.itemsize


class PagePool:
    """The pool tensor plus the allocator that hands out its pages to KV blocks and adapters.

    KV blocks take single pages from the high end; adapters take contiguous runs from the low
    end when one exists (so their reads are zero-copy views) and scattered pages otherwise.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        adapter_dtype: torch.dtype | None = None,
    ) -> None:
        if num_pages < 2:
            raise ValueError(f"the pool needs at least 2 pages (page 0 is reserved); got {num_pages}")
        adapter_dtype = adapter_dtype or dtype
        self.adapter_page_size = adapter_page_size(page_size, dtype, adapter_dtype)
        self.num_pages = num_pages
        self.page_size = page_size
        self.storage = torch.zeros(num_layers, num_pages, page_size, dtype=dtype, device=device)
        # The same memory in the adapters' dtype: [num_layers, num_pages, adapter_page_size].
        self.adapter_storage = self.storage.view(adapter_dtype)
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
