"""Batched PyTorch LoRA ops for the CPU path: one ``bmm`` per batch of adapters, not one ``mm`` per segment.

Same signatures and results as :mod:`lorapage.kernels.lora_ref`. The batches come from
:func:`~lorapage.kernels.lora_plan.plan_lora_batches`: the runner plans them once per step over
the whole lookup tables (``LoraIndices.batches``), so every layer and module reuses them; a caller
without a plan gets one made for that call from the tables it passes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lorapage.kernels.lora_int8 import SCALE_BYTES, scales_at, scales_of
from lorapage.kernels.lora_plan import LoraBatch, plan_lora_batches
from lorapage.kernels.lora_ref import LoraIndices, _host


def _batches(indices: LoraIndices, page_table: Tensor, pool: Tensor, *tables: Tensor) -> tuple[LoraBatch, ...]:
    if indices.batches is not None:
        return indices.batches
    return plan_lora_batches(indices.segments, page_table, [_host(t) for t in tables], pool)


def _weights(batch: LoraBatch, pool: Tensor, offset: int, rows: int, cols: int, b: bool, dtype) -> Tensor:
    """``[cells, rows, cols]``: the matrix at ``offset`` of each cell's buffer in ``dtype``; from
    int8 pages, times its scales (kernels/lora_int8.py): A's one per row, B's (``b``, stored
    transposed) one per column."""
    if pool.dtype != torch.int8:
        return batch.matrices(pool, offset, rows, cols).to(dtype)  # pages may be narrower
    n = cols if b else rows
    s = scales_of(batch.matrices(pool, scales_at(offset, rows * cols), 1, SCALE_BYTES * n)).to(dtype)  # [cells, 1, n]
    if b:
        return batch.matrices(pool, offset, cols, rows).transpose(1, 2).to(dtype) * s
    return batch.matrices(pool, offset, rows, cols).to(dtype) * s.transpose(1, 2)


def lora_shrink_torch(
    h: Tensor, x: Tensor, pool: Tensor, page_table: Tensor, indices: LoraIndices, a_offset: Tensor, a_rows: Tensor
) -> None:
    """Same as :func:`lora_shrink_ref`: ``h[t, :a_rows[s]] = x[t] @ A_s.T``, one ``bmm`` per batch."""
    offsets, group_rows = _host(a_offset), _host(a_rows)
    d_in = x.shape[1]
    for batch in _batches(indices, page_table, pool, a_offset, a_rows):
        r = int(group_rows[batch.rep])
        if not r:
            continue
        a = _weights(batch, pool, int(offsets[batch.rep]), r, d_in, False, x.dtype)
        rows = batch.alone
        if rows is not None:
            h[rows, :r] = x[rows] @ a[0].t()
        else:
            batch.write(h[:, :r], batch.rows_of(x) @ a.transpose(1, 2))


def lora_expand_torch(
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
    """Same as :func:`lora_expand_ref`: ``y[t, o_m:o_m+w_m] += scale[s, m] * h[t, hs:hs+r] @ B_{s,m}.T``,
    one ``bmm`` per module and batch."""
    offsets, ranks, starts = _host(b_offset), _host(rank), _host(h_start)
    bounds = list(out_start) + [y.shape[1]]
    for batch in _batches(indices, page_table, pool, b_offset, rank, h_start):
        rep = batch.rep
        rows = batch.alone  # one long segment: the reference's fused addmm_
        host_scales = _host(scale)[rep] if rows is not None else None
        scales = hb = None
        if rows is None:
            scales = scale.index_select(0, batch.slots).to(h.dtype)  # [cells, M]; holes: 0
            hb = batch.rows_of(h[:, : int((starts[rep] + ranks[rep]).max())])  # every module's rows, gathered once
        for m, r in enumerate(ranks[rep].tolist()):
            if r == 0:
                continue
            width, hs = bounds[m + 1] - bounds[m], int(starts[rep, m])
            b = _weights(batch, pool, int(offsets[rep, m]), width, r, True, y.dtype)
            out = y[:, bounds[m] : bounds[m + 1]]
            if rows is not None:
                assert host_scales is not None
                out[rows].addmm_(h[rows, hs : hs + r], b[0].t(), alpha=float(host_scales[m]))
            else:
                assert scales is not None and hb is not None
                batch.add_product(out, hb[..., hs : hs + r] * scales[:, m, None, None], b)
