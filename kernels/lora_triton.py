"""Triton LoRA shrink and expand reading A and B straight from the pool's pages.

Same signatures and semantics as :mod:`lorapage.kernels.lora_ref`. Two launch shapes:

* **BGMV** (``indices.segment_table is None``): one program per (token, tile); each token reads
  its own slot from ``token_slot``. The grid depends only on tensor shapes, so a captured decode
  graph stays valid whatever adapters the rows use next.
* **SGMV** (``segment_table`` set): one program per (segment, block of tokens, tile); tokens of a
  segment share their slot, so A and B tiles are read once per block and multiplied with
  ``tl.dot``. For prefill and mixed steps (eager).

Every matrix is read through the slot's page table. When the pages a program reads form one run
of consecutive page ids (the allocator's usual case) and the start is aligned, the tile is
addressed as a plain strided matrix (vector loads); otherwise each element's page is looked up.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lorapage.kernels.lora_ref import LoraIndices
from lorapage.kernels.lora_triton_kernels import (
    _bgmv_expand_kernel,
    _bgmv_shrink_kernel,
    _sgmv_expand_kernel,
    _sgmv_shrink_kernel,
)
from lorapage.kernels.triton_import import import_triton, triton_interpreted

triton = import_triton()

# Two interpreter quirks, worked around only when interpreting: its tl.dot mishandles bf16 (stored
# as uint16), so dots multiply in float32; its float32 -> bf16 cast truncates where the GPU rounds
# to nearest even, so stores round explicitly.
_INTERPRETED = triton_interpreted()
_MAX_MODULES = 3  # the largest projection group (q, k, v)
# BGMV tiles. Decode reads each adapter row once per token, so speed is memory parallelism: a
# shrink program takes a few A rows and a wide slice of d_in (16 KiB of bf16 in flight), which
# gives hundreds of programs even for one rank-16 module at batch 32.
BGMV_SHRINK_TILE = (2, 4096)  # (rows of A, columns of d_in) per program and step
BGMV_ROW_PROGRAMS = 24  # shrink programs per token; each takes every 24th block of rows
BGMV_EXPAND_BLOCK_N = 256  # output columns per program


# ---------------------------------------------------------------------------------------- shrink


# ---------------------------------------------------------------------------------------- expand


# -------------------------------------------------------------------------------------- launchers


def _block(limit: int, n: int, floor: int = 1) -> int:
    """The tile size: ``limit``, or the next power of two of ``n`` when that is smaller."""
    return max(floor, min(limit, triton.next_power_of_2(max(n, 1))))


def _check_common(out: Tensor, inp: Tensor, pool: Tensor, page_table: Tensor, indices: LoraIndices) -> None:
    T = inp.shape[0]
    assert out.dim() == 2 and inp.dim() == 2 and out.shape[0] == T, (
        f"rows differ: {tuple(out.shape)} vs {tuple(inp.shape)}"
    )
    assert out.stride(1) == 1 and inp.stride(1) == 1, "rows of the activations must be contiguous"
    floats = (torch.float16, torch.bfloat16, torch.float32)
    assert inp.dtype == out.dtype and inp.dtype in floats and pool.dtype in floats, (
        f"activations must share one float dtype and pages be floats; got {inp.dtype}, {out.dtype}, {pool.dtype}"
    )
    assert pool.dim() == 2 and pool.is_contiguous(), "pool must be one layer's contiguous slab [num_pages, page_size]"
    assert page_table.dim() == 2 and page_table.dtype == torch.int32 and page_table.stride(1) == 1
    slot = indices.token_slot
    assert slot.shape == (T,) and slot.dtype == torch.int32 and slot.is_contiguous(), "token_slot must be [T] int32"
    table = indices.segment_table
    if table is not None:
        assert table.shape == (len(indices.segments), 3) and table.dtype == torch.int32 and table.is_contiguous()
    devices = {t.device for t in (out, inp, pool, page_table, slot)}
    assert len(devices) == 1, f"all tensors must be on one device; got {devices}"


def _align(pool: Tensor) -> int:
    """Elements per 16-byte vector: the alignment the dense path needs to use vector loads."""
    return 16 // pool.element_size()


def lora_shrink(
    h: Tensor,
    x: Tensor,
    pool: Tensor,
    page_table: Tensor,
    indices: LoraIndices,
    a_offset: Tensor,
    a_rows: Tensor,
) -> None:
    """``h[t, :a_rows[s]] = x[t] @ A_s.T`` for every token t with slot ``s = token_slot[t] != 0``.

    Exactly :func:`lora_shrink_ref` (see there for ``A_s``); accumulates in float32. Shapes:
    h [T, R] with R >= every a_rows[s] used, x [T, d_in] (rows may be strided), pool
    [num_pages, page_size] contiguous, page_table [S, max_pages] int32 with ascending rows,
    a_offset [S] int64 and a_rows [S] int32 (strided views such as ``a_offset[l, :, g]`` are fine,
    with the same stride). BGMV when ``indices.segment_table`` is None, SGMV otherwise.
    """
    _check_common(h, x, pool, page_table, indices)
    assert a_offset.dim() == 1 and a_offset.dtype == torch.int64 and a_rows.dtype == torch.int32
    assert a_rows.shape == a_offset.shape == (page_table.shape[0],), "one a_offset / a_rows entry per slot"
    assert a_offset.stride() == a_rows.stride(), "a_offset and a_rows must be views with one stride"
    assert a_offset.device == a_rows.device == h.device, "tables must be on the activations' device"
    T, d_in = x.shape
    R = h.shape[1]
    if T == 0:
        return
    common = (d_in, h.stride(0), x.stride(0), page_table.stride(0), a_offset.stride(0))
    consts = dict(PAGE=pool.shape[1], ALIGN=_align(pool), INTERPRETED=_INTERPRETED)
    if indices.segment_table is None:
        block_r, block_k = BGMV_SHRINK_TILE
        bgmv_grid = (T, min(triton.cdiv(R, block_r), BGMV_ROW_PROGRAMS))
        _bgmv_shrink_kernel[bgmv_grid](
            h,
            x,
            pool,
            page_table,
            indices.token_slot,
            a_offset,
            a_rows,
            *common,
            **consts,
            BLOCK_R=block_r,
            BLOCK_K=_block(block_k, d_in),
            num_warps=8,
        )
        return
    if not indices.segments:
        return
    longest = max(end - start for start, end, _ in indices.segments)
    block_t = _block(32, longest, floor=16)
    grid = (len(indices.segments), triton.cdiv(longest, block_t), triton.cdiv(R, 16))
    _sgmv_shrink_kernel[grid](
        h,
        x,
        pool,
        page_table,
        indices.segment_table,
        a_offset,
        a_rows,
        *common,
        **consts,
        BLOCK_T=block_t,
        BLOCK_R=16,
        BLOCK_K=_block(64, d_in, 16),
    )


def lora_expand(
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

    Exactly :func:`lora_expand_ref` (see there for ``B_{s,m}``, ``r``, ``hs``, ``w_m``), all of
    the group's modules in one launch; accumulates in float32 and rounds once into y. Shapes:
    y [T, sum w_m], h [T, R], b_offset int64 / rank int32 / h_start int32 / scale float32, each
    [S, M] with M = len(out_start) <= 3 and one shared stride (views such as
    ``b_offset[l, :, m0:m1]`` are fine). BGMV when ``indices.segment_table`` is None, SGMV otherwise.
    """
    _check_common(y, h, pool, page_table, indices)
    M = len(out_start)
    assert 1 <= M <= _MAX_MODULES and out_start[0] == 0 and list(out_start) == sorted(out_start)
    assert out_start[-1] < y.shape[1], f"out_start {out_start} must lie inside y's {y.shape[1]} columns"
    shape = (page_table.shape[0], M)
    for name, t, dtype in (
        ("b_offset", b_offset, torch.int64),
        ("rank", rank, torch.int32),
        ("h_start", h_start, torch.int32),
        ("scale", scale, torch.float32),
    ):
        assert t.shape == shape and t.dtype == dtype, f"{name} must be {shape} {dtype}; got {tuple(t.shape)} {t.dtype}"
        assert t.stride() == b_offset.stride() and t.device == y.device, (
            f"{name} must share b_offset's stride and device"
        )
    T, N = y.shape
    if T == 0:
        return
    bounds = list(out_start) + [N]
    widths = [bounds[m + 1] - bounds[m] for m in range(M)]
    starts = list(out_start) + [0] * (_MAX_MODULES - M)
    widths_arg = widths + [0] * (_MAX_MODULES - M)
    strides = (y.stride(0), h.stride(0), page_table.stride(0), b_offset.stride(0), b_offset.stride(1))
    consts = dict(PAGE=pool.shape[1], ALIGN=_align(pool), INTERPRETED=_INTERPRETED)
    tables = (b_offset, rank, h_start, scale)
    if indices.segment_table is None:
        block_n = _block(BGMV_EXPAND_BLOCK_N, max(widths))
        n_blocks = triton.cdiv(max(widths), block_n)
        _bgmv_expand_kernel[(T, M * n_blocks)](
            y,
            h,
            pool,
            page_table,
            indices.token_slot,
            *tables,
            *starts,
            *widths_arg,
            n_blocks,
            *strides,
            **consts,
            BLOCK_N=block_n,
            BLOCK_RANK=16,
        )
        return
    if not indices.segments:
        return
    longest = max(end - start for start, end, _ in indices.segments)
    block_t = _block(32, longest, floor=16)
    block_n = _block(64, max(widths), floor=16)
    n_blocks = triton.cdiv(max(widths), block_n)
    grid = (len(indices.segments), triton.cdiv(longest, block_t), M * n_blocks)
    _sgmv_expand_kernel[grid](
        y,
        h,
        pool,
        page_table,
        indices.segment_table,
        *tables,
        *starts,
        *widths_arg,
        n_blocks,
        *strides,
        **consts,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_RANK=16,
    )
