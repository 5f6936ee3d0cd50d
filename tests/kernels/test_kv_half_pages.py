"""Half-precision KV pages (kv_cache_dtype fp16 / bf16) under float32 queries: the KV write rounds
to the pages' dtype, and every attention path (the C kernel, the PyTorch reference, Triton
interpreted) widens what it reads and computes in float32, within float32's bound of the float64
attention over the same (rounded) K and V."""

from __future__ import annotations

import pytest
import torch
from numeric_bounds import assert_within, decode_attention
from test_attention_cpu import SHAPES, _gathered, _pool, _reference, lib  # noqa: F401 (lib: a fixture per ISA variant)

from lorapage.kernels.attention_cpu import decode_attention_c
from lorapage.kernels.attention_ref import paged_decode_attention_ref, prefill_attention_ref, write_kv_ref
from lorapage.kernels.cpu_build import cpu_kernels
from lorapage.kernels.triton_import import triton_available

HALVES = [torch.float16, torch.bfloat16]
LENS = [1, 5, 16, 17, 40]


def half_pool(dtype: torch.dtype, shape: str = "gqa"):
    heads, kv_heads, dim, block_size = SHAPES[shape]
    q, kv, table, lens = _pool(heads, kv_heads, dim, block_size, LENS)
    return q, kv.to(dtype), table, lens, dim**-0.5


@pytest.mark.parametrize("dtype", HALVES)
def test_write_kv_rounds_to_the_pages_dtype(dtype):
    kv = torch.zeros(3, 2, 4, 2, 8, dtype=dtype)
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([4, 5, 9, 10, 11])
    write_kv_ref(kv, k, v, slots)
    assert torch.equal(kv[:, 0].flatten(0, 1)[slots], k.to(dtype))
    assert torch.equal(kv[:, 1].flatten(0, 1)[slots], v.to(dtype))


@pytest.mark.skipif(cpu_kernels() is None, reason="the C kernels did not build here")
@pytest.mark.parametrize("threads", [1, 2])  # 5 rows: one task a row at 1 thread, a (row, KV head) at 2
@pytest.mark.parametrize("shape", ["gqa", "odd_head_dim"])
@pytest.mark.parametrize("dtype", HALVES)
def test_c_kernel_and_reference_over_half_pages_are_within_the_float32_bound(lib, dtype, shape, threads, monkeypatch):  # noqa: F811
    """Widening a half value to float32 is exact, so the float32 bound of float32 pages holding
    the same values applies unchanged."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    q, kv, table, lens, scale = half_pool(dtype, shape)
    k, v = _gathered(q, kv, table, lens)  # float64 copies of the rounded values
    want, bound = _reference(q, k, v, lens, scale), decode_attention(q, k, v, lens, scale)
    out = torch.full_like(q, float("nan"))
    assert decode_attention_c(lib, out, q, kv, table, lens, scale)
    assert_within(out, want, bound, f"C {dtype}")
    ref = torch.full_like(q, float("nan"))
    paged_decode_attention_ref(ref, q, kv, table, lens, scale)
    assert_within(ref, want, bound, f"reference {dtype}")


@pytest.mark.skipif(cpu_kernels() is None, reason="the C kernels did not build here")
@pytest.mark.parametrize("dtype", HALVES)
def test_c_kernel_equals_float32_pages_holding_the_rounded_values(lib, dtype):  # noqa: F811
    """Half pages and float32 pages with their values: the same widened rows (exact, vector or
    scalar conversion), the same sums."""
    q, kv, table, lens, scale = half_pool(dtype, "odd_head_dim")  # head dim 20: 8 + 8 + a tail of 4
    half, wide = torch.empty_like(q), torch.empty_like(q)
    assert decode_attention_c(lib, half, q, kv, table, lens, scale)
    assert decode_attention_c(lib, wide, q, kv.float(), table, lens, scale)
    assert torch.equal(half, wide)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("dtype", HALVES)
def test_triton_over_half_pages_matches_the_reference(dtype):
    from lorapage.kernels.attention_triton import paged_decode_attention, prefill_attention, write_kv

    q, kv, table, lens, scale = half_pool(dtype)
    kv = torch.nan_to_num(kv)  # prefill below reads whole pages' positions through masks
    written = kv.clone()
    k, v = torch.randn(3, *kv.shape[3:]), torch.randn(3, *kv.shape[3:])
    slots = torch.tensor([16, 17, 40])
    write_kv(written, k, v, slots)
    expect = kv.clone()
    write_kv_ref(expect, k, v, slots)
    assert torch.equal(written, expect)  # rounded to nearest even, as torch's cast
    out, ref = torch.full_like(q, float("nan")), torch.empty_like(q)
    paged_decode_attention(out, q, kv, table, lens, scale)
    paged_decode_attention_ref(ref, q, kv, table, lens, scale)
    assert float((out - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    # Prefill: each row's last 3 positions as new tokens over its context.
    n = [min(3, int(c)) for c in lens]
    starts = [0, *torch.tensor(n).cumsum(0).tolist()]
    qp = torch.randn(starts[-1], *q.shape[1:])
    out, ref = torch.full_like(qp, float("nan")), torch.empty_like(qp)
    prefill_attention(out, qp, kv, table, starts, lens.tolist(), scale)
    prefill_attention_ref(ref, qp, kv, table, starts, lens.tolist(), scale)
    assert float((out - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
