"""PyTorch reference of the LoRA gather ops (shrink and expand) that read adapters from pool pages.

Layout (see docs/memory.md): a resident adapter in slot ``s`` owns the pages
``page_table[s, :n]``. Read in that order, the pages of one layer's slab form the adapter's flat
per-layer buffer ``flat_s``. Inside it, each projection group (qkv, o, gate_up, down) has its
stacked A matrix ``[sum of the group's ranks, d_in]`` at ``a_offset[s]`` and each module's B
matrix ``[d_out_m, r_m]`` at ``b_offset[s, m]``. Slot 0 means "no adapter": its tokens are skipped.

These references are what runs on CPU; the Triton launchers implement the same signatures.
Adapter pages may be narrower than the activations (``--lora-dtype``): weights are read in the
pool's dtype and computed in the activations'. An int8 pool (``--lora-dtype int8``) holds each
matrix's per-row scales after it, and B transposed (:mod:`lorapage.kernels.lora_int8`): ``A_s`` and
``B_{s,m}`` below are then the int8 values times their scales.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from lorapage.kernels.lora_int8 import SCALE_BYTES, scales_at, scales_of
from lorapage.kernels.lora_plan import LoraBatch, LoraCells, plan_lora_batches, split_cells


@dataclass(frozen=True)
class LoraIndices:
    """Per-step indices shared by every layer's LoRA ops.

    ``token_slot[t]`` is the adapter slot of token t (0 = none). Tokens are ordered so that each
    slot's tokens form consecutive segments; ``segments`` lists them on the host as
    ``(start, end, slot)`` for the reference path and SGMV-style launches.
    """

    token_slot: Tensor  # [T] int32: adapter slot of token t (0 = no adapter)
    segments: tuple[tuple[int, int, int], ...]  # (start, end, slot) with slot != 0, host side
    # [len(segments), 3] int32 on the device: row i is segments[i] as (start, end, slot). None:
    # the Triton launchers run BGMV (one token per program, reads only token_slot: what a captured
    # decode graph uses); set: they run SGMV over these segments (eager prefill and mixed steps).
    segment_table: Tensor | None = None
    # The PyTorch ops' batches (lora_plan.py), planned once per step for every layer and module.
    # None: each op plans its own call.
    batches: tuple[LoraBatch, ...] | None = None
    # The C kernels' cells (short segments by adapter; lora_plan.py), planned once per step, with
    # ``batches`` then holding the long segments only. None: no C kernels this step.
    cells: LoraCells | None = None

    def with_segment_table(self) -> LoraIndices:
        """A copy carrying ``segment_table`` (one small host-to-device copy), for SGMV launches."""
        rows = list(self.segments) or [(0, 0, 0)]
        table = torch.tensor(rows, dtype=torch.int32).to(self.token_slot.device)
        return replace(self, segment_table=table[: len(self.segments)])

    def with_batches(self, page_table: Tensor, layout: tuple[Tensor, ...], pool: Tensor) -> LoraIndices:
        """A copy carrying ``batches`` for the PyTorch ops. ``layout``: the per-layer lookup tables
        (``[layers, slots, ...]``) whose rows must match for two slots to share a batch; ``pool``
        one layer's slab."""
        rows = [_host(t).swapaxes(0, 1) for t in layout]
        return replace(self, batches=plan_lora_batches(self.segments, page_table, rows, pool))

    def with_cells(self, page_table: Tensor, layout: tuple[Tensor, ...], pool: Tensor) -> LoraIndices:
        """A copy carrying ``cells`` for the C kernels and ``batches`` for the long segments
        (arguments as for :meth:`with_batches`)."""
        cells, long = split_cells(self.segments)
        rows = [_host(t).swapaxes(0, 1) for t in layout]
        return replace(self, cells=cells, batches=plan_lora_batches(long, page_table, rows, pool))


