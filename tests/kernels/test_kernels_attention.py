"""Triton KV write, paged decode attention and paged prefill attention against the PyTorch references.

Interpreted on CPU when there is no CUDA (see ``kernels/backend.py``), compiled otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lorapage.kernels import paged_decode_attention_ref, prefill_attention_ref, write_kv_ref
from lorapage.kernels.triton_import import triton_available

if not triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)

from lorapage.kernels.attention_triton import (  # noqa: E402
    PREFILL_BLOCK_N,
    paged_decode_attention,
    prefill_attention,
    write_kv,
)

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


# (new tokens, context length) of the sequences of one prefill launch.
PREFILL_CASES = {
    # Whole prompts: one token, a few, and one spanning several query tiles and context blocks.
    "whole_prompts": ((1, 1), (5, 5), (PREFILL_BLOCK_N + 7, PREFILL_BLOCK_N + 7)),
    # Chunks after a prefix already in the pages: one token, a few, and a chunk past a block edge.
    "chunks_after_prefix": ((1, 9), (3, 40), (17, PREFILL_BLOCK_N + 11)),
    "mixed": ((6, 6), (2, 13), (1, 1)),
}


def scattered_tables(gen: np.random.Generator, lens: list[int], block_size: int, num_pages: int) -> torch.Tensor:
    """A block table per sequence, pages drawn in random order (neither ascending nor adjacent)."""
    width = max(-(-n // block_size) for n in lens) + 1
    table = np.zeros((len(lens), width), np.int32)
    free = gen.permutation(np.arange(1, num_pages))
    for i, n in enumerate(lens):
        need = -(-n // block_size)
        table[i, :need], free = free[:need], free[need:]
    return torch.from_numpy(table)


def poison_past_contexts(kv: torch.Tensor, table: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """``kv`` with NaN in every slot no sequence's context covers: free pages, page 0, and the
    tail of each sequence's last page (stale K/V of an earlier request)."""
    block_size = kv.shape[2]
    live = torch.zeros(kv.shape[0], block_size, dtype=torch.bool)
    for i, n in enumerate(lens):
        for pos in range(n):
            live[int(table[i, pos // block_size]), pos % block_size] = True
    return kv.masked_fill(~live[:, None, :, None, None].to(kv.device), float("nan"))


def prefill_inputs(case: str, heads: int, kv_heads: int, dtype: torch.dtype, seed: int):
    gen = np.random.default_rng(seed)
    torch.manual_seed(seed)
    block_size, dim = 4, 16
    chunks, lens = [c for c, _ in PREFILL_CASES[case]], [n for _, n in PREFILL_CASES[case]]
    num_pages = sum(-(-n // block_size) for n in lens) + 6
    table = scattered_tables(gen, lens, block_size, num_pages)
    kv = torch.randn(num_pages, 2, block_size, kv_heads, dim).to(dtype).to(DEVICE)
    kv = poison_past_contexts(kv, table, lens)
    lead = 1  # row 0 belongs to no sequence (a decode row, in a mixed step): left as it is
    starts = list(np.cumsum([lead, *chunks]))
    T = starts[-1]
    q_wide = torch.randn(T, heads + 2, dim).to(dtype).to(DEVICE)
    q = q_wide[:, 1 : heads + 1]  # rows strided, as slices of a fused qkv output are
    table_wide = torch.zeros(len(lens) + 1, table.shape[1] + 2, dtype=torch.int32)
    table_wide[1:, : table.shape[1]] = table
    block_table = table_wide.to(DEVICE)[1:, : table.shape[1]]  # a row-strided slice, as the runner passes
    return q, kv, block_table, [int(s) for s in starts], lens, lead


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_attention(case: str, heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    q, kv, block_table, starts, lens, lead = prefill_inputs(case, heads, kv_heads, dtype, seed=len(case) + heads)
    ref = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    out = ref.clone()
    prefill_attention_ref(ref, q, kv, block_table, starts, lens, 0.25)
    prefill_attention(out, q, kv, block_table, starts, lens, 0.25)
    assert out[:lead].isnan().all(), "a row no sequence owns was written"
    assert rel_err(out[lead:], ref[lead:]) < TOLERANCE[dtype]


def test_prefill_ignores_stale_nan_past_each_context() -> None:
    """Exactly the output of a clean pool: NaN/inf past a context never reaches the sums."""
    q, kv, block_table, starts, lens, lead = prefill_inputs("chunks_after_prefix", 8, 2, torch.float32, seed=5)
    dead = kv.isnan()
    clean = kv.masked_fill(dead, 0.0)
    poisoned = kv.masked_fill(dead & (torch.rand_like(kv) < 0.5), float("inf"))  # NaN or +inf in every dead slot
    want, got = torch.empty_like(q), torch.empty_like(q)
    prefill_attention(want, q, clean, block_table, starts, lens, 0.25)
    prefill_attention(got, q, poisoned, block_table, starts, lens, 0.25)
    assert torch.isfinite(got[lead:]).all()
    assert torch.equal(got[lead:], want[lead:])


def test_prefill_in_chunks_equals_the_whole_prompt() -> None:
    """A prompt prefilled in three chunks (each over the pages the earlier ones wrote) gives the
    rows the whole-prompt prefill gives: what chunked prefill and prefix hits rely on."""
    gen = np.random.default_rng(11)
    torch.manual_seed(11)
    block_size, heads, kv_heads, dim, n = 4, 8, 2, 16, 29
    table = scattered_tables(gen, [n], block_size, 12)
    kv = torch.randn(12, 2, block_size, kv_heads, dim, device=DEVICE)
    q = torch.randn(n, heads, dim, device=DEVICE)
    whole = torch.empty_like(q)
    prefill_attention(whole, q, kv, table.to(DEVICE), [0, n], [n], 0.3)
    chunked = torch.full_like(q, float("nan"))
    for lo, hi in ((0, 1), (1, 13), (13, n)):
        prefill_attention(chunked[lo:hi], q[lo:hi], kv, table.to(DEVICE), [0, hi - lo], [hi], 0.3)
    assert rel_err(chunked, whole) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads", [32, 8], ids=["llama-2-7b", "llama-3-8b"])
def test_prefill_attention_at_7b_sizes(kv_heads: int) -> None:
    """bf16, 32 heads of 128, 16-token pages: two whole prompts, two chunks after cached prefixes,
    one single-token chunk, pages scattered over the pool."""
    gen = np.random.default_rng(kv_heads)
    torch.manual_seed(kv_heads)
    block_size, heads, dim = 16, 32, 128
    chunks, lens = [1000, 37, 512, 256, 1], [1000, 37, 1536, 2100, 3000]
    num_pages = sum(-(-n // block_size) for n in lens) + 64
    table = scattered_tables(gen, lens, block_size, num_pages).to(DEVICE)
    kv = torch.randn(num_pages, 2, block_size, kv_heads, dim, dtype=torch.bfloat16, device=DEVICE)
    kv = poison_past_contexts(kv, table.cpu(), lens)
    starts = [int(s) for s in np.cumsum([0, *chunks])]
    q = torch.randn(starts[-1], heads, dim, dtype=torch.bfloat16, device=DEVICE)
    ref, out = torch.empty_like(q), torch.empty_like(q)
    prefill_attention_ref(ref, q, kv, table, starts, lens, dim**-0.5)
    prefill_attention(out, q, kv, table, starts, lens, dim**-0.5)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


# Gemma-style per-layer options: (sliding window, logit soft-cap); None is a global / uncapped layer.
WINDOWED = {"window": (3, None), "softcap": (None, 2.0), "both": (5, 1.5), "window_1": (1, None)}


def poison_before_windows(kv: torch.Tensor, table: torch.Tensor, firsts: list[int]) -> None:
    """NaN in each sequence's positions before ``firsts[i]``: pages a window left behind, freed
    and reused by another request."""
    block_size = kv.shape[2]
    for i, first in enumerate(firsts):
        for pos in range(first):
            kv[int(table[i, pos // block_size]), :, pos % block_size] = float("nan")


@pytest.mark.parametrize("option", list(WINDOWED))
def test_paged_decode_attention_windows_and_soft_caps(option: str) -> None:
    window, softcap = WINDOWED[option]
    gen = np.random.default_rng(21)
    torch.manual_seed(21)
    block_size, heads, kv_heads, dim, num_pages, B = 4, 8, 2, 16, 40, 5
    lens, table = make_rows(gen, B, 22, block_size, num_pages)
    kv = torch.randn(num_pages, 2, block_size, kv_heads, dim)
    if window is not None:
        poison_before_windows(kv, table, [max(0, int(n) - window) for n in lens])
    kv, table, lens = kv.to(DEVICE), table.to(DEVICE), lens.to(DEVICE)
    q = torch.randn(B, heads, dim, device=DEVICE)
    ref, out = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    paged_decode_attention_ref(ref, q, kv, table, lens, 0.5, window, softcap)
    paged_decode_attention(out, q, kv, table, lens, 0.5, window, softcap)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("option", list(WINDOWED))
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_attention_windows_and_soft_caps(case: str, option: str) -> None:
    """Whole prompts and chunks after a cached prefix (query positions past the context's start):
    each query sees only its own window, never the pages before the chunk's first window."""
    window, softcap = WINDOWED[option]
    q, kv, block_table, starts, lens, lead = prefill_inputs(case, 8, 2, torch.float32, seed=len(case))
    if window is not None:
        chunks = [starts[i + 1] - starts[i] for i in range(len(lens))]
        firsts = [max(0, n - c - window + 1) for n, c in zip(lens, chunks, strict=True)]
        poison_before_windows(kv, block_table.cpu(), firsts)
    ref = torch.full(q.shape, float("nan"), device=DEVICE)
    out = ref.clone()
    prefill_attention_ref(ref, q, kv, block_table, starts, lens, 0.5, window, softcap)
    prefill_attention(out, q, kv, block_table, starts, lens, 0.5, window, softcap)
    assert out[:lead].isnan().all(), "a row no sequence owns was written"
    assert rel_err(out[lead:], ref[lead:]) < TOLERANCE[torch.float32]


def test_windowed_prefill_in_chunks_equals_the_whole_prompt_and_decode() -> None:
    """A windowed, soft-capped prompt in three chunks gives the whole prompt's rows, and its last
    row equals a decode step's attention at that position: the three ways a token is attended."""
    gen = np.random.default_rng(12)
    torch.manual_seed(12)
    block_size, heads, kv_heads, dim, n, window = 4, 8, 2, 16, 29, 7
    table = scattered_tables(gen, [n], block_size, 12).to(DEVICE)
    kv = torch.randn(12, 2, block_size, kv_heads, dim, device=DEVICE)
    q = torch.randn(n, heads, dim, device=DEVICE)
    whole = torch.empty_like(q)
    prefill_attention(whole, q, kv, table, [0, n], [n], 0.3, window, 3.0)
    chunked = torch.full_like(q, float("nan"))
    for lo, hi in ((0, 1), (1, 13), (13, n)):
        prefill_attention(chunked[lo:hi], q[lo:hi], kv, table, [0, hi - lo], [hi], 0.3, window, 3.0)
    assert rel_err(chunked, whole) < 1e-6
    last = torch.empty_like(q[-1:])
    paged_decode_attention(
        last, q[-1:], kv, table, torch.tensor([n], dtype=torch.int32, device=DEVICE), 0.3, window, 3.0
    )
    assert rel_err(last, whole[-1:]) < 1e-5
