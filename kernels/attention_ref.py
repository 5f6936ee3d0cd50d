"""PyTorch reference of paged attention over the unified pool, and of the KV write.

One layer's KV pages are a view of the pool slab: ``kv[page, 0]`` holds K and ``kv[page, 1]``
holds V for ``block_size`` token positions, as ``[num_pages, 2, block_size, num_kv_heads,
head_dim]``. A token at position p of a sequence lives in page ``block_table[p // block_size]``
at offset ``p % block_size``; its flat slot is ``page * block_size + offset``. Page 0 is the
dummy page padded rows write to and nobody reads.
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
    kv[pages, 0, offsets] = k
    kv[pages, 1, offsets] = v


def _gather_context(kv: Tensor, block_table: Tensor, max_blocks: int) -> tuple[Tensor, Tensor]:
    """K and V of each row's first ``max_blocks`` pages as [B, max_blocks * block_size, H_kv, D]."""
    blocks = kv[block_table[:, :max_blocks].long()]  # [B, nb, 2, bs, H_kv, D]
    b, nb, _, bs, hkv, d = blocks.shape
    return blocks[:, :, 0].reshape(b, nb * bs, hkv, d), blocks[:, :, 1].reshape(b, nb * bs, hkv, d)


def paged_decode_attention_ref(
    out: Tensor, q: Tensor, kv: Tensor, block_table: Tensor, context_lens: Tensor, scale: float
) -> None:
    """``out[b] = softmax(q[b] @ K_b.T * scale) @ V_b`` over the first ``context_lens[b]`` positions.

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
    k = kv[:, 0].index_select(0, table).view(bsz, length, kv_heads, dim)
    v = kv[:, 1].index_select(0, table).view(bsz, length, kv_heads, dim)
    mask = torch.arange(length, device=q.device)[None, :] < context_lens[:, None].to(q.device)  # [B, L]
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
    attn = F.scaled_dot_product_attention(
        q.reshape(bsz, kv_heads, group, dim),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
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
) -> None:
    """Causal attention of each sequence's new tokens over its whole context read from pages.

    Sequence i owns query rows ``query_starts[i] : query_starts[i + 1]`` (the last ``n_i`` of its
    ``context_lens[i]`` positions, whose K and V are already written) and pages ``block_table[i]``.
    ``out[rows] = softmax(mask(q[rows] @ K_i.T * scale)) @ V_i`` where query j sees positions
    ``<= context_lens[i] - n_i + j``. Shapes: out and q [T, H, D].
    """
    heads, kv_heads = q.shape[1], kv.shape[3]
    block_size = kv.shape[2]
    for i, ctx in enumerate(context_lens):
        start, end = query_starts[i], query_starts[i + 1]
        n = end - start
        k, v = _gather_context(kv, block_table[i : i + 1], -(-ctx // block_size))
        k, v = k[0, :ctx].transpose(0, 1), v[0, :ctx].transpose(0, 1)  # [H_kv, ctx, D]
        qi = q[start:end].transpose(0, 1)  # [H, n, D]
        if n == ctx:
            mask = None
        else:
            rows = torch.arange(n, device=q.device)[:, None] + (ctx - n)
            mask = torch.arange(ctx, device=q.device)[None, :] <= rows
        attn = F.scaled_dot_product_attention(
            qi, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=heads != kv_heads
        )
        out[start:end] = attn.transpose(0, 1)
