"""Model shape read from a Hugging Face ``config.json`` (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3/4,
Gemma 2/3 text; Mixtral, OLMoE and Qwen3-MoE with :mod:`lorapage.model.moe_config`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lorapage.model.gemma_config import GEMMA_ARCHITECTURES, REFUSED, GemmaConfig
from lorapage.model.moe_config import MOE_ARCHITECTURES, MoeConfig, split_expert_module
from lorapage.model.quant_scheme import CheckpointQuantization, checkpoint_quantization
from lorapage.model.windows import layer_windows

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    *GEMMA_ARCHITECTURES,
    *MOE_ARCHITECTURES,
)
# Rotary types lorapage computes (lorapage/model/rope.py); anything else is refused at load.
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")

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
    partial_rotary_factor: float = 1.0  # share of head_dim that rotates (Phi-4-mini: 0.75)
    sliding_window: int | None = None  # Phi-3's window: the context is capped at it (see context_length)
    # Per layer, the sliding window its attention reads (None: global); () when no layer has one.
    layer_windows: tuple[int | None, ...] = ()
    gemma: GemmaConfig | None = None  # Gemma 2 / 3's additions; None for every other family
    moe: MoeConfig | None = None  # the router and experts of a MoE family; None: a dense MLP
    # Tensor-parallel ranks an adapter is split over (lorapage.parallel.shard_config): on a rank's
    # model, its LoRA pages hold 1/lora_shards of each matrix (lora_shape); 1 on one device.
    lora_shards: int = 1
    # A pre-quantized checkpoint's scheme (compressed-tensors, quant_scheme.py); None: float weights.
    quantization: CheckpointQuantization | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        if not isinstance(raw, dict):
            raise ValueError("config.json is not a JSON object")
        arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {arch!r} is not supported; lorapage runs {', '.join(SUPPORTED_ARCHITECTURES)} "
                f"(docs/families.md){REFUSED.get(arch, '')}"
            )
        missing = [k for k in REQUIRED_KEYS if k not in raw]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}: not a decoder lorapage can run")
        gemma = GemmaConfig.from_raw(raw, arch) if arch in GEMMA_ARCHITECTURES else None
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_params = raw.get("rope_parameters") or {}
        scaling = _rope_scaling(raw, arch, rope_params)
        theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        if gemma is not None:  # Gemma 3's rope is per layer type; these are the global layers'
            theta, scaling = gemma.global_rope_theta, gemma.global_rope_scaling
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
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", gemma is not None),
            attention_bias=raw.get("attention_bias", arch == "Qwen2ForCausalLM"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            partial_rotary_factor=raw.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0)),
            sliding_window=_sliding_window(raw, arch),
            layer_windows=layer_windows(raw, arch, raw["num_hidden_layers"]),
            gemma=gemma,
            moe=MoeConfig.from_raw(arch, raw),
            quantization=checkpoint_quantization(raw),
        )

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, None where it attends to every position."""
        return self.layer_windows[layer] if self.layer_windows else None

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

    def projection_dims(self) -> dict[str, tuple[int, int]]:
        """:meth:`module_dims` of the shared projections only (on a MoE base, attention's: its
        experts' are apart); what per-column variants (DoRA, lora_bias) are laid out over."""
        return {m: d for m, d in self.module_dims().items() if m in MODULES}

    def lora_dims(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of every module an adapter may target: :meth:`module_dims`, and on a MoE
        base each expert's fused gate_up (PEFT's ``target_parameters``)."""
        dims = self.module_dims()
        return dims if self.moe is None else dims | self.moe.fused_dims(self.hidden_size)

    def lora_shape(self, module: str, rank: int) -> tuple[int, int, int]:
        """(A rows, A columns, B rows) of a rank-``rank`` LoRA on ``module`` as this model's pages
        hold it: on a tensor-parallel rank's model (``lora_shards`` k > 1, S-LoRA's and vLLM's fully
        sharded LoRA), a column-parallel module's A keeps ``ceil(r / k)`` of its rows (its B is
        already the rank's output rows) and a row-parallel one's B keeps ``1/k`` of its output rows
        (its A is already the rank's input columns); B's columns are always the whole ``r``. An
        expert's gate / up (or fused gate_up) is column-parallel, its down row-parallel."""
        d_in, d_out = self.lora_dims()[module]
        k = self.lora_shards
        if k == 1:
            return rank, d_in, d_out
        expert = split_expert_module(module)
        if (module if expert is None else expert[1]) in ROW_PARALLEL:
            return rank, d_in, d_out // k
        return -(-rank // k), d_in, d_out

    def lora_layer_elements(self, max_rank: int) -> int:
        """Elements of one layer of the largest adapter allowed (``max_rank`` on every module) in
        this model's pages: at most, a group's stacked A rounding up once per module."""
        total = 0
        for m in self.module_dims():
            a_rows, d_in, b_rows = self.lora_shape(m, max_rank)
            total += a_rows * d_in + b_rows * max_rank
        return total

    def derived_max_len(self) -> int:
        """The positions the model serves, as vLLM derives them: ``max_position_embeddings``, or for
        a ``yarn`` / ``dynamic`` rotary table its original length times ``factor``."""
        s = self.rope_scaling or {}
        kind = s.get("rope_type", s.get("type"))
        if kind == "yarn" and s.get("factor"):
            original = s.get("original_max_position_embeddings") or self.max_position_embeddings
            return max(self.max_position_embeddings, int(original * s["factor"]))
        if kind == "dynamic":
            return int(self.max_position_embeddings * s["factor"])
        return self.max_position_embeddings


def _rope_scaling(raw: dict, arch: str, rope_params: dict) -> dict | None:
    """The rotary scaling as one dict (``rope_scaling``, or transformers 5's ``rope_parameters``),
    refused unless lorapage computes its type. Phi-3 spells ``longrope`` ``su`` or ``yarn`` in old
    checkpoints (transformers reads both as ``longrope``) and keeps its original length at the top."""
    scaling = raw.get("rope_scaling") or (rope_params if rope_params.get("rope_type", "default") != "default" else None)
    if not scaling:
        return None
    scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}  # read apart
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    if arch == "Phi3ForCausalLM" and kind in ("su", "yarn"):
        kind = "longrope"
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported; lorapage computes {', '.join(ROPE_TYPES)}")
    scaling["rope_type"] = kind
    if "original_max_position_embeddings" not in scaling and "original_max_position_embeddings" in raw:
        scaling["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    return scaling


def _sliding_window(raw: dict, arch: str) -> int | None:
    """The attention window of a family whose every layer would apply it; lorapage caps the context
    there (attention is then exactly full). Qwen's ``use_sliding_window`` windows some layers only:
    refused, as is any other family's window beyond its families' own handling."""
    if arch == "Phi3ForCausalLM":
        return raw.get("sliding_window")
    if arch == "Qwen3ForCausalLM" and raw.get("use_sliding_window"):
        raise ValueError(
            "Qwen3 with use_sliding_window=true (windowed upper layers) is not supported; "
            "the released Qwen3 checkpoints set it false"
        )
    return None


MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Projection groups that share an input, so one LoRA shrink serves all of a group's modules and
# the base runs one fused GEMM per group.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
# Under tensor parallelism (lorapage.parallel): the projections split by their input rows, whose
# outputs are partial sums until an all-reduce; the others are split by output columns.
ROW_PARALLEL = ("o_proj", "down_proj")
ROW_GROUPS = (1, 3)  # their indices in GROUPS


def context_length(config: ModelConfig, max_model_len: int | None, allow_long: bool = False) -> int:
    """The context an engine serves: ``--max-model-len`` when given, else the model's positions (at
    most 8,192, and within Phi-3's sliding window). A length past the model's positions (for
    ``yarn`` / ``dynamic`` rope, scaled as vLLM scales them) is refused, as vLLM refuses it, unless
    ``allow_long`` (its ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``)."""
    derived = config.derived_max_len()
    window = config.sliding_window
    if max_model_len is None:
        return min(derived, 8192, window or derived)
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1; got {max_model_len}")
    if window is not None and max_model_len > window:
        raise ValueError(
            f"max_model_len ({max_model_len}) is greater than the model's sliding window ({window}): lorapage "
            f"does not window {config.architecture}'s attention yet, so it serves at most {window} tokens "
            f"(where full attention is exactly the window). Lower --max-model-len to at most {window}"
        )
    if max_model_len > derived and not allow_long:
        scaled = ", scaled by its rope factor" if derived != config.max_position_embeddings else ""
        raise ValueError(
            f"max_model_len ({max_model_len}) is greater than the model's context (max_position_embeddings{scaled}: "
            f"{derived}): positions past it may give wrong outputs. Lower --max-model-len to at most {derived}, "
            "or pass --allow-long-max-model-len to serve it anyway"
        )
    return max_model_len
