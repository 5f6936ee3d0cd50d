"""Where an adapter's expert LoRA sits in its pages: after a layer's attention groups, expert by
expert::

    [ A_gate_up_e (R x hidden) | B_gate_e | B_up_e | A_down_e (r x I) | B_down_e ]   for e = 0 .. E-1

as :class:`~lorapage.adapters.layout.AdapterLayout` lays out a dense layer's MLP. A fused gate_up
(PEFT's ``target_parameters``) stores its one A once: gate's and up's ranks both read columns
``[0, r)`` of the shrink's output, and its B ``[2I, r]`` is gate's B then up's. An expert the
adapter does not target takes no space and has rank 0 (its rows then skip the LoRA ops).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from lorapage.model.moe_config import FUSED_GATE_UP, MoeConfig, expert_module

# Per expert, the lookup tables' module columns and group columns (EXPERT_GROUPS in lora_tables.py).
_MODULES = ("gate_proj", "up_proj", "down_proj")


@dataclass
class ExpertRows:
    """One adapter's rows of the expert lookup tables, ``[layer][expert][group or module]``."""

    a_offset: list[list[list[int]]] = field(default_factory=list)
    a_rows: list[list[list[int]]] = field(default_factory=list)
    b_offset: list[list[list[int]]] = field(default_factory=list)
    rank: list[list[list[int]]] = field(default_factory=list)
    h_start: list[list[list[int]]] = field(default_factory=list)
    scale: list[list[list[float]]] = field(default_factory=list)

    def plan_layer(
        self,
        moe: MoeConfig,
        hidden: int,
        layer: int,
        ranks: Mapping[tuple[int, str], int],
        scales: Mapping[tuple[int, str], float],
        cursor: int,
        shards: int = 1,
    ) -> int:
        """Lay out layer ``layer``'s experts from ``cursor`` on; the cursor after them. On a
        tensor-parallel rank's model (``moe`` its share of each expert, ``shards`` ranks), an
        expert's stacked gate_up A keeps ``ceil(rows / shards)`` rows and its down B ``1/shards``
        of the hidden rows (``parallel/shards.py``); h_start stays the whole shrink's."""
        inter = moe.intermediate_size
        rows: tuple[list[list], ...] = ([], [], [], [], [], [])
        for e in range(moe.num_experts):
            fused = (layer, expert_module(e, FUSED_GATE_UP))
            if fused in ranks:
                r = ranks[fused]
                rk, sc, hs, a_rows = [r, r], [scales[fused]] * 2, [0, 0], r
            else:
                keys = [(layer, expert_module(e, m)) for m in _MODULES[:2]]
                rk = [ranks.get(k, 0) for k in keys]
                sc, hs, a_rows = [scales.get(k, 0.0) for k in keys], [0, rk[0]], rk[0] + rk[1]
            down = (layer, expert_module(e, "down_proj"))
            rk.append(ranks.get(down, 0))
            sc.append(scales.get(down, 0.0))
            hs.append(0)
            a_rows = -(-a_rows // shards)
            a_off = [cursor, 0]
            cursor += a_rows * hidden
            b_off = [cursor, cursor + inter * rk[0]]
            cursor += inter * (rk[0] + rk[1])  # fused: gate's B then up's, one [2I, r] matrix
            a_off[1] = cursor
            cursor += rk[2] * inter
            b_off.append(cursor)
            cursor += hidden // shards * rk[2]
            per_expert: tuple[list, ...] = (a_off, [a_rows, rk[2]], b_off, rk, hs, sc)
            for column, row in zip(rows, per_expert):
                column.append(row)
        tables: tuple[list, ...] = (self.a_offset, self.a_rows, self.b_offset, self.rank, self.h_start, self.scale)
        for table, layer_rows in zip(tables, rows):
            table.append(layer_rows)
        return cursor

    def table_rows(self) -> tuple[torch.Tensor, ...]:
        """The expert tables' rows, each ``[num_layers, experts, ...]`` (after the dense ones)."""
        return (
            torch.tensor(self.a_offset, dtype=torch.int64),
            torch.tensor(self.a_rows, dtype=torch.int32),
            torch.tensor(self.b_offset, dtype=torch.int64),
            torch.tensor(self.rank, dtype=torch.int32),
            torch.tensor(self.h_start, dtype=torch.int32),
            torch.tensor(self.scale, dtype=torch.float32),
        )


def expert_pieces(
    tensors: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], layer: int, num_experts: int
) -> list[torch.Tensor]:
    """Layer ``layer``'s expert matrices flattened, in :meth:`ExpertRows.plan_layer`'s order."""
    pieces: list[torch.Tensor] = []
    for e in range(num_experts):
        fused = tensors.get((layer, expert_module(e, FUSED_GATE_UP)))
        if fused is not None:
            pairs = [fused]
        else:
            pairs = [p for m in _MODULES[:2] if (p := tensors.get((layer, expert_module(e, m)))) is not None]
        pieces += [a.reshape(-1) for a, _ in pairs] + [b.reshape(-1) for _, b in pairs]
        down = tensors.get((layer, expert_module(e, "down_proj")))
        if down is not None:
            pieces += [down[0].reshape(-1), down[1].reshape(-1)]
    return pieces
