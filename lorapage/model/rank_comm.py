"""A tensor-parallel rank's side of the forward (:mod:`lorapage.parallel` makes the collectives):
the vocabulary-parallel embedding and logits, and the sharded LoRA's all-gathered shrink.

Every rank runs the same collectives in the same order (they are called from the same forward on
the same step inputs), so nothing here decides anything per rank but which rows are its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RankComm:
    """This rank's place in the group and the collectives over it."""

    rank: int
    world: int
    all_reduce: Callable[[Tensor], None]  # in-place sum over the ranks
    all_gather: Callable[[Tensor], Tensor]  # [n, ...] -> [world, n, ...], every rank's in rank order
    gather: Callable[[Tensor], Tensor]  # as all_gather on rank 0; elsewhere the input, unchanged (not whole)


def vocab_embed(table: Tensor, input_ids: Tensor, comm: RankComm) -> Tensor:
    """The embedding of ``input_ids`` [T] when each rank holds ``table`` = rows ``[rank n, (rank + 1) n)``
    of the vocabulary (vLLM's VocabParallelEmbedding): each rank looks up the ids in its rows, zeros
    elsewhere, and the all-reduce adds the one non-zero row per token (exactly: the rest add 0)."""
    n = table.shape[0]
    local = input_ids - comm.rank * n
    mine = (local >= 0) & (local < n)
    x = table[local.clamp(0, n - 1)] * mine[:, None].to(table.dtype)
    comm.all_reduce(x)
    return x


def vocab_logits(local: Tensor, comm: RankComm, vocab_size: int) -> Tensor:
    """The whole logits [N, vocab_size] on rank 0 from each rank's ``local`` [N, n] (its vocabulary
    rows of lm_head, vLLM's ParallelLMHead), gathered to rank 0 only: the other ranks get theirs back."""
    parts = comm.gather(local.contiguous())
    if comm.rank:
        return parts
    return parts.permute(1, 0, 2).reshape(local.shape[0], -1)[:, :vocab_size]


def gather_shrink(h: Tensor, comm: RankComm, share_rows: Tensor) -> None:
    """``h`` [T, W] from each rank's share of it (fully sharded LoRA, column-parallel group): token
    ``t``'s rank wrote columns ``[0, w_t)`` of its ``w_t = share_rows[t]`` rows of the adapter's
    stacked A, rank ``j``'s rows being ``[j w_t, (j + 1) w_t)`` of the whole; after the all-gather
    each token's whole shrink is its ranks' shares side by side, put back in place per token
    (adapters of different ranks share a step, so ``w_t`` is per token). Columns past a token's
    ``world * w_t`` are left undefined: no expand reads them."""
    T, W = h.shape
    width = -(-W // comm.world)
    parts = comm.all_gather(h[:, :width].contiguous())  # [world, T, width]
    w = share_rows.clamp(min=1).long()[:, None]
    col = torch.arange(W, device=h.device)[None, :]
    src = (col // w).clamp(max=comm.world - 1)
    flat = src * (T * width) + torch.arange(T, device=h.device)[:, None] * width + col % w
    h.copy_(parts.reshape(-1)[flat])
