"""What an adapter's shape costs every other request in a decode step: the design's arithmetic.

Seed 000 (§2, §6): a decode step reads the base weights once, shared by every row of the batch,
and each *distinct* adapter in the batch once, shared only by the rows that use it. Decode is
memory-bound, so extra bytes read are extra step time. The projection takes a reference batch of
``B`` rows, each on its own adapter (the worst case, and the design's definition: "at batch 64
with distinct adapters"). Per generated token:

    base bytes per token     = W_base / B        (one read of the base per step, over B rows)
    adapter bytes per token  = W_adapter         (the row's own adapter, read for it alone)

    projected_cost_pct = 100 * B * W_adapter / W_base                  (decode bytes)
    flops_pct          = 100 * P_adapter / P_base                      (per token, any batch)

with ``P_adapter = sum over targeted (layer, module) of r * (d_in + d_out)`` (LoRA's A is
``r x d_in``, B ``d_out x r``), ``P_base`` the parameters one decode step reads (every
projection, the norms and the LM head; the embedding table is gathered by row, not read), and
``W = P x bytes per element`` (adapters in the pool's adapter dtype, the base in the model's).
FLOPs are 2 per parameter per token on both sides, so their ratio has no ``B``: each row computes
its own low-rank product. With ``D <= B`` distinct adapters in a batch the extra bytes are
``D * W_adapter`` (:meth:`AdapterCost.bytes_pct_at`): a batch of 64 rows on one adapter costs one
adapter read, which is why the scheduler groups rows by adapter.

On a MoE base (Mixtral, Qwen3-MoE) a token reaches ``top_k`` of the ``E`` experts, so its own
adapter's expert LoRA is read at ``top_k / E`` of what the adapter holds (each expert's A and B
counted as any module's), and the FLOPs compare against the base's active parameters; the base
read per step is every expert (a reference batch's rows, routed apart, reach nearly all of them).

For the design's 70B (80 layers, hidden 8,192, KV 1,024, MLP 28,672, 16-bit) this gives +6.1%
for attention-only rank 8 and +154% for all-modules rank 64 at batch 128, and +77% for the latter
at batch 64 (the seed rounds the base to 140 GB and says +6%, +151% and +75.7%). Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from lorapage.model.config import MODULES, ModelConfig
from lorapage.model.families import family_of
from lorapage.model.moe_config import EXPERT_KINDS, module_kind, split_expert_module

DEFAULT_REFERENCE_BATCH = 64  # the design's: "projected +75.7% decode cost at batch 64"
ATTENTION_MODULES = MODULES[:4]
MLP_MODULES = MODULES[4:]


def adapter_params(model: ModelConfig, ranks: Mapping[tuple[int, str], int]) -> int:
    """Values an adapter holds: ``r * (d_in + d_out)`` per targeted (layer, module), every
    expert's on a MoE base."""
    dims = model.lora_dims()
    return sum(r * sum(dims[m]) for (_, m), r in ranks.items())


def adapter_token_params(model: ModelConfig, ranks: Mapping[tuple[int, str], int]) -> int:
    """Values one token reads of its adapter: :func:`adapter_params`, each expert's at
    ``top_k / E`` (rounded down as a whole)."""
    dims, moe = model.lora_dims(), model.moe
    dense = sum(r * sum(dims[m]) for (_, m), r in ranks.items() if split_expert_module(m) is None)
    experts = sum(r * sum(dims[m]) for (_, m), r in ranks.items() if split_expert_module(m) is not None)
    return dense if moe is None else dense + experts * moe.top_k // moe.num_experts


def _layer_small_params(model: ModelConfig) -> int:
    """A layer's norm weights and biases, as its family holds them: two RMSNorms (Gemma: four),
    q / k norms (Qwen3, Qwen3-MoE, Gemma 3: per head, ``head_dim`` each; OLMoE: over each whole
    projection), and the q / k / v biases (Qwen2)."""
    h, moe, gemma = model.hidden_size, model.moe, model.gemma
    n = (4 if gemma is not None else 2) * h
    if family_of(model).qk_norm or (gemma is not None and gemma.qk_norm) or (moe is not None and moe.qk_norm == "head"):
        n += 2 * model.head_dim
    elif moe is not None and moe.qk_norm == "all":
        n += model.q_size + model.kv_size
    if model.attention_bias:
        n += model.q_size + 2 * model.kv_size
    return n