def page_span(pool: Tensor, pages: np.ndarray, offset: int, numel: int) -> Tensor:
    """Elements ``[offset, offset + numel)`` of the flat buffer formed by ``pool[pages]``.

    ``pages`` is one slot's row of the page table (ascending, as the allocator hands them out).
    A zero-copy view when the covering pages are one contiguous run (the usual case: the
    allocator prefers runs for adapters); a gathered copy when the pool is fragmented.
    """
    page_size = pool.shape[1]
    first, last = offset // page_size, (offset + numel - 1) // page_size
    p0, p1 = int(pages[first]), int(pages[last])
    if p1 - p0 == last - first:
        flat = pool[p0 : p1 + 1].reshape(-1)
    else:
        run = torch.from_numpy(pages[first : last + 1].astype(np.int64)).to(pool.device)
        flat = pool.index_select(0, run).reshape(-1)  # pool[run] over a numpy-backed index took ~15 ms on a big pool
    start = offset - first * page_size
    return flat[start : start + numel]


def _scales(pool: Tensor, pages: np.ndarray, offset: int, numel: int, n: int) -> Tensor:
    """The ``n`` float32 scales of the int8 matrix at ``offset`` (``numel`` values) of a slot's buffer."""
    return scales_of(page_span(pool, pages, scales_at(offset, numel), SCALE_BYTES * n))


def _host(t: Tensor) -> np.ndarray:
    """A numpy view of a small lookup table (free on CPU; one copy per call on a GPU)."""
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


def lora_shrink_ref(
    h: Tensor,
    x: Tensor,
    pool: Tensor,
    page_table: Tensor,
    indices: LoraIndices,
    a_offset: Tensor,
    a_rows: Tensor,
) -> None:
    """``h[t, :a_rows[s]] = x[t] @ A_s.T`` for every token t with slot ``s = token_slot[t] != 0``.

    ``A_s = flat_s[a_offset[s] : a_offset[s] + a_rows[s] * d_in].view(a_rows[s], d_in)``.
    Shapes: h [T, R], x [T, d_in], pool [num_pages, page_size], page_table [S, max_pages],
    a_offset [S] int64, a_rows [S] int32. Columns of h past ``a_rows[s]`` are left as they are.
    """
    if not indices.segments:
        return
    d_in = x.shape[1]
    offsets, rows = a_offset.tolist(), a_rows.tolist()
    pages = _host(page_table)
    for start, end, slot in indices.segments:
        r = rows[slot]
        if r == 0:
            continue
        a = page_span(pool, pages[slot], offsets[slot], r * d_in).view(r, d_in).to(x.dtype)
        if pool.dtype == torch.int8:
            a = a * _scales(pool, pages[slot], offsets[slot], r * d_in, r).to(x.dtype)[:, None]
        h[start:end, :r] = x[start:end] @ a.t()


def lora_expand_ref(
    y: Tensor,
    h: Tensor,
    pool: Tensor,
    page_table: Tensor,
    indices: LoraIndices,
    b_offset: Tensor,
    rank: Tensor,
    h_start: Tensor,
    scale: Tensor,
    out_start: tuple[int, ...],
) -> None:
    """``y[t, o_m:o_m+w_m] += scale[s, m] * h[t, hs:hs+r] @ B_{s,m}.T`` for each module m of the group.

    ``B_{s,m} = flat_s[b_offset[s, m] : b_offset[s, m] + w_m * r].view(w_m, r)`` with
    ``r = rank[s, m]``, ``hs = h_start[s, m]``, ``o_m = out_start[m]`` and ``w_m`` the width up to
    the next module's start (or the end of y). Modules with rank 0 in a slot are skipped.
    Shapes: y [T, sum w_m], h [T, R], b_offset/rank/h_start/scale [S, M] for the group's M modules.
    """
    if not indices.segments:
        return
    bounds = list(out_start) + [y.shape[1]]
    offsets, ranks, starts, scales = b_offset.tolist(), rank.tolist(), h_start.tolist(), scale.tolist()
    pages = _host(page_table)
    for start, end, slot in indices.segments:
        for m, r in enumerate(ranks[slot]):
            if r == 0:
                continue
            width = bounds[m + 1] - bounds[m]
            b = page_span(pool, pages[slot], offsets[slot][m], width * r)
            if pool.dtype == torch.int8:  # stored transposed
                b = b.view(r, width).t().to(y.dtype) * _scales(pool, pages[slot], offsets[slot][m], width * r, r)
            b = b.view(width, r).to(y.dtype)
            hs = starts[slot][m]
            y[start:end, bounds[m] : bounds[m + 1]].addmm_(h[start:end, hs : hs + r], b.t(), alpha=scales[slot][m])
