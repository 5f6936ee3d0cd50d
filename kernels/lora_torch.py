"""Batched PyTorch LoRA ops for the CPU path: one ``bmm`` per group instead of one ``mm`` per segment.

Same signatures and results as :mod:`lorapage.kernels.lora_ref`. When a step's segments are
consecutive and of one length (every decode step: one token per sequence) and their slots share a
layout (same ranks and offsets, the common case of adapters trained with one recipe), each
group's A matrices (and each module's B matrices) of all segments are taken as one
``[n, rows, cols]`` tensor: a strided view of the pool when the adapters sit at one page stride
(adapters loaded one after another into runs), a stacked copy otherwise. Anything else falls back
to the per-segment reference.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from lorapage.kernels.lora_ref import LoraIndices, _host, lora_expand_ref, lora_shrink_ref, page_span


def _uniform_run(segments: tuple[tuple[int, int, int], ...]) -> tuple[int, int, int, np.ndarray] | None:
    """(first token, segment count, segment length, slots) when the segments are back to back
    and of one length; None otherwise."""
    start0, end0, _ = segments[0]
    length = end0 - start0
    for i, (start, end, _) in enumerate(segments):
        if start != start0 + i * length or end - start != length:
            return None
    return start0, len(segments), length, np.fromiter((s for _, _, s in segments), dtype=np.int64)


def _matrices(pool: Tensor, pages: np.ndarray, slots: np.ndarray, offset: int, rows: int, cols: int) -> Tensor:
    """``[n, rows, cols]``: the matrix at ``offset`` of each slot's flat page buffer."""
    page_size = pool.shape[1]
    numel = rows * cols
    first, last = offset // page_size, (offset + numel - 1) // page_size
    p_first, p_last = pages[slots, first].astype(np.int64), pages[slots, last].astype(np.int64)
    starts = p_first * page_size + (offset - first * page_size)
    if (p_last - p_first == last - first).all():
        steps = np.diff(starts)
        if len(slots) == 1 or ((steps == steps[0]).all() and steps[0] > 0):
            stride = int(steps[0]) if len(slots) > 1 else numel
            return pool.as_strided((len(slots), rows, cols), (stride, cols, 1), pool.storage_offset() + int(starts[0]))
    return torch.stack([page_span(pool, pages[s], offset, numel).view(rows, cols) for s in slots])


def _same(values: np.ndarray) -> bool:
    return bool((values == values[0]).all())


def lora_shrink_torch(
    h: Tensor, x: Tensor, pool: Tensor, page_table: Tensor, indices: LoraIndices, a_offset: Tensor, a_rows: Tensor
) -> None:
    """Same as :func:`lora_shrink_ref`, batched over segments when the batch is uniform."""
    run = _uniform_run(indices.segments) if indices.segments else None
    if run is not None:
        start, n, length, slots = run
        offsets, rows = _host(a_offset)[slots], _host(a_rows)[slots]
        if _same(offsets) and _same(rows):
            r, d_in = int(rows[0]), x.shape[1]
            if r:
                a = _matrices(pool, _host(page_table), slots, int(offsets[0]), r, d_in)
                xs = x[start : start + n * length].view(n, length, d_in)
                h[start : start + n * length, :r] = torch.bmm(xs, a.transpose(1, 2)).view(n * length, r)
            return
    lora_shrink_ref(h, x, pool, page_table, indices, a_offset, a_rows)


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
    """Same as :func:`lora_expand_ref`, batched over segments when the batch is uniform."""
    run = _uniform_run(indices.segments) if indices.segments else None
    if run is None:
        return lora_expand_ref(y, h, pool, page_table, indices, b_offset, rank, h_start, scale, out_start)
    start, n, length, slots = run
    offsets, ranks, starts = _host(b_offset)[slots], _host(rank)[slots], _host(h_start)[slots]
    if not (_same(offsets) and _same(ranks) and _same(starts)):
        return lora_expand_ref(y, h, pool, page_table, indices, b_offset, rank, h_start, scale, out_start)
    bounds = list(out_start) + [y.shape[1]]
    pages = _host(page_table)
    scales = scale[torch.from_numpy(slots).to(scale.device)].to(h.dtype)  # [n, M]
    rows = slice(start, start + n * length)
    for m, r in enumerate(ranks[0].tolist()):
        if r == 0:
            continue
        width, hs = bounds[m + 1] - bounds[m], int(starts[0, m])
        b = _matrices(pool, pages, slots, int(offsets[0, m]), width, r)
        hm = h[rows, hs : hs + r].view(n, length, r) * scales[:, m, None, None]
        y[rows, bounds[m] : bounds[m + 1]] += torch.bmm(hm, b.transpose(1, 2)).view(n * length, width)
