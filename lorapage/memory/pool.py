"""The unified page pool: one preallocated tensor for every KV block and every resident adapter.

``storage[layer, page]`` is ``page_size`` elements. A page id spans all layers: a KV block owns
page p in every layer (its K and V for ``block_size`` positions), a resident adapter owns its
pages in every layer (that layer's A and B matrices). Page 0 is never handed out: padded rows
write to it and slot 0 / block 0 point at it. See docs/memory.md.

Adapters may be kept in a narrower dtype than KV (``--lora-dtype``): they see the same bytes as
``adapter_storage``, ``storage`` viewed in their dtype, so one page holds ``adapter_page_size``
of their elements (twice ``page_size`` for bfloat16 adapters in a float32 pool, four times for
int8 ones, whose pages also hold their scales). K and V may be
kept narrower too (``--kv-cache-dtype``): ``kv_storage`` is the same memory in their dtype, a page
``kv_page_size`` of their elements, so a float16 KV block of a float32 model takes half the bytes
(the pool's ``page_size`` is sized to the block: :func:`kv_page_elements`).
"""

from __future__ import annotations

import torch

from lorapage.memory.pages import PageAllocator


def adapter_page_size(page_size: int, dtype: torch.dtype, adapter_dtype: torch.dtype) -> int:
    """Adapter elements one page of ``page_size`` ``dtype`` elements holds."""
    if dtype.itemsize % adapter_dtype.itemsize:
        raise ValueError(f"adapter pages in {adapter_dtype} cannot share a {dtype} pool: they must be no wider")
    return page_size * dtype.itemsize // adapter_dtype.itemsize


def kv_page_elements(block_size: int, kv_size: int, dtype: torch.dtype, kv_dtype: torch.dtype) -> int:
    """``page_size``: the pool elements (``dtype``) that hold one KV block, K and V for
    ``block_size`` tokens of ``kv_size`` values each in ``kv_dtype``."""
    nbytes = 2 * block_size * kv_size * kv_dtype.itemsize
    if kv_dtype.itemsize > dtype.itemsize or nbytes % dtype.itemsize:
        raise ValueError(f"KV pages in {kv_dtype} cannot share a {dtype} pool: they must be no wider")
    return nbytes // dtype.itemsize


class PagePool(PageAllocator):
    """The pool tensor plus the allocator (:class:`~lorapage.memory.pages.PageAllocator`) that
    hands out its pages to KV blocks and adapters."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        adapter_dtype: torch.dtype | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_pages)
        adapter_dtype, kv_dtype = adapter_dtype or dtype, kv_dtype or dtype
        self.adapter_page_size = adapter_page_size(page_size, dtype, adapter_dtype)
        self.page_size = page_size
        self.storage = torch.zeros(num_layers, num_pages, page_size, dtype=dtype, device=device)
        # The same memory in the adapters' dtype: [num_layers, num_pages, adapter_page_size].
        self.adapter_storage = self.storage.view(adapter_dtype)
        # int8 adapter pages hold each matrix's per-row scales beside it (kernels/lora_int8.py).
        self.scaled_adapters = adapter_dtype == torch.int8
        # ... and in KV's: [num_layers, num_pages, kv_page_size], a page one KV block.
        self.kv_storage = self.storage.view(kv_dtype)
        self.kv_page_size = self.kv_storage.shape[-1]
