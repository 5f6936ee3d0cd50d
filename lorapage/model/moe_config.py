"""Mixture-of-experts shape read from ``config.json`` (Mixtral, Qwen3-MoE, OLMoE), and the names the
expert LoRA modules go by.

An expert's projections are named ``experts.{e}.gate_proj`` (and ``up_proj``, ``down_proj``): the
key of one (layer, module) in an adapter's ranks, the same key :meth:`ModelConfig.module_dims`
gives the base's matrix. PEFT's ``target_parameters`` on the fused ``gate_up_proj`` tensor trains
one A per expert for gate and up together: that is ``experts.{e}.gate_up_proj``, a LoRA module
with no base matrix of its own (its B's rows are gate's, then up's). Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
EXPERT_MODULES = ("gate_proj", "up_proj", "down_proj")  # one expert's matrices, as the base holds them
FUSED_GATE_UP = "gate_up_proj"
# What an expert module is, whichever expert: how the envelope's classes and the docs name them.
EXPERT_KINDS = ("experts.gate_proj", "experts.up_proj", "experts.gate_up_proj", "experts.down_proj")


@dataclass(frozen=True)
class MoeConfig:
    """The router and experts of every layer (no family here has a shared expert, and every layer
    is sparse: Qwen3-MoE's dense ``mlp_only_layers`` are refused), and the attention's extras."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool  # the top-k probabilities renormalised to sum to 1 (Mixtral: always)
    # RMSNorm of q and k before the rotation: "head" per head (Qwen3-MoE), "all" over the whole
    # projection (OLMoE), "" none (Mixtral).
    qk_norm: str
    float32_weights: bool  # Mixtral weighs an expert's output in float32; the others in the model's dtype
    clip_qkv: float | None = None  # OLMoE: q, k (normed) and v clamped to [-clip, clip]

    @classmethod
    def from_raw(cls, arch: str, raw: dict) -> MoeConfig | None:
        """The MoE shape of ``config.json`` (``raw``) for ``arch``; None for a dense family."""
        if arch not in MOE_ARCHITECTURES:
            return None
        experts = raw.get("num_local_experts") or raw.get("num_experts")
        if not experts or not raw.get("num_experts_per_tok"):
            raise ValueError(f"config.json of a {arch} lacks num_local_experts / num_experts_per_tok")
        if arch == "MixtralForCausalLM":
            return cls(experts, raw["num_experts_per_tok"], raw["intermediate_size"], True, "", True)
        if arch == "OlmoeForCausalLM":
            top_k, inter, norm = raw["num_experts_per_tok"], raw["intermediate_size"], raw.get("norm_topk_prob", False)
            return cls(experts, top_k, inter, bool(norm), "all", False, raw.get("clip_qkv"))
        if raw.get("mlp_only_layers") or raw.get("decoder_sparse_step", 1) != 1:
            raise ValueError(
                "Qwen3-MoE with dense layers (mlp_only_layers, decoder_sparse_step != 1) is not supported: "
                "lorapage runs every layer's MLP as experts"
            )
        return cls(
            experts,
            raw["num_experts_per_tok"],
            raw.get("moe_intermediate_size") or raw["intermediate_size"],
            bool(raw.get("norm_topk_prob", False)),
            "head",
            False,
        )

    def expert_dims(self, hidden: int) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of every expert's matrices, keyed as in an adapter's ranks."""
        i = self.intermediate_size
        shape = {"gate_proj": (hidden, i), "up_proj": (hidden, i), "down_proj": (i, hidden)}
        return {expert_module(e, m): shape[m] for e in range(self.num_experts) for m in EXPERT_MODULES}

    def fused_dims(self, hidden: int) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of every expert's fused gate_up LoRA (PEFT's ``target_parameters``)."""
        return {expert_module(e, FUSED_GATE_UP): (hidden, 2 * self.intermediate_size) for e in range(self.num_experts)}


def expert_module(expert: int, name: str) -> str:
    """``experts.3.gate_proj``: the module key of expert 3's ``gate_proj``."""
    return f"experts.{expert}.{name}"


def split_expert_module(module: str) -> tuple[int, str] | None:
    """(expert, name) of an expert module key; None for a dense module (``q_proj``)."""
    head, _, rest = module.partition(".")
    expert, _, name = rest.partition(".")
    return (int(expert), name) if head == "experts" and expert.isdigit() and name else None


def module_kind(module: str) -> str:
    """``experts.gate_proj`` for any expert's gate_proj; a dense module's own name."""
    parts = split_expert_module(module)
    return module if parts is None else f"experts.{parts[1]}"


def ordered_kinds(modules: Iterable[str], dense: tuple[str, ...]) -> tuple[str, ...]:
    """The kinds of ``modules``, dense ones in ``dense``'s order then the expert kinds."""
    kinds = {module_kind(m) for m in modules}
    return tuple(k for k in (*dense, *EXPERT_KINDS) if k in kinds)
