"""The PEFT variants in the forward pass, per row of the mixed batch: DoRA's column scale and
lora_bias after a group's LoRA expand, and the embedding LoRA after the embedding lookup.

Both read an adapter's *section* (:mod:`lorapage.adapters.variant_layout`) from its pages through
per-slot tables allocated once (:class:`VariantTables`), indexed by each token's lora slot on the
device: no host sync, no allocation that depends on the adapters, so a captured decode graph
replays them for whatever adapters the slots hold. They are shared torch ops on every kernel
backend (torch, C, Triton): the per-column multiply after the kernels' expand, and for the
embedding a gather of ``A[:, id]`` followed by the backend's own LoRA expand for ``B``.

For a group's fused output ``y = base(x) + bias + scale * B @ A @ x`` (the LoRA expand done)::

    y += lora_bias_scaled                       (lora_bias: scale * lora_B.bias)
    y += (g - 1) * (y - bias)                   (DoRA: y = g * (base_nobias + lora) + bias)

which is PEFT's DoRA Linear, ``base + (g - 1) * base_nobias + g * scale * lora``.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from lorapage.kernels import LoraIndices
from lorapage.kernels.backend import KernelOps
from lorapage.model.config import GROUPS, ModelConfig


def _group_columns(model: ModelConfig) -> list[tuple[int, int]]:
    """(first column, width) of each group's fused output within a layer's dora / bias row."""
    dims, out, col = model.projection_dims(), [], 0
    for group in GROUPS:
        width = sum(dims[m][1] for m in group if m in dims)  # a MoE base has no dense MLP
        out.append((col, width))
        col += width
    return out


class Section(Protocol):
    """An adapter's variant section as its layout placed it (``adapters/variant_layout.py``)."""

    @property
    def section_page(self) -> int: ...
    @property
    def emb_offset(self) -> int: ...
    @property
    def emb_b_offset(self) -> int: ...
    @property
    def emb_rank(self) -> int: ...
    @property
    def emb_scale(self) -> float: ...


