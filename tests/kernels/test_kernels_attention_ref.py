"""The PyTorch paged attention reads only each row's own context: stale NaN K/V in the rest of a
row's last page (a page freed by a request whose activations overflowed) must not reach it."""

from __future__ import annotations

import torch

from lorapage.kernels import paged_decode_attention_ref


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
