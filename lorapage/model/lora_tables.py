"""The lookup tables the LoRA ops read: per lora slot, an adapter's pages and, per layer, where its
A and B matrices sit in them (filled from an adapter's layout, :mod:`lorapage.adapters.layout`)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from lorapage.model.config import GROUPS, MODULES, ModelConfig
from lorapage.model.lora_variants import Section, VariantTables


class SlotRows(Protocol):
    """An adapter's rows of the tables, as its layout computed them."""

    @property
    def table_rows(self) -> tuple[Tensor, ...]: ...

    @property
    def section(self) -> Section | None: ...  # its variant data's place (adapters/variant_layout.py), None: none


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
        self.variants = VariantTables(model, S, device)  # DoRA, lora_bias, embedding LoRA (lora_variants.py)

    def write_slot(self, slot: int, layout: SlotRows, pages: list[int]) -> None:
        """Point ``slot`` at an adapter now resident in ``pages``."""
        self.page_table[slot].zero_()
        self.page_table[slot, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        tables = (self.a_offset, self.a_rows, self.b_offset, self.rank, self.h_start, self.scale)
        for table, rows in zip(tables, layout.table_rows):
            table[:, slot].copy_(rows, non_blocking=True)
        self.variants.write(slot, layout.section)

    def clear_slot(self, slot: int) -> None:
        """Make ``slot`` an empty adapter (rank 0 everywhere) pointing at the dummy page."""
        for table in (
            self.page_table[slot],
            self.a_offset[:, slot],
            self.a_rows[:, slot],
            self.b_offset[:, slot],
            self.rank[:, slot],
            self.h_start[:, slot],
            self.scale[:, slot],
        ):
            table.zero_()
        self.variants.clear(slot)
