"""What Gemma 2 and Gemma 3 (text) add to the Llama shape, read from ``config.json``.

Both save their rope settings in two forms: flat (``rope_theta``, ``rope_local_base_freq``,
``rope_scaling``: the Hub's Gemma 3 configs, written by transformers 4) and nested per layer type
(``rope_parameters: {"full_attention": {...}, "sliding_attention": {...}}``: transformers 5).
"""

from __future__ import annotations

from dataclasses import dataclass

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Architectures refused with a reason of their own, appended to the "not supported" error.
REFUSED = {
    "Gemma3ForConditionalGeneration": (
        ": Gemma 3's vision-language checkpoint (4B and up); lorapage runs Gemma 3's text model "
        "(Gemma3ForCausalLM, e.g. gemma-3-1b, or a text-only export of a larger one)"
    ),
}
# The activations HF's ACT2FN names that Gemma checkpoints use, and whether each is gelu's tanh form.
ACTIVATIONS = {"gelu_pytorch_tanh": True, "gelu_new": True, "gelu_fast": True, "gelu": False}
# transformers' defaults where config.json leaves a key out: (global, local) rope bases.
_DEFAULT_THETA = {"Gemma2ForCausalLM": (10000.0, 10000.0), "Gemma3ForCausalLM": (1_000_000.0, 10000.0)}


@dataclass(frozen=True)
class GemmaConfig:
    """Gemma's numbers on top of :class:`~lorapage.model.config.ModelConfig`."""

    query_pre_attn_scalar: float  # attention scale is its -1/2 power, not head_dim's
    attn_logit_softcapping: float | None  # scores s become c * tanh(s / c) (Gemma 2: 50)
    final_logit_softcapping: float | None  # the same on the logits (Gemma 2: 30)
    tanh_gelu: bool  # GeGLU's gelu: the tanh approximation (gelu_pytorch_tanh) or exact
    qk_norm: bool  # Gemma 3: an RMSNorm on each query and key head before rope
    global_rope_theta: float
    global_rope_scaling: dict | None  # Gemma 3 4B+: linear, factor 8 (global layers only)
    local_rope_theta: float  # the sliding-window layers' base (Gemma 3: rope_local_base_freq)

    @classmethod
    def from_raw(cls, raw: dict, arch: str) -> GemmaConfig:
        """Gemma's settings of a parsed ``config.json``; what lorapage cannot run is refused."""
        if raw.get("use_bidirectional_attention"):
            raise ValueError(
                "config.json: use_bidirectional_attention is an embedding model's (EmbeddingGemma): "
                "lorapage serves causal language models"
            )
        if raw.get("attention_bias"):
            raise ValueError(
                "config.json: attention_bias on a Gemma model is not supported (no released Gemma has one)"
            )
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ACTIVATIONS:
            raise ValueError(
                f"config.json: hidden_activation {act!r} is not supported; expected one of {list(ACTIVATIONS)}"
            )
        global_theta, local_theta = _DEFAULT_THETA[arch]
        params = raw.get("rope_parameters") or {}
        if "full_attention" in params or "sliding_attention" in params:
            full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
            global_theta = full.get("rope_theta", raw.get("rope_theta", global_theta))
            local_theta = local.get("rope_theta", raw.get("rope_local_base_freq", local_theta))
            if local.get("rope_type", "default") != "default":
                raise ValueError("config.json: rope scaling on Gemma's sliding-window layers is not supported")
        else:
            full = raw.get("rope_scaling") or params
            global_theta = raw.get("rope_theta", params.get("rope_theta", global_theta))
            # Gemma 2 has one base for every layer.
            local_theta = raw.get("rope_local_base_freq", global_theta if arch == "Gemma2ForCausalLM" else local_theta)
        scaling = full if full.get("rope_type", full.get("type", "default")) != "default" else None
        return cls(
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar", 256),
            attn_logit_softcapping=raw.get("attn_logit_softcapping", 50.0 if arch == "Gemma2ForCausalLM" else None),
            final_logit_softcapping=raw.get("final_logit_softcapping", 30.0 if arch == "Gemma2ForCausalLM" else None),
            tanh_gelu=ACTIVATIONS[act],
            qk_norm=arch == "Gemma3ForCausalLM",
            global_rope_theta=global_theta,
            global_rope_scaling=scaling,
            local_rope_theta=local_theta,
        )
