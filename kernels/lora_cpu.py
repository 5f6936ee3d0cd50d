"""The CPU path's LoRA ops: short segments (decode rows) in the C kernels of ``lora_cpu.c``, long
ones (prefill) through the batched PyTorch ops of :mod:`lorapage.kernels.lora_torch`.

Same signatures and results as :mod:`lorapage.kernels.lora_ref`. The runner plans a step's cells
and batches once (``LoraIndices.with_cells``); a caller without a plan gets one made for that call.
The C kernels take float32 activations over float32, bfloat16, float16 or int8 pages (int8 with per-row
scales: kernels/lora_int8.py); other dtypes run the PyTorch ops for every segment.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
from torch import Tensor

from lorapage.kernels.cpu_build import WEIGHT_DTYPES, cpu_kernels
from lorapage.kernels.lora_plan import LoraCells, plan_lora_batches, split_cells
from lorapage.kernels.lora_ref import LoraIndices, _host
from lorapage.kernels.lora_torch import lora_expand_torch, lora_shrink_torch


def c_kernels_take(activations: torch.dtype, pages: torch.dtype) -> bool:
    """Whether the C kernels compute over these dtypes: float32 activations; float32, 16-bit or int8 pages."""
    return activations == torch.float32 and pages in WEIGHT_DTYPES


def _planned(indices: LoraIndices, page_table: Tensor, pool: Tensor, x: Tensor, *tables: Tensor) -> LoraIndices:
    """``indices`` with cells and batches for this call when the caller planned none (and the C
    kernels can take them: see :func:`c_kernels_take`, and built)."""
    if indices.cells is not None or indices.batches is not None:
        return indices
    if not c_kernels_take(x.dtype, pool.dtype) or cpu_kernels() is None:
        return indices
    cells, long = split_cells(indices.segments)
    return replace(indices, cells=cells, batches=plan_lora_batches(long, page_table, [_host(t) for t in tables], pool))


def _rows(t: Tensor) -> Tensor:
    """``t`` with unit stride along its rows' elements (the C loops index rows by a stride)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _cell_args(pool: Tensor, page_table: Tensor, cells: LoraCells) -> tuple[int, ...]:
    assert pool.stride(1) == 1 and page_table.dtype == torch.int32 and page_table.is_contiguous()
    return (pool.data_ptr(), pool.stride(0), pool.shape[1], page_table.data_ptr(), page_table.stride(0), *cells.args)


def _kernel(op: str, pool: Tensor, *activations: Tensor):
    """The C function of ``op`` for ``pool``'s page dtype."""
    assert all(c_kernels_take(t.dtype, pool.dtype) for t in activations), f"no C kernels for {pool.dtype} pages"
    lib = cpu_kernels()
    assert lib is not None
    return getattr(lib, f"lora_{op}_{WEIGHT_DTYPES[pool.dtype]}")


def _group_tables(a_offset: Tensor, a_rows: Tensor, b: tuple[Tensor, ...], out_start: tuple[int, ...], y_width: int):
    """The group call's table arguments (after the cells): made once per group and kept on its
    ``a_offset`` view (LoraTables.group_views makes each view once, and only writes into the tables),
    checked when made. A decode step makes 16 of these calls: ~3 us of Python each, saved."""
    kept = a_offset.__dict__.get("_c_group")
    if kept is not None and kept[0] is b[0] and kept[1] == (out_start, y_width):
        return kept[2]
    b_offset, rank, h_start, scale = b
    assert a_offset.dtype == torch.int64 and a_rows.dtype == torch.int32
    assert [t.dtype for t in b] == [torch.int64, torch.int32, torch.int32, torch.float32]
    assert all(t.stride() == b_offset.stride() for t in b) and b_offset.stride(1) == 1
    args = (
        a_offset.data_ptr(),
        a_offset.stride(0),
        a_rows.data_ptr(),
        a_rows.stride(0),
        len(out_start),
        _bounds(out_start, y_width).data_ptr(),
        *(t.data_ptr() for t in b),
        b_offset.stride(0),
    )
    a_offset.__dict__["_c_group"] = (b_offset, (out_start, y_width), args)
    return args


@functools.cache
def _bounds(out_start: tuple[int, ...], width: int) -> Tensor:
    """Each module's first output column, then the end: made once per group shape."""
    return torch.tensor([*out_start, width], dtype=torch.int64)