def base_decode_params(model: ModelConfig) -> int:
    """Parameters one decode step reads: every layer's projections (every expert's, and the
    router), norms and biases, the final norm and the LM head (tied or not, it is read whole);
    the embedding table only by row, so not counted."""
    h = model.hidden_size
    projections = sum(d_in * d_out for d_in, d_out in model.module_dims().values())
    router = model.moe.num_experts * h if model.moe is not None else 0
    return model.num_layers * (projections + router + _layer_small_params(model)) + h + model.vocab_size * h


def base_token_params(model: ModelConfig) -> int:
    """Parameters one token computes with: :func:`base_decode_params` less the experts it is not
    routed to (a dense base: the same)."""
    moe = model.moe
    if moe is None:
        return base_decode_params(model)
    expert = 3 * model.hidden_size * moe.intermediate_size
    return base_decode_params(model) - model.num_layers * (moe.num_experts - moe.top_k) * expert


def uniform_ranks(model: ModelConfig, rank: int, modules: Iterable[str]) -> dict[tuple[int, str], int]:
    """The ranks of an adapter of ``rank`` on ``modules`` of every layer (a shape, no file). An
    expert kind (``experts.gate_proj``) is every expert's on a MoE base; a module the base lacks
    (a dense MLP on a MoE base, experts on a dense one) is left out."""
    wanted = tuple(modules)
    unknown = [m for m in wanted if m not in MODULES + EXPERT_KINDS]
    if unknown or not wanted:
        raise ValueError(f"modules must be some of {', '.join(MODULES)}; got {', '.join(wanted) or 'none'}")
    if {"experts.gate_proj", "experts.up_proj"} & set(wanted):  # the per-module form is the larger
        wanted = tuple(m for m in wanted if m != "experts.gate_up_proj")
    dims = model.lora_dims()
    return {(layer, m): rank for layer in range(model.num_layers) for m in dims if module_kind(m) in wanted}


@dataclass(frozen=True)
class AdapterCost:
    """One adapter's projected cost against its base, at a reference batch."""

    adapter_params: int  # read per token (on a MoE base, the experts' at top_k / E)
    base_params: int  # one token computes with (a dense base: all, read by one decode step)
    adapter_bytes: int  # read once per step by every batch it is in (in the pool's adapter dtype)
    base_bytes: int  # read once per step, whatever the batch
    reference_batch: int  # rows, each on its own adapter

    @property
    def projected_cost_pct(self) -> float:
        """Extra decode bytes per token at the reference batch, in % of the base's."""
        return self.bytes_pct_at(self.reference_batch)

    @property
    def flops_pct(self) -> float:
        """Extra FLOPs per token, in % of the base's (the same at any batch)."""
        return 100.0 * self.adapter_params / self.base_params

    def bytes_pct_at(self, distinct: int) -> float:
        """Extra decode bytes of a step holding ``distinct`` adapters of this shape, in % of the base read."""
        return 100.0 * distinct * self.adapter_bytes / self.base_bytes


def project_cost(
    model: ModelConfig,
    ranks: Mapping[tuple[int, str], int],
    *,
    reference_batch: int = DEFAULT_REFERENCE_BATCH,
    base_bytes_per_param: int = 2,
    adapter_bytes_per_param: int = 2,
    extra_params: int = 0,
) -> AdapterCost:
    """The cost of an adapter with ``ranks`` ((layer, module) -> r) on ``model``; ``extra_params``
    what its PEFT variants add to a decode step's reads (``peft_variants.variant_params``)."""
    if reference_batch < 1:
        raise ValueError(f"the reference batch must be >= 1; got {reference_batch}")
    params = adapter_token_params(model, ranks) + extra_params
    return AdapterCost(
        adapter_params=params,
        base_params=base_token_params(model),
        adapter_bytes=params * adapter_bytes_per_param,
        base_bytes=base_decode_params(model) * base_bytes_per_param,
        reference_batch=reference_batch,
    )
