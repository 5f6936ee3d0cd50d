"""The lookup tables the LoRA ops read: per lora slot, an adapter's pages and, per layer, where its
A and B matrices sit in them (filled from an adapter's layout, :mod:`lorapage.adapters.layout`);
on a MoE base, the same per expert (:class:`ExpertTables`)."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from lorapage.model.config import GROUPS, MODULES, ModelConfig
from lorapage.model.lora_variants import Section, VariantTables

# An expert's LoRA modules are (gate_proj, up_proj, down_proj); its groups, as (first, end) module
# columns: gate and up share their input (one shrink), down has its own.
EXPERT_GROUPS = ((0, 2), (2, 3))
_EXPERT_RANK = 9  # in a layout's table_rows: the six dense tables, then the experts' a_offset, a_rows, b_offset, rank


class ExpertTables:
    """The experts' lookup tables: as :class:`LoraTables`' per layer and slot, with an expert axis."""

    def __init__(self, num_layers: int, slots: int, num_experts: int, device: torch.device) -> None:
        L, S, E, G, M = num_layers, slots, num_experts, len(EXPERT_GROUPS), EXPERT_GROUPS[-1][1]
        i32, i64 = torch.int32, torch.int64
        self.a_offset = torch.zeros(L, S, E, G, dtype=i64, device=device)  # [layer, slot, expert, group]
        self.a_rows = torch.zeros(L, S, E, G, dtype=i32, device=device)  # rows of the group's stacked A
        self.b_offset = torch.zeros(L, S, E, M, dtype=i64, device=device)  # [layer, slot, expert, module]
        self.rank = torch.zeros(L, S, E, M, dtype=i32, device=device)  # r, 0 = untargeted
        self.h_start = torch.zeros(L, S, E, M, dtype=i32, device=device)  # fused gate_up: gate's and up's both 0
        self.scale = torch.zeros(L, S, E, M, dtype=torch.float32, device=device)
        # On the host: whether slot s's adapter has LoRA on any expert (a step whose rows have
        # none skips the experts' LoRA ops; an attention-only adapter is the common case).
        self.targeted = np.zeros(S, dtype=bool)

    @property
    def all(self) -> tuple[Tensor, ...]:
        """The tables in the order a layout's ``table_rows`` lists their rows (after the dense ones)."""
        return (self.a_offset, self.a_rows, self.b_offset, self.rank, self.h_start, self.scale)


class SlotRows(Protocol):
    """An adapter's rows of the tables, as its layout computed them."""

    @property
    def table_rows(self) -> tuple[Tensor, ...]: ...

    @property
    def section(self) -> Section | None: ...  # its variant data's place (adapters/variant_layout.py), None: none


GroupViews = tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor, Tensor], Tensor]


class LoraTables:
    """Lookup tables the LoRA ops read, allocated once at ``max_resident_loras + 1`` slots (every
    lora slot, not only the ``max_loras`` distinct adapters one batch may hold); slot 0 = none.

    Loading or evicting an adapter only writes rows of these tensors, never reallocates them, so
    a captured CUDA graph that reads them stays valid.
    """

    def __init__(self, model: ModelConfig, max_resident_loras: int, max_pages: int, device: torch.device) -> None:
        L, S, G, M = model.num_layers, max_resident_loras + 1, len(GROUPS), len(MODULES)
        i32, i64, f32 = torch.int32, torch.int64, torch.float32
        self.page_table = torch.zeros(S, max_pages, dtype=i32, device=device)  # [slot, i]: i-th page of the adapter
        self.a_offset = torch.zeros(L, S, G, dtype=i64, device=device)  # [layer, slot, group]: start of stacked A
        self.a_rows = torch.zeros(L, S, G, dtype=i32, device=device)  # [layer, slot, group]: rows of stacked A
        self.b_offset = torch.zeros(L, S, M, dtype=i64, device=device)  # [layer, slot, module]: start of B_m
        self.rank = torch.zeros(L, S, M, dtype=i32, device=device)  # [layer, slot, module]: r_m, 0 = untargeted
        self.h_start = torch.zeros(L, S, M, dtype=i32, device=device)  # [layer, slot, module]: r_m's column in h
        self.scale = torch.zeros(L, S, M, dtype=f32, device=device)  # [layer, slot, module]: alpha / r
        self.experts = ExpertTables(L, S, model.moe.num_experts, device) if model.moe is not None else None
        self.variants = VariantTables(model, S, device)  # DoRA, lora_bias, embedding LoRA (lora_variants.py)
        self._views: dict[tuple[int, int], GroupViews] = {}

    def group_views(self, layer: int, group: int, modules: tuple[int, int]) -> GroupViews:
        """Group ``group``'s tables in ``layer`` as the LoRA ops take them (its ``modules``, a range):
        the shrink's (a_offset, a_rows), the expand's (b_offset, rank, h_start), then scale. Made once
        per (layer, group): views stay valid since the tables are only written into, and indexing a
        tensor costs microseconds of Python 48 times a step (issue 40, item 4)."""
        key = (layer, group)
        if key not in self._views:
            m0, m1 = modules
            b, r, hs = (t[layer, :, m0:m1] for t in (self.b_offset, self.rank, self.h_start))
            a = (self.a_offset[layer, :, group], self.a_rows[layer, :, group])
            self._views[key] = (a, (b, r, hs), self.scale[layer, :, m0:m1])
        return self._views[key]

    def _tables(self) -> tuple[Tensor, ...]:
        dense = (self.a_offset, self.a_rows, self.b_offset, self.rank, self.h_start, self.scale)
        return dense if self.experts is None else dense + self.experts.all

    def write_slot(self, slot: int, layout: SlotRows, pages: list[int]) -> None:
        """Point ``slot`` at an adapter now resident in ``pages``."""
        self.page_table[slot].zero_()
        self.page_table[slot, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        for table, rows in zip(self._tables(), layout.table_rows, strict=True):
            table[:, slot].copy_(rows, non_blocking=True)
        if self.experts is not None:
            self.experts.targeted[slot] = bool(layout.table_rows[_EXPERT_RANK].any())
        self.variants.write(slot, layout.section)

    def clear_slot(self, slot: int) -> None:
        """Make ``slot`` an empty adapter (rank 0 everywhere) pointing at the dummy page."""
        self.page_table[slot].zero_()
        for table in self._tables():
            table[:, slot].zero_()
        if self.experts is not None:
            self.experts.targeted[slot] = False
        self.variants.clear(slot)