def lora_shrink_cpu(
    h: Tensor, x: Tensor, pool: Tensor, page_table: Tensor, indices: LoraIndices, a_offset: Tensor, a_rows: Tensor
) -> None:
    """Same as :func:`lora_shrink_ref`: ``h[t, :a_rows[s]] = x[t] @ A_s.T``."""
    indices = _planned(indices, page_table, pool, x, a_offset, a_rows)
    if (cells := indices.cells) is not None:
        assert h.stride(1) == 1 and a_offset.dtype == torch.int64 and a_rows.dtype == torch.int32
        x = _rows(x)
        d_in = x.shape[1]
        _kernel("shrink", pool, h, x)(
            h.data_ptr(),
            h.stride(0),
            x.data_ptr(),
            x.stride(0),
            d_in,
            *_cell_args(pool, page_table, cells),
            a_offset.data_ptr(),
            a_offset.stride(0),
            a_rows.data_ptr(),
            a_rows.stride(0),
            h.shape[1],  # the most rows an A has
            torch.get_num_threads(),
        )
    if indices.batches != ():  # the long segments
        lora_shrink_torch(h, x, pool, page_table, indices, a_offset, a_rows)


def lora_expand_cpu(
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
    """Same as :func:`lora_expand_ref`: ``y[t, o_m:o_m+w_m] += scale[s, m] * h[t, hs:hs+r] @ B_{s,m}.T``."""
    indices = _planned(indices, page_table, pool, y, b_offset, rank, h_start)
    if (cells := indices.cells) is not None:
        assert y.stride(1) == 1 and h.stride(1) == 1
        tables = (b_offset, rank, h_start, scale)
        assert [t.dtype for t in tables] == [torch.int64, torch.int32, torch.int32, torch.float32]
        assert all(t.stride() == b_offset.stride() for t in tables) and b_offset.stride(1) == 1
        bounds = _bounds(out_start, y.shape[1])
        _kernel("expand", pool, y, h)(
            y.data_ptr(),
            y.stride(0),
            h.data_ptr(),
            h.stride(0),
            *_cell_args(pool, page_table, cells),
            len(out_start),
            bounds.data_ptr(),
            b_offset.data_ptr(),
            rank.data_ptr(),
            h_start.data_ptr(),
            scale.data_ptr(),
            b_offset.stride(0),
            h.shape[1],  # the highest rank a B has
            torch.get_num_threads(),
        )
    if indices.batches != ():  # the long segments
        lora_expand_torch(y, h, pool, page_table, indices, b_offset, rank, h_start, scale, out_start)


def lora_group_cpu(
    y: Tensor,
    h: Tensor,
    x: Tensor,
    pool: Tensor,
    page_table: Tensor,
    indices: LoraIndices,
    a_offset: Tensor,
    a_rows: Tensor,
    b_offset: Tensor,
    rank: Tensor,
    h_start: Tensor,
    scale: Tensor,
    out_start: tuple[int, ...],
    threads: int | None = None,
) -> None:
    """:func:`lora_shrink_cpu` then :func:`lora_expand_cpu` of one group, the short segments in one
    C call (``lora_group``): half the crossings from Python a layer, and h is written and read
    within the call. Same result as the two. ``threads``: the C call's (default: torch's intra-op
    threads; :mod:`lorapage.kernels.lora_side` runs it on one, beside the forward)."""
    if indices.cells is None and indices.batches is None:  # unplanned (a caller outside the runner)
        lora_shrink_cpu(h, x, pool, page_table, indices, a_offset, a_rows)
        lora_expand_cpu(y, h, pool, page_table, indices, b_offset, rank, h_start, scale, out_start)
        return
    if (cells := indices.cells) is not None:
        assert h.stride(1) == 1 and y.stride(1) == 1
        x = _rows(x)
        _kernel("group", pool, y, h, x)(
            y.data_ptr(),
            y.stride(0),
            h.data_ptr(),
            h.stride(0),
            x.data_ptr(),
            x.stride(0),
            x.shape[1],
            *_cell_args(pool, page_table, cells),
            *_group_tables(a_offset, a_rows, (b_offset, rank, h_start, scale), out_start, y.shape[1]),
            h.shape[1],  # the highest rank: h's width, the most rows an A has
            torch.get_num_threads() if threads is None else threads,
        )
    if indices.batches != ():  # the long segments
        lora_shrink_torch(h, x, pool, page_table, indices, a_offset, a_rows)
        lora_expand_torch(y, h, pool, page_table, indices, b_offset, rank, h_start, scale, out_start)
