"""PyTorch reference of paged attention over the unified pool, and of the KV write.

One layer's KV pages are a view of the pool slab: ``kv[page, 0]`` holds K and ``kv[page, 1]``
holds V for ``block_size`` token positions, as ``[num_pages, 2, block_size, num_kv_heads,
head_dim]``. A token at position p of a sequence lives in page ``block_table[p // block_size]``
at offset ``p % block_size``; its flat slot is ``page * block_size + offset``. Page 0 is the
dummy page padded rows write to and nobody reads.

Two per-layer options, as Gemma 2/3 and Mistral define them (HF's eager attention): ``window`` W
(a sliding-window layer; None for a global one) lets the query at position p see positions
``p - W < j <= p`` only; ``softcap`` c replaces each scaled score s by ``c * tanh(s / c)`` before
the softmax.

The pages may be narrower than the activations (``kv_cache_dtype``: float16 / bfloat16 pages under a
float32 model): K and V are rounded to the pages' dtype as they are written, and widened back as
they are read, so the scores, softmax and weighted sum run in the wider of the two (float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def write_kv_ref(kv: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """``kv[s // bs, 0, s % bs] = k[t]`` and ``kv[s // bs, 1, s % bs] = v[t]`` for ``s = slot_mapping[t]``.

    Shapes: kv [num_pages, 2, block_size, H_kv, D], k and v [T, H_kv, D], slot_mapping [T] int64.
    """
    block_size = kv.shape[2]
    pages, offsets = slot_mapping // block_size, slot_mapping % block_size
    kv[pages, 0, offsets] = k.to(kv.dtype)
    kv[pages, 1, offsets] = v.to(kv.dtype)


def widen(pages: Tensor, q: Tensor) -> Tensor:
    """K or V read from pages in a narrower dtype than the queries, as float32 (as is otherwise)."""
    return pages if pages.dtype == q.dtype else pages.float()


def _gather_context(kv: Tensor, block_table: Tensor, max_blocks: int) -> tuple[Tensor, Tensor]:
    """K and V of each row's first ``max_blocks`` pages as [B, max_blocks * block_size, H_kv, D]."""
    blocks = kv[block_table[:, :max_blocks].long()]  # [B, nb, 2, bs, H_kv, D]
    b, nb, _, bs, hkv, d = blocks.shape
    return blocks[:, :, 0].reshape(b, nb * bs, hkv, d), blocks[:, :, 1].reshape(b, nb * bs, hkv, d)


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, softcap: float | None) -> Tensor:
    """``softmax(cap(q @ k.T * scale) + mask) @ v`` over [..., n, D] queries and [..., L, D] keys
    (a None mask: causal), k and v with the same heads (dim -3) as q or fewer (GQA).
    scaled_dot_product_attention has no soft-cap: with one, the scores are computed as HF's eager
    attention computes them, the softmax in float32."""
    group = q.shape[-3] // k.shape[-3]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=group > 1
        )
    if group > 1:
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        n, length = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def paged_decode_attention_ref(
    out: Tensor,
    q: Tensor,
    kv: Tensor,
    block_table: Tensor,
    context_lens: Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """``out[b] = softmax(cap(q[b] @ K_b.T * scale)) @ V_b`` over the first ``context_lens[b]``
    positions, the last ``window`` of them when a window is given.

    One query token per row; K_b, V_b are read from the row's pages with GQA (query head h reads
    KV head ``h // (H / H_kv)``). Shapes: out and q [B, H, D], block_table [B, max_blocks] int32,
    context_lens [B] int32 (>= 1).
    """
    bsz, heads, dim = q.shape
    block_size, kv_heads = kv.shape[2], kv.shape[3]
    blocks = -(-int(context_lens.max()) // block_size)
    table, length = block_table[:, :blocks].reshape(-1).long(), blocks * block_size
    # K and V gathered apart, each [B, L, H_kv, D] contiguous (fresh: written in place below);
    # index_select copies whole blocks, ~3x faster on CPU than indexing with the table.
    k = widen(kv[:, 0].index_select(0, table), q).view(bsz, length, kv_heads, dim)
    v = widen(kv[:, 1].index_select(0, table), q).view(bsz, length, kv_heads, dim)
    at, lens = torch.arange(length, device=q.device)[None, :], context_lens[:, None].to(q.device)
    mask = at < lens  # [B, L]
    if window is not None:
        mask &= at >= lens - window
    # Positions past a row's context hold whatever their page held before (another sequence's
    # stale K/V, possibly NaN): a masked weight of 0 times NaN is still NaN, so zero them first,
    # as the Triton kernel's masked loads do: only those rows (an index_fill_ of them costs a
    # fraction of a masked_fill_ over every position).
    stale = torch.nonzero(~mask.view(-1)).view(-1)
    k.view(bsz * length, -1).index_fill_(0, stale, 0.0)
    v.view(bsz * length, -1).index_fill_(0, stale, 0.0)
    # GQA without repeating K/V: the query heads that share KV head j (heads j*G .. j*G+G-1)
    # are G queries against it, so attention runs over [B, H_kv, G, D] queries.
    group = heads // kv_heads
    attn = _attend(
        q.reshape(bsz, kv_heads, group, dim).to(k.dtype),
        k.transpose(1, 2),
        v.transpose(1, 2),
        mask[:, None, None, :],
        scale,
        softcap,
    )
    out.copy_(attn.reshape(bsz, heads, dim))


def prefill_attention_ref(
    out: Tensor,
    q: Tensor,
    kv: Tensor,
    block_table: Tensor,
    query_starts: list[int],
    context_lens: list[int],
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Causal attention of each sequence's new tokens over its whole context read from pages.

    Sequence i owns query rows ``query_starts[i] : query_starts[i + 1]`` (the last ``n_i`` of its
    ``context_lens[i]`` positions, whose K and V are already written) and pages ``block_table[i]``.
    ``out[rows] = softmax(mask(q[rows] @ K_i.T * scale)) @ V_i`` where query j sees positions
    ``<= context_lens[i] - n_i + j`` (and, with a window W, ``> context_lens[i] - n_i + j - W``).
    Shapes: out and q [T, H, D].
    """
    block_size = kv.shape[2]
    for i, ctx in enumerate(context_lens):
        start, end = query_starts[i], query_starts[i + 1]
        n = end - start
        # With a window, positions before the first query's window are dropped: their pages may
        # have been freed (and reused), so whatever was gathered there never reaches a sum.
        first = 0 if window is None else max(0, ctx - n - window + 1)
        k, v = _gather_context(kv, block_table[i : i + 1], -(-ctx // block_size))
        k, v = widen(k[0, first:ctx], q).transpose(0, 1), widen(v[0, first:ctx], q).transpose(0, 1)
        qi = q[start:end].transpose(0, 1).to(k.dtype)  # [H, n, D]
        mask = None
        if n != ctx or window is not None:
            rows = torch.arange(n, device=q.device)[:, None] + (ctx - n)
            at = torch.arange(first, ctx, device=q.device)[None, :]
            mask = (at <= rows) if window is None else (at <= rows) & (at > rows - window)
        out[start:end] = _attend(qi, k, v, mask, scale, softcap).transpose(0, 1)
