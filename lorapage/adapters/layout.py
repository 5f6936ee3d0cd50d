"""Where an adapter's A and B matrices sit inside its pages (the rows it writes into the kernels'
lookup tables, :class:`~lorapage.model.lora_tables.LoraTables`).

Per layer, an adapter's pages read in order form one flat buffer laid out group by group::

    [ A_qkv (R_qkv x hidden) | B_q | B_k | B_v | A_o | B_o | A_gate_up | B_gate | B_up | A_down | B_down ]

``A_group`` stacks the A matrices of the group's targeted modules (their inputs are the same
activations, so one shrink serves the group); each ``B_m`` is ``[d_out_m, r_m]`` as PEFT stores
it. Modules the adapter does not target take no space, and ranks are the adapter's own, so an
adapter's page count is proportional to its rank and modules. On a MoE base the experts follow
the attention groups (:mod:`lorapage.adapters.moe_layout`).

int8 pages (``quantized``, ``--lora-dtype int8``): each matrix's int8 values, padded to 4 bytes,
are followed by its float32 scales, one per rank row (:mod:`lorapage.kernels.lora_int8`)::

    [ qA_qkv | pad | A_qkv's R_qkv scales | qB_q^T | pad | B_q's r_q scales | qB_k^T | ... ]

with B transposed (``[r, d_out]``: the expand's blocks of outputs are r int8 rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from lorapage.adapters.moe_layout import ExpertRows, expert_pieces
from lorapage.adapters.peft_format import AdapterSpec
from lorapage.adapters.variant_layout import VariantSection
from lorapage.errors import AdapterFormatError
from lorapage.kernels.lora_int8 import SCALE_BYTES, as_bytes, padded, quantize_pair
from lorapage.memory.host import host_empty
from lorapage.model.config import GROUPS, MODULES, ModelConfig


@dataclass(frozen=True)
class AdapterLayout:
    """Offsets (in elements) of one adapter's matrices, per layer, within its flat page buffer."""

    a_offset: list[list[int]]  # [layer][group] start of the group's stacked A
    a_rows: list[list[int]]  # [layer][group] rows of that A (sum of the group's ranks)
    b_offset: list[list[int]]  # [layer][module] start of B_m
    rank: list[list[int]]  # [layer][module] r_m (0 = not targeted)
    h_start: list[list[int]]  # [layer][module] first column of module m's rank block in h
    scale: list[list[float]]  # [layer][module] alpha / r (or alpha / sqrt(r))
    numel: int  # elements of the largest layer's buffer
    num_pages: int
    experts: ExpertRows | None = None  # a MoE base's expert rows of the tables
    section: VariantSection | None = None  # DoRA / lora_bias / embedding LoRA data (variant_layout.py)
    quantized: bool = False  # int8 values, each matrix followed by its scales (module docstring)

    @classmethod
    def plan(cls, spec: AdapterSpec, model: ModelConfig, page_size: int, quantized: bool = False) -> AdapterLayout:
        """Where ``spec``'s matrices go in pages of ``page_size`` elements; ``quantized``: int8 ones."""
        if quantized and (model.moe is not None or not spec.variants.plain):
            what = "PEFT variant data (DoRA, lora_bias, embedding LoRA)"
            what = "a MoE base's experts" if model.moe is not None else what
            raise AdapterFormatError(
                f"adapter at {str(spec.path)!r}: int8 adapter pages (--lora-dtype int8) hold plain LoRA A and B "
                f"only, not {what}; serve it with --lora-dtype float32 or bfloat16"
            )
        dims = model.module_dims()
        a_off: list[list[int]] = []
        a_rows: list[list[int]] = []
        b_off: list[list[int]] = []
        rank: list[list[int]] = []
        h_start: list[list[int]] = []
        scale: list[list[float]] = []
        sizes: list[int] = []
        experts = ExpertRows() if model.moe is not None else None
        for layer in range(model.num_layers):
            cursor = 0
            ao: list[int] = []
            ar: list[int] = []
            bo, rk, hs, sc = [0] * len(MODULES), [0] * len(MODULES), [0] * len(MODULES), [0.0] * len(MODULES)
            for group in GROUPS:
                if group[0] not in dims:  # a MoE base's dense MLP: none
                    ao.append(cursor)
                    ar.append(0)
                    continue
                d_in = dims[group[0]][0]
                rows = 0
                for m in group:
                    i = MODULES.index(m)
                    rk[i] = spec.ranks.get((layer, m), 0)
                    sc[i] = spec.scales.get((layer, m), 0.0)
                    hs[i] = rows
                    rows += rk[i]
                # A tensor-parallel rank's share of the stacked A (ModelConfig.lora_shape: all of
                # it on one device); h_start stays the whole h's, which the ranks' shares make up.
                rows = model.lora_shape(group[0], rows)[0]
                ao.append(cursor)
                ar.append(rows)
                cursor += _matrix_elements(rows * d_in, rows, quantized)
                for m in group:
                    i = MODULES.index(m)
                    bo[i] = cursor
                    cursor += _matrix_elements(model.lora_shape(m, rk[i])[2] * rk[i], rk[i], quantized)
            if experts is not None and model.moe is not None:
                cursor = experts.plan_layer(
                    model.moe, model.hidden_size, layer, spec.ranks, spec.scales, cursor, model.lora_shards
                )
            a_off.append(ao)
            a_rows.append(ar)
            b_off.append(bo)
            rank.append(rk)
            h_start.append(hs)
            scale.append(sc)
            sizes.append(cursor)
        numel = max(sizes, default=0)
        section = VariantSection.plan(spec.variants, model, page_size, numel)
        numel = section.numel if section is not None else numel
        pages = -(-numel // page_size)
        return cls(a_off, a_rows, b_off, rank, h_start, scale, numel, pages, experts, section, quantized)

    @cached_property
    def table_rows(self) -> tuple[torch.Tensor, ...]:
        """This adapter's rows of the lookup tables, built once (a load then only copies them):
        a_offset, a_rows, b_offset, rank, h_start, scale, each ``[num_layers, ...]``."""
        dense = (
            torch.tensor(self.a_offset, dtype=torch.int64),
            torch.tensor(self.a_rows, dtype=torch.int32),
            torch.tensor(self.b_offset, dtype=torch.int64),
            torch.tensor(self.rank, dtype=torch.int32),
            torch.tensor(self.h_start, dtype=torch.int32),
            torch.tensor(self.scale, dtype=torch.float32),
        )
        return dense if self.experts is None else dense + self.experts.table_rows()

    def pack(
        self,
        tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
        page_size: int,
        section: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The adapter as ``[num_layers, num_pages * page_size]``, ready to copy into its pages;
        ``section`` the variant data ``[num_layers, n]`` that ends each layer's buffer
        (:func:`~lorapage.adapters.variant_layout.pack_section`), when the layout has one.

        :meth:`plan` lays each layer out in the order :meth:`pieces` lists them, so the whole
        buffer is one ``torch.cat``: a single copy, where writing each matrix into a zeroed
        buffer paid Python overhead per slice.
        """
        return self.join(self.pieces(tensors, page_size, section))

    def pieces(
        self,
        tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
        page_size: int,
        section: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """What :meth:`pack` joins, in page order: per layer and group, its targeted A's, then
        their B's (int8: with their padding and scales), the experts, then zero padding (slices
        of one zero tensor) and the variant section. Every piece is 1-D, of the pages' dtype."""
        first = next(iter(tensors.values()))[0] if tensors else section
        assert first is not None and (section is None) == (self.section is None)
        row = self.num_pages * page_size
        padding = first.new_zeros(row)
        tail = 0 if section is None else section.shape[1]
        end = self.section.numel - tail if self.section is not None else row
        parts: list[torch.Tensor] = []
        if self.quantized:
            padding = torch.zeros(row, dtype=torch.int8)
        for layer, ranks in enumerate(self.rank):
            used = 0
            for group in GROUPS:
                pairs = [tensors[(layer, m)] for m in group if ranks[MODULES.index(m)]]
                if self.quantized:
                    pieces = _quantized_pieces(pairs, padding)
                else:
                    pieces = [a.reshape(-1) for a, _ in pairs] + [b.reshape(-1) for _, b in pairs]
                parts += pieces
                used += sum(x.numel() for x in pieces)
            if self.experts is not None:
                pieces = expert_pieces(tensors, layer, len(self.experts.rank[layer]))
                parts += pieces
                used += sum(x.numel() for x in pieces)
            parts.append(padding[: end - used])
            if section is not None:
                parts += [section[layer], padding[: row - end - tail]]
        return parts

    def join(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """:meth:`pieces` as one ``[num_layers, row]`` buffer in host memory kept for reuse."""
        row = sum(p.numel() for p in pieces) // len(self.rank)
        # Into huge-page-backed memory: the packed copy is kept in host RAM (see memory/host.py).
        out = host_empty(len(self.rank) * row, pieces[0].dtype)
        return torch.cat(pieces, out=out).view(len(self.rank), row)

    def same_pages(self, other: AdapterLayout) -> bool:
        """Whether ``other`` puts every matrix where this layout does (``scale`` aside): the
        same packed bytes mean the same adapter in the pages."""
        return (
            self.num_pages == other.num_pages
            and self.numel == other.numel
            and self.a_offset == other.a_offset
            and self.b_offset == other.b_offset
            and self.rank == other.rank
            and self.a_rows == other.a_rows
            and self.quantized == other.quantized
        )


def _matrix_elements(numel: int, rows: int, quantized: bool) -> int:
    """Elements a matrix of ``numel`` values takes: itself, or as int8 its padded values and ``rows`` scales."""
    return padded(numel) + SCALE_BYTES * rows if quantized else numel


def _quantized_pieces(pairs: list[tuple[torch.Tensor, torch.Tensor]], padding: torch.Tensor) -> list[torch.Tensor]:
    """One group's (A, B) pairs as int8 pieces in :meth:`AdapterLayout.plan`'s order: the stacked
    qA, its padding and scales, then each B transposed (qBt) with its padding and scales."""
    quantized = [quantize_pair(a, b) for a, b in pairs]
    qa = [q.reshape(-1) for q, _, _, _ in quantized]
    numel = sum(q.numel() for q in qa)
    pieces = [*qa, padding[: padded(numel) - numel], *(as_bytes(s) for _, s, _, _ in quantized)]
    for _, _, qbt, sb in quantized:
        pieces += [qbt.reshape(-1), padding[: padded(qbt.numel()) - qbt.numel()], as_bytes(sb)]
    return pieces


def max_adapter_pages(model: ModelConfig, max_rank: int, page_size: int, quantized: bool = False) -> int:
    """Pages of the largest adapter allowed: ``max_rank`` on every module (int8: with its padding and scales)."""
    extra = len(model.module_dims()) * 2 * (SCALE_BYTES - 1 + SCALE_BYTES * max_rank) if quantized else 0
    return -(-(model.lora_layer_elements(max_rank) + extra) // page_size)
