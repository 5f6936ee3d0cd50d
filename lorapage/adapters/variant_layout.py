"""Where an adapter's variant data sits in its pages, after its A and B matrices, and how it is made.

An adapter with DoRA, lora_bias or an embedding LoRA (:mod:`lorapage.adapters.peft_variants`)
gets a *section* in every layer's flat buffer, starting on a page boundary (page ``section_page``
of its page list) so the forward can gather it by page with one fixed in-page offset per group::

    [ A / B as in layout.py | pad | dora (total_out) | bias (total_out) | emb A^T rows | emb B ]
                                   ^ section_page * page_size

- ``dora``: per output column of every module of the layer (module order, so a group's columns
  are its fused output's), ``g - 1`` with ``g = magnitude / ||W + scale * B @ A||`` (row norm over
  d_in), computed in float32 when the adapter is packed (the base W is fixed); 0 where the module
  has no DoRA. Storing ``g - 1`` keeps narrow pages (bfloat16) precise where ``g`` is near 1.
- ``bias``: ``scale * lora_B.bias`` per output column; 0 where the module has none.
  (Both rows are present when either is: a fixed offset per group, whatever the adapter.)
- embedding LoRA: ``A^T`` [vocab, r] split over the layers, ``rows_per_layer`` vocab rows each
  (layer ``id // rows_per_layer`` holds token ``id``'s row, so the section stays small per
  layer), then ``B`` [hidden, r] (read from layer 0's buffer by the LoRA expand op).

Bytes: the section counts in the adapter's pages, so the pool, host RAM, eviction and the
envelope see it like its A and B.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lorapage.adapters.peft_format import AdapterSpec
from lorapage.adapters.peft_variants import Variants, split_variant, variant_name
from lorapage.errors import AdapterFormatError
from lorapage.model.config import MODULES, ModelConfig

# The base's weight of (layer, module), [d_out, d_in] in float32 (what DoRA's norm is taken over).
BaseWeight = Callable[[int, str], torch.Tensor]


def rows_per_layer(model: ModelConfig) -> int:
    """Vocabulary rows of an embedding LoRA's A^T held in each layer's buffer."""
    return -(-model.vocab_size // model.num_layers)


def total_out(model: ModelConfig) -> int:
    """Output columns of every module of one layer together (a dora or bias row's length)."""
    return sum(d_out for _, d_out in model.projection_dims().values())


@dataclass(frozen=True)
class VariantSection:
    """Offsets (in elements, within each layer's buffer) of an adapter's variant data."""

    section_page: int  # first page of the section in the adapter's page list (-1: no dora / bias rows)
    emb_offset: int  # start of the embedding's A^T rows (0: no embedding LoRA)
    emb_b_offset: int  # start of the embedding's B [hidden, r] in layer 0's buffer
    emb_rank: int
    emb_scale: float
    numel: int  # elements of each layer's buffer including the section
    model: ModelConfig = field(repr=False, compare=False)  # the base it was planned for

    @classmethod
    def plan(cls, variants: Variants, model: ModelConfig, page_size: int, ab_numel: int) -> VariantSection | None:
        """The section after ``ab_numel`` elements of A / B (None: a plain adapter, none needed)."""
        if not (variants.has_vectors or variants.embedding_rank):
            return None
        start = -(-ab_numel // page_size) * page_size
        cursor = start + (2 * total_out(model) if variants.has_vectors else 0)
        r = variants.embedding_rank
        emb_offset = cursor if r else 0
        emb_b = cursor + rows_per_layer(model) * r if r else 0
        end = emb_b + model.hidden_size * r if r else cursor
        page = start // page_size if variants.has_vectors else -1
        return cls(page, emb_offset, emb_b, r, variants.embedding_scale, end, model)


def dora_scale(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, magnitude: torch.Tensor):
    """PEFT's DoRA column scale ``g = magnitude / ||W + scale * B @ A||`` (norm over d_in, per
    output column), in float32: what multiplies the module's output without its bias."""
    w = weight.float() + scale * (b.float() @ a.float())
    return magnitude.float() / torch.linalg.norm(w, dim=1)


def pack_section(
    section: VariantSection,
    spec: AdapterSpec,
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
    extras: dict[str, torch.Tensor],
    page_size: int,
    base_weight: BaseWeight | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The section's data ``[num_layers, section.numel - start]`` in ``dtype``; ``extras`` the
    variant tensors by name (:func:`load_variant_tensors`), ``pairs`` the adapter's A / B."""
    spec_variants, scales, model = spec.variants, spec.scales, section.model
    start = section.section_page * page_size if section.section_page >= 0 else section.emb_offset
    out = torch.zeros(model.num_layers, section.numel - start, dtype=torch.float32)
    width, col = total_out(model), {}
    for m, (_, d_out) in model.projection_dims().items():
        col[m] = (sum(model.projection_dims()[x][1] for x in MODULES[: MODULES.index(m)]), d_out)
    for layer, m in spec_variants.dora:
        if base_weight is None:
            raise ValueError("a DoRA adapter is packed against the base's weights; none were given")
        a, b = pairs[(layer, m)]
        g = dora_scale(base_weight(layer, m), a, b, scales[(layer, m)], extras[f"dora.{layer}.{m}"])
        c, n = col[m]
        out[layer, c : c + n] = g - 1
    for layer, m in spec_variants.lora_bias:
        c, n = col[m]
        out[layer, width + c : width + c + n] = scales[(layer, m)] * extras[f"bias.{layer}.{m}"].float()
    if r := section.emb_rank:
        a_t = extras["embedding.A"].float().t()  # [vocab, r]
        rpl, at = rows_per_layer(model), section.emb_offset - start
        for layer in range(model.num_layers):
            rows = a_t[layer * rpl : (layer + 1) * rpl]
            out[layer, at : at + rows.numel()] = rows.reshape(-1)
        bt = section.emb_b_offset - start
        out[0, bt : bt + model.hidden_size * r] = extras["embedding.B"].float().reshape(-1)
    return out.to(dtype)


def load_variant_tensors(
    path: object, state: dict[str, torch.Tensor], model: ModelConfig | None = None
) -> dict[str, torch.Tensor]:
    """The variant tensors of a weights file's ``state`` (safetensors views) by their packer name,
    in float32, a fused module's vectors split into its parts (``model``'s family); one with a NaN
    or Inf value is refused, naming it."""
    out = {}
    for key, t in state.items():
        if (name := variant_name(key)) is not None:
            if not torch.isfinite(t.float()).all():
                raise AdapterFormatError(
                    f"adapter at {path}: weight {key!r} has NaN or Inf values; the adapter cannot be served"
                )
            out.update(split_variant(name, t.float(), model))
    return out


def page_list_width(model: ModelConfig, max_rank: int, page_size: int) -> int:
    """Pages the largest adapter may take (the page table's width): ``max_rank`` on every module
    and the largest section (both vector rows, an embedding LoRA of ``max_rank``, its alignment)."""
    ab = model.lora_layer_elements(max_rank)  # layout.max_adapter_pages
    section = 2 * total_out(model) + max_rank * (rows_per_layer(model) + model.hidden_size)
    return -(-ab // page_size) + -(-section // page_size) + 1