class VariantTables:
    """Per lora slot, where its adapter's section sits; allocated once at every slot, slot 0 = none.

    Loading an adapter writes its row, evicting it clears it: the tensors themselves never change,
    which is what a captured graph needs.
    """

    def __init__(self, model: ModelConfig, slots: int, device: torch.device) -> None:
        i32, i64, f32 = torch.int32, torch.int64, torch.float32
        self.vector_page = torch.full((slots,), -1, dtype=i32, device=device)  # [slot]: section's first page, -1 none
        self.emb_offset = torch.zeros(slots, dtype=i64, device=device)  # [slot]: start of A^T rows in each layer
        self.emb_b_offset = torch.zeros(slots, 1, dtype=i64, device=device)  # [slot, 1]: B in layer 0's buffer
        self.emb_rank = torch.zeros(slots, 1, dtype=i32, device=device)  # [slot, 1]: r, 0 = no embedding LoRA
        self.emb_h_start = torch.zeros(slots, 1, dtype=i32, device=device)  # [slot, 1]: always 0
        self.emb_scale = torch.zeros(slots, 1, dtype=f32, device=device)  # [slot, 1]: alpha / r
        self.rows_per_layer = -(-model.vocab_size // model.num_layers)
        self.total_out = sum(d for _, d in model.projection_dims().values())
        self.columns = _group_columns(model)
        self.live: set[int] = set()  # slots whose adapter has variants (host side: eager steps skip the rest)

    def write(self, slot: int, section: Section | None) -> None:
        """Point ``slot`` at its adapter's section (None: a plain adapter)."""
        self.clear(slot)
        if section is None:
            return
        self.vector_page[slot] = section.section_page
        self.emb_offset[slot] = section.emb_offset
        self.emb_b_offset[slot, 0] = section.emb_b_offset
        self.emb_rank[slot, 0] = section.emb_rank
        self.emb_scale[slot, 0] = section.emb_scale
        self.live.add(slot)

    def clear(self, slot: int) -> None:
        self.vector_page[slot] = -1
        for t in (self.emb_offset, self.emb_b_offset, self.emb_rank, self.emb_scale):
            t[slot].zero_()
        self.live.discard(slot)

    def in_step(self, lora: LoraIndices) -> bool:
        """Whether the step may hold a row with variants: always for a captured decode graph (its
        placeholder segment is slot 0), else when one of its segments' slots has them."""
        segments = lora.segments
        if segments and segments[0][2] == 0:
            return True
        return bool(self.live) and any(slot in self.live for _, _, slot in segments)


def _section_rows(pool: Tensor, page_table: Tensor, token_slot: Tensor, first: Tensor, offset: int, width: int):
    """Per token, elements ``[offset, offset + width)`` of its adapter's section (``first``: the
    section's first page in the slot's page list, per token), gathered page by page."""
    size = pool.shape[1]
    n = -(-(offset % size + width) // size)
    idx = first[:, None] + (offset // size + torch.arange(n, device=pool.device))[None, :]
    pages = page_table[token_slot[:, None].long(), idx.clamp(max=page_table.shape[1] - 1).long()]
    rows = pool[pages.long()].reshape(token_slot.shape[0], n * size)
    start = offset % size
    return rows[:, start : start + width]


def apply_vectors(
    y: Tensor, bias: Tensor | None, pool: Tensor, page_table: Tensor, token_slot: Tensor, t: VariantTables, group: int
) -> None:
    """lora_bias then DoRA on a group's output ``y`` [T, width] in place (module docstring);
    ``pool`` the layer's adapter slab, ``bias`` the base's bias of the group (None: none)."""
    first = t.vector_page[token_slot]
    has = (first >= 0)[:, None]
    first = first.clamp(min=0)
    col, width = t.columns[group]
    lora_bias = _section_rows(pool, page_table, token_slot, first, t.total_out + col, width)
    y.add_(torch.where(has, lora_bias.to(y.dtype), 0))
    g_minus_1 = torch.where(has, _section_rows(pool, page_table, token_slot, first, col, width).to(y.dtype), 0)
    y.addcmul_(g_minus_1, y if bias is None else y - bias)


def add_embedding_lora(
    x: Tensor,
    input_ids: Tensor,
    adapter_pool: Tensor,
    page_table: Tensor,
    lora: LoraIndices,
    t: VariantTables,
    h: Tensor,
    ops: KernelOps,
    embed_scale: Tensor | None = None,
) -> None:
    """``x[t] += scale * B @ A[:, id_t]`` for each token whose adapter has an embedding LoRA:
    ``A[:, id]`` gathered from the layer that holds token ``id``'s row, then ``B`` by the backend's
    LoRA expand (``h`` [T, >= max rank] its scratch input). ``embed_scale``: a factor the model
    scales its embeddings by (Gemma's sqrt(hidden)), which PEFT applies to the delta too."""
    size, slot = adapter_pool.shape[2], lora.token_slot.long()
    width = h.shape[1]
    rank = t.emb_rank[slot, 0].long()
    k = torch.arange(width, device=x.device)
    offset = t.emb_offset[slot][:, None] + (input_ids % t.rows_per_layer)[:, None] * rank[:, None] + k[None, :]
    offset = torch.where(k[None, :] < rank[:, None], offset, 0)
    page_idx = (offset // size).clamp(max=page_table.shape[1] - 1)
    pages = page_table[slot[:, None], page_idx].long()
    layer = (input_ids // t.rows_per_layer)[:, None].expand_as(pages)
    a_cols = adapter_pool[layer, pages, offset % size]
    h.copy_(torch.where(k[None, :] < rank[:, None], a_cols.to(h.dtype), 0))
    plain = LoraIndices(lora.token_slot, lora.segments, lora.segment_table)  # the op plans for its own tables
    scale = t.emb_scale if embed_scale is None else t.emb_scale * embed_scale.float()
    ops.lora_expand(x, h, adapter_pool[0], page_table, plain, t.emb_b_offset, t.emb_rank, t.emb_h_start,
                    scale, (0,))  # fmt: skip
