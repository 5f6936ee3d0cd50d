"""Model shape read from a Hugging Face ``config.json`` (Llama 2/3, Mistral, Qwen2; Mixtral, OLMoE and
Qwen3-MoE with :mod:`lorapage.model.moe_config`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lorapage.model.moe_config import MOE_ARCHITECTURES, MoeConfig

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", *MOE_ARCHITECTURES)

# What config.json must say; everything else has the defaults transformers gives it.
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class ModelConfig:
    """The few numbers the decoder needs; everything else in config.json is ignored."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    moe: MoeConfig | None = None  # the router and experts of a MoE family; None: a dense MLP

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        if not isinstance(raw, dict):
            raise ValueError("config.json is not a JSON object")
        missing = [k for k in REQUIRED_KEYS if k not in raw]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}: not a decoder lorapage can run")
        arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not supported; lorapage runs {SUPPORTED_ARCHITECTURES}")
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_params = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or (
            rope_params if rope_params.get("rope_type", "default") != "default" else None
        )
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta", rope_params.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", arch == "Qwen2ForCausalLM"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=MoeConfig.from_raw(arch, raw),
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def module_dims(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of every LoRA-targetable projection, in the fixed module order (on a MoE
        base, every expert's in place of the dense MLP's)."""
        h, i = self.hidden_size, self.intermediate_size
        attention = {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
        }
        if self.moe is not None:
            return attention | self.moe.expert_dims(h)
        return attention | {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def lora_dims(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of every module an adapter may target: :meth:`module_dims`, and on a MoE
        base each expert's fused gate_up (PEFT's ``target_parameters``)."""
        dims = self.module_dims()
        return dims if self.moe is None else dims | self.moe.fused_dims(self.hidden_size)

    def rope_inv_freq(self) -> torch.Tensor:
        """float32 inverse frequencies, computed as HF computes them (so positions match bit for
        bit), with Llama-3 ``rope_type: llama3`` or ``linear`` scaling applied when configured."""
        import torch

        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        s = self.rope_scaling or {}
        kind = s.get("rope_type", s.get("type"))
        if kind == "llama3":
            factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
            old_len = s["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
            return torch.where(medium, smoothed, scaled)
        if kind == "linear":
            return inv / s["factor"]
        if kind not in (None, "default"):
            raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")
        return inv


MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Projection groups that share an input, so one LoRA shrink serves all of a group's modules and
# the base runs one fused GEMM per group.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def context_length(config: ModelConfig, max_model_len: int | None, allow_long: bool = False) -> int:
    """The context an engine serves: ``--max-model-len`` when given, else the model's positions (at
    most 8,192). A length past the model's positions is refused, as vLLM refuses it, unless
    ``allow_long`` (its ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``)."""
    if max_model_len is None:
        return min(config.max_position_embeddings, 8192)
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1; got {max_model_len}")
    derived = config.max_position_embeddings
    if max_model_len > derived and not allow_long:
        raise ValueError(
            f"max_model_len ({max_model_len}) is greater than the model's context (max_position_embeddings: "
            f"{derived}): positions past it may give wrong outputs. Lower --max-model-len to at most {derived}, "
            "or pass --allow-long-max-model-len to serve it anyway"
        )
    return max_model_len
