"""int8 adapter pages (``--lora-dtype int8``): each matrix quantized at load, symmetric, with one
float32 scale per rank row.

The row is a rank component: A ``[r, d_in]``'s row k, and B ``[d_out, r]``'s column k. A LoRA
delta is ``sum_k s * B[:, k] A[k, :]``, so each rank-1 term carries two scales, and

    A ~ a_scale[:, None] * qA,    B ~ qBt.T * b_scale[None, :]

with ``q = round(w / scale)`` in [-127, 127] and ``scale = max |w| / 127`` over the row (0 for a
row of zeros). B is stored transposed, ``qBt`` ``[r, d_out]``: both matrices are then r rows of
int8 with one scale each, read contiguously. Why these axes: the shrink ``h_k = a_scale_k *
(qA[k] . x)`` applies each A row's scale once to its sum; the expand folds B's scales into h
(``y[j] += sum_k qBt[k, j] * (s * b_scale_k * h_k)``), so for a block of outputs it adds r int8 rows
times a broadcast value each, with no horizontal sums and r scales (a scale per output row of a
``[d_out, r]`` B would read 4 more bytes per 16 at rank 16). Each weight is off by at most half
its row's step: ``|w - scale * q| <= scale / 2``.

In an adapter's flat buffer (:mod:`lorapage.adapters.layout`) each matrix's int8 values are
padded to a multiple of 4 bytes and followed by its scales as float32 bytes: the scales of the
matrix at ``offset`` with ``numel`` values start at :func:`scales_at` ``(offset, numel)``. Every
offset is then a multiple of 4 (pages are too: a page of a float32 pool is 4 * page_size int8
values), so a scale never straddles a page. The lookup tables are the same as for other dtypes:
``b_offset`` points at qBt.
"""

from __future__ import annotations

import torch
from torch import Tensor

QMAX = 127
SCALE_BYTES = 4  # one float32 scale, in int8 elements


def padded(numel: int) -> int:
    """``numel`` int8 values rounded up to a whole number of scales (4-byte words)."""
    return -(-numel // SCALE_BYTES) * SCALE_BYTES


def scales_at(offset: int, numel: int) -> int:
    """Where the scales of the int8 matrix at ``offset`` (``numel`` values) start."""
    return offset + padded(numel)


def quantize_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """``w`` [rows, cols] as (int8 values [rows, cols], float32 scale per row [rows]), symmetric
    and rounded to nearest: ``w[i] ~ scale[i] * q[i]``."""
    w = w.to(torch.float32)
    scale = w.abs().amax(dim=1) / QMAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def quantize_pair(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A [r, d_in] and B [d_out, r] as int8 with a scale per rank row (module docstring):
    ``(qA, a_scale, qBt, b_scale)``, qBt [r, d_out] (B transposed, as int8 pages hold it)."""
    qa, sa = quantize_rows(a)
    qbt, sb = quantize_rows(b.t())
    return qa, sa, qbt, sb


def dequantize_pair(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """What int8 pages hold of A and B, as float32: each weight rounded as :func:`quantize_pair` rounds it."""
    qa, sa, qbt, sb = quantize_pair(a, b)
    return qa.float() * sa[:, None], qbt.float().t() * sb[None, :]


def as_bytes(scales: Tensor) -> Tensor:
    """float32 scales as the int8 elements of a page (their bytes, native order)."""
    return scales.to(torch.float32).contiguous().view(torch.int8)


def scales_of(span: Tensor) -> Tensor:
    """The float32 scales in an int8 ``span`` [..., 4 * n] of pages (a copy when not 4-aligned in memory)."""
    if span.stride(-1) != 1 or span.data_ptr() % SCALE_BYTES or any(s % SCALE_BYTES for s in span.stride()[:-1]):
        span = span.contiguous()
    return span.view(torch.float32)
