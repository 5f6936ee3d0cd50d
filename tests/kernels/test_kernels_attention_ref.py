"""The PyTorch paged attention reads only each row's own context: stale NaN K/V in the rest of a
row's last page (a page freed by a request whose activations overflowed) must not reach it. Its
sliding windows and soft-caps are the definition HF's eager attention computes."""

from __future__ import annotations

import pytest
import torch

from lorapage.kernels import paged_decode_attention_ref, prefill_attention_ref


def test_stale_nan_past_the_context_does_not_leak_into_decode_attention() -> None:
    torch.manual_seed(0)
    block_size, heads, dim = 4, 2, 8
    kv = torch.randn(6, 2, block_size, heads, dim)
    block_table = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    context_lens = torch.tensor([6, 3], dtype=torch.int32)  # row 0: 2 stale slots; row 1: 1 stale slot + 1 page
    q = torch.randn(2, heads, dim)
    clean = torch.empty(2, heads, dim)
    paged_decode_attention_ref(clean, q, kv.clone(), block_table, context_lens, dim**-0.5)
    poisoned = kv.clone()
    poisoned[2, :, 2:] = float("nan")  # row 0's last page past position 5
    poisoned[3, :, 3:] = float("inf")  # row 1's page past position 2
    poisoned[4] = float("nan")  # row 1's next page: inside the gathered width, outside its context
    out = torch.empty(2, heads, dim)
    paged_decode_attention_ref(out, q, poisoned, block_table, context_lens, dim**-0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, clean)


def _attention_at(q, kv, table, pos, window, softcap, scale):
    """float64 attention of one query token [H, D] at position ``pos`` of a sequence with pages
    ``table``, straight from the definition: positions ``pos - window < j <= pos``, scores capped."""
    block_size, kv_heads = kv.shape[2], kv.shape[3]
    group = q.shape[0] // kv_heads
    seen = range(0 if window is None else max(0, pos - window + 1), pos + 1)
    k = torch.stack([kv[table[j // block_size], 0, j % block_size] for j in seen]).double().repeat_interleave(group, 1)
    v = torch.stack([kv[table[j // block_size], 1, j % block_size] for j in seen]).double().repeat_interleave(group, 1)
    scores = torch.einsum("hd,jhd->hj", q.double(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    return torch.einsum("hj,jhd->hd", scores.softmax(-1), v)


@pytest.mark.parametrize("window,softcap", [(None, None), (3, None), (None, 2.0), (6, 1.5), (1, 4.0)])
def test_windowed_soft_capped_attention_is_the_definition(window, softcap) -> None:
    """Decode rows and prefill rows (whole prompts and a chunk after a prefix) against the
    per-token definition HF's eager attention computes (sliding_window_overlay: j > pos - window)."""
    torch.manual_seed(1)
    block_size, heads, kv_heads, dim, scale = 4, 4, 2, 8, 0.4
    lens, chunks = [13, 5, 1], [6, 5, 1]
    kv = torch.randn(12, 2, block_size, kv_heads, dim)
    table = torch.tensor([[3, 7, 1, 9], [2, 5, 0, 0], [11, 0, 0, 0]], dtype=torch.int32)
    q = torch.randn(3, heads, dim)
    out = torch.empty_like(q)
    paged_decode_attention_ref(out, q, kv, table, torch.tensor(lens, dtype=torch.int32), scale, window, softcap)
    want = torch.stack([_attention_at(q[b], kv, table[b], n - 1, window, softcap, scale) for b, n in enumerate(lens)])
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
    starts = [0, 6, 11, 12]
    qp = torch.randn(12, heads, dim)
    outp = torch.empty_like(qp)
    prefill_attention_ref(outp, qp, kv, table, starts, lens, scale, window, softcap)
    want = [
        _attention_at(qp[starts[b] + j], kv, table[b], lens[b] - chunks[b] + j, window, softcap, scale)
        for b in range(3)
        for j in range(chunks[b])
    ]
    torch.testing.assert_close(outp.double(), torch.stack(want), atol=1e-5, rtol=0)
