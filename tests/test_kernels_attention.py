"""Triton KV write and paged decode attention against the PyTorch references.

Interpreted on CPU when there is no CUDA (see ``kernels/backend.py``), compiled otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lorapage.kernels import paged_decode_attention_ref, write_kv_ref
from lorapage.kernels.triton_import import triton_available

if not triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)

from lorapage.kernels.attention_triton import paged_decode_attention, write_kv  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "an output entry was never written"
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


def make_rows(gen: np.random.Generator, num_rows: int, max_len: int, block_size: int, num_pages: int):
    """Context lengths and block tables whose pages are scattered over the pool (page 0 unused)."""
    lens = gen.integers(1, max_len + 1, num_rows)
    width = -(-max_len // block_size) + 2
    table = np.zeros((num_rows, width), np.int32)
    free = gen.permutation(np.arange(1, num_pages))
    for b, n in enumerate(lens):
        need = -(-int(n) // block_size)
        table[b, :need], free = free[:need], free[need:]
    return torch.from_numpy(lens.astype(np.int32)), torch.from_numpy(table)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_paged_decode_attention(heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    gen = np.random.default_rng(heads * 10 + kv_heads)
    torch.manual_seed(heads)
    block_size, dim, num_pages, B = 4, 16, 40, 5
    lens, table = make_rows(gen, B, 22, block_size, num_pages)
    kv = torch.randn(num_pages, 2, block_size, kv_heads, dim).to(dtype).to(DEVICE)
    q_wide = torch.randn(B + 2, heads, dim).to(dtype).to(DEVICE)
    q = q_wide[1 : B + 1]
    table_wide = torch.zeros(B + 1, table.shape[1] + 3, dtype=torch.int32)
    table_wide[1:, : table.shape[1]] = table
    block_table = table_wide.to(DEVICE)[1:, : table.shape[1]]  # a row-strided slice, as the runner passes
    lens = lens.to(DEVICE)
    ref = torch.full((B, heads, dim), float("nan"), dtype=dtype, device=DEVICE)
    out = ref.clone()
    paged_decode_attention_ref(ref, q, kv, block_table, lens, dim**-0.5)
    paged_decode_attention(out, q, kv, block_table, lens, dim**-0.5)
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv(dtype: torch.dtype) -> None:
    gen = np.random.default_rng(7)
    torch.manual_seed(7)
    num_pages, block_size, kv_heads, dim, T = 12, 4, 2, 16, 9
    kv_ref = torch.full((num_pages, 2, block_size, kv_heads, dim), float("nan"), dtype=dtype, device=DEVICE)
    kv_out = kv_ref.clone()
    qkv = torch.randn(T, 3 * kv_heads * dim).to(dtype).to(DEVICE)  # k and v as strided slices of a fused output
    k = qkv[:, kv_heads * dim : 2 * kv_heads * dim].view(T, kv_heads, dim)
    v = qkv[:, 2 * kv_heads * dim :].view(T, kv_heads, dim)
    slots = torch.from_numpy(gen.choice(np.arange(block_size, num_pages * block_size), T, replace=False)).to(DEVICE)
    write_kv_ref(kv_ref, k, v, slots)
    write_kv(kv_out, k, v, slots)
    assert torch.equal(kv_out.isnan(), kv_ref.isnan())
    assert torch.equal(kv_out.nan_to_num(), kv_ref.nan_to_num())


def test_decode_reads_what_write_kv_wrote() -> None:
    """A decode step end to end on the Triton path: write this token's K/V, then attend."""
    torch.manual_seed(3)
    num_pages, block_size, kv_heads, heads, dim = 8, 4, 2, 4, 16
    kv = torch.randn(num_pages, 2, block_size, kv_heads, dim, device=DEVICE)
    block_table = torch.tensor([[3, 5, 0], [6, 0, 0]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([6, 1], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([5 * block_size + 1, 6 * block_size], dtype=torch.int64, device=DEVICE)
    k, v = torch.randn(2, kv_heads, dim, device=DEVICE), torch.randn(2, kv_heads, dim, device=DEVICE)
    q = torch.randn(2, heads, dim, device=DEVICE)
    kv_ref = kv.clone()
    write_kv(kv, k, v, slots)
    write_kv_ref(kv_ref, k, v, slots)
    out, ref = torch.empty_like(q), torch.empty_like(q)
    paged_decode_attention(out, q, kv, block_table, lens, 0.25)
    paged_decode_attention_ref(ref, q, kv_ref, block_table, lens, 0.25)
    assert rel_err(out, ref) < 1e-5
    # A one-token context attends only to itself: the output is that token's V.
    assert torch.allclose(out[1], v[1].repeat_interleave(heads // kv_heads, dim=0), atol=1e-6)
