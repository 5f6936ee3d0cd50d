"""PEFT LoRA variants beyond plain A/B pairs: what an ``adapter_config.json`` may ask for, and the
tensors those variants add to ``adapter_model.safetensors``.

Served, each per row of the mixed batch (``docs/families.md``, "Adapter variants"):

- **DoRA** (``use_dora``): a ``lora_magnitude_vector`` [d_out] per targeted module;
- **lora_bias**: a ``lora_B.bias`` [d_out] per targeted module;
- **embedding LoRA** (``embed_tokens`` in ``target_modules``): ``lora_embedding_A`` [r, vocab] and
  ``lora_embedding_B`` [hidden, r];
- ``layers_to_transform`` / ``layers_pattern``: only the named layers hold weights (the ranks of
  the others are 0, as the tensor names say).

Registered but never shared: ``modules_to_save`` (a full per-adapter ``lm_head`` / ``embed_tokens``
matrix); the envelope sends it to the dedicated tier (:func:`full_matrix_params`). Everything else
PEFT can write and this engine cannot serve exactly is refused here, each with its own reason.
Pure: no torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lorapage.errors import AdapterFormatError
from lorapage.model.config import MODULES, ModelConfig
from lorapage.model.families import family_of, split_fused_values

if TYPE_CHECKING:
    from torch import Tensor

_PREFIX = r"^(?:base_model\.model\.)?(?:model\.)?"
_LAYER = _PREFIX + r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\."
# Per (layer, module) vectors: DoRA's magnitude, lora_bias's bias of lora_B.
_MAGNITUDE = re.compile(_LAYER + r"lora_magnitude_vector(?:\.[\w-]+)?(?:\.weight)?$")
_LORA_BIAS = re.compile(_LAYER + r"lora_B(?:\.[\w-]+)?\.bias$")
# DoRA / lora_bias on a MoE expert (transformers 4's per-expert modules; peft refuses both on
# target_parameters): refused by name.
_EXPERT_VECTOR = re.compile(_PREFIX + r"layers\.\d+\..*experts\..*(?:lora_magnitude_vector|lora_B(?:\.[\w-]+)?\.bias)")
_EMBEDDING = re.compile(_PREFIX + r"embed_tokens\.lora_embedding_([AB])(?:\.[\w-]+)?(?:\.weight)?$")
# PEFT saves the base's own embedding beside an embedding LoRA (save_embedding_layers): not read.
_EMBED_BASE_COPY = re.compile(_PREFIX + r"embed_tokens\.base_layer\.weight$")
# modules_to_save: a full matrix of the adapter's own (PEFT may keep a ``modules_to_save.<name>`` part).
_FULL_MATRIX = re.compile(_PREFIX + r"(lm_head|embed_tokens)(?:\.modules_to_save\.[\w-]+)?\.weight$")
_FULL_MATRIX_MODULES = ("lm_head", "embed_tokens")
# Targets no Llama-family decoder layer has: vision towers, projectors, audio encoders.
_NON_DECODER = ("vision", "visual", "image", "patch_embed", "mm_projector", "multi_modal", "audio", "encoder")


def _fail(path: Path, why: str) -> AdapterFormatError:
    return AdapterFormatError(f"adapter at {path}: {why}")


@dataclass(frozen=True)
class Variants:
    """What an adapter adds to plain LoRA pairs (nothing, for most)."""

    dora: frozenset[tuple[int, str]] = frozenset()  # (layer, module) with a magnitude vector
    lora_bias: frozenset[tuple[int, str]] = frozenset()  # (layer, module) with a bias on lora_B
    embedding_rank: int = 0  # r of lora_embedding_A / B (0: no embedding LoRA)
    embedding_scale: float = 0.0  # alpha / r (or alpha / sqrt(r)) of the embedding LoRA
    full_matrices: dict[str, list[int]] = field(default_factory=dict)  # modules_to_save name -> shape

    @property
    def has_vectors(self) -> bool:
        """Whether some module's output is changed per column (DoRA or lora_bias)."""
        return bool(self.dora or self.lora_bias)

    @property
    def plain(self) -> bool:
        return not (self.has_vectors or self.embedding_rank or self.full_matrices)


NO_VARIANTS = Variants()


def refuse_config(path: Path, cfg: dict) -> None:
    """Refuse, with a specific reason, what PEFT can configure and this engine does not serve."""
    targets = cfg.get("target_modules") or []
    names = [] if isinstance(targets, str) else list(targets)  # a regex string is judged by the tensors' names
    refusals = (
        (
            cfg.get("peft_type", "LORA") != "LORA",
            f"peft_type {cfg.get('peft_type')!r} is not LORA (only LoRA "
            "adapters and their DoRA / lora_bias / embedding variants are served)",
        ),
        (
            cfg.get("bias", "none") != "none",
            f"bias={cfg.get('bias')!r} trains the base layers' own biases, which "
            "would change the base for every row; only bias='none' is served (lora_bias=true is)",
        ),
        (
            bool(cfg.get("fan_in_fan_out")),
            "fan_in_fan_out=true is for GPT-2 style Conv1D layers; Llama-family projections are nn.Linear",
        ),
        (
            bool(cfg.get("use_dora")) and bool(cfg.get("lora_bias")),
            "use_dora with lora_bias is a combination PEFT itself refuses",
        ),
        (
            bool(cfg.get("trainable_token_indices")),
            "trainable_token_indices (per-adapter rows of the embedding) is not served",
        ),
        (bool(cfg.get("use_qalora")) or bool(cfg.get("use_bdlora")), "QA-LoRA / BD-LoRA variants are not served"),
        (bool(cfg.get("megatron_config")), "megatron_config adapters are not served"),
    )
    for bad, why in refusals:
        if bad:
            raise _fail(path, why)
    for t in names:
        if any(word in str(t).lower() for word in _NON_DECODER):
            raise _fail(
                path,
                f"target_modules names {t!r}, a module outside the language model's decoder "
                "(vision tower / projector / encoder): only the decoder's projections and embed_tokens "
                "are served",
            )
        if "lm_head" in str(t):
            raise _fail(
                path,
                f"LoRA on {t!r} is not served (a per-row delta on the logits projection); "
                "LoRA on embed_tokens and the decoder's projections is",
            )
        if cfg.get("use_dora") and "embed_tokens" in str(t):
            raise _fail(path, "DoRA on embed_tokens is not served (DoRA is, on the decoder's projections)")


def unknown_key(key: str) -> str:
    """Why a weights-file key that is no LoRA A/B weight of a decoder projection is refused."""
    if any(word in key.lower() for word in _NON_DECODER):
        return (
            f"tensor {key} belongs to a module outside the language model's decoder (vision tower / projector / "
            "encoder): only the decoder's projections and embed_tokens are served"
        )
    return f"tensor {key} is not a LoRA A/B weight of a Llama-family projection"


def _module_of(path: Path, key: str, layer: str, module: str, model: ModelConfig) -> tuple[int, str]:
    if module not in MODULES and module not in family_of(model).fused:
        raise _fail(path, f"tensor {key}: module {module!r} is not one of {family_of(model).checkpoint_modules()}")
    if int(layer) >= model.num_layers:
        raise _fail(path, f"tensor {key}: layer {layer} does not exist (base has {model.num_layers})")
    return int(layer), module


def read_variants(
    path: Path, cfg: dict, shapes: dict[str, list[int]], model: ModelConfig, alpha_of: Callable[[str], float]
) -> tuple[Variants, set[str]]:
    """The variants ``shapes`` (the file's tensors) hold, checked against ``model``, and the keys
    they account for (the rest must be LoRA A/B pairs). ``alpha_of``: a module's lora_alpha (by
    its name, as alpha_pattern matches it)."""
    dims, fused = model.projection_dims(), family_of(model).fused
    dora: set[tuple[int, str]] = set()
    bias: set[tuple[int, str]] = set()
    embedding: dict[str, list[int]] = {}
    full: dict[str, list[int]] = {}
    used: set[str] = set()
    for key, shape in shapes.items():
        if _EXPERT_VECTOR.match(key):
            what = "DoRA" if "magnitude" in key else "lora_bias"
            raise _fail(
                path,
                f"tensor {key}: {what} on a MoE expert is not served ({what} is, on the attention projections; "
                "plain LoRA is on the experts)",
            )
        if (m := _MAGNITUDE.match(key)) or (m := _LORA_BIAS.match(key)):
            layer, module = _module_of(path, key, m.group(1), m.group(2), model)
            # A fused module's (Phi-3's qkv_proj) vector is per row of the fused weight: its parts' rows.
            parts = fused.get(module, (module,))
            if any(p not in dims for p in parts) or shape != [sum(dims[p][1] for p in parts)]:
                want = sum(dims[p][1] for p in parts if p in dims)
                raise _fail(path, f"tensor {key} has shape {shape}; the base's {module} has {want} outputs")
            (dora if "magnitude" in key else bias).update((layer, p) for p in parts)
        elif m := _EMBEDDING.match(key):
            embedding[m.group(1)] = shape
        elif m := _FULL_MATRIX.match(key):
            if shape != [model.vocab_size, model.hidden_size]:
                raise _fail(
                    path, f"tensor {key} has shape {shape}; the base's is [{model.vocab_size}, {model.hidden_size}]"
                )
            full[m.group(1)] = shape
        elif not _EMBED_BASE_COPY.match(key):
            continue
        used.add(key)
    if dora and not cfg.get("use_dora"):
        raise _fail(path, "the file holds lora_magnitude_vector tensors but the config does not say use_dora")
    if bias and not cfg.get("lora_bias"):
        raise _fail(path, "the file holds lora_B biases but the config does not say lora_bias")
    saved = cfg.get("modules_to_save") or []
    for name in [saved] if isinstance(saved, str) else list(saved):
        if not any(name == m or name.endswith(f".{m}") for m in _FULL_MATRIX_MODULES):
            raise _fail(
                path,
                f"modules_to_save names {name!r}; only lm_head and embed_tokens can be saved "
                "whole with a Llama-family base",
            )
    r = _embedding_rank(path, embedding, model)
    scale = alpha_of("model.embed_tokens") / (r**0.5 if cfg.get("use_rslora") else r) if r else 0.0
    return Variants(frozenset(dora), frozenset(bias), r, scale, full), used


def _embedding_rank(path: Path, halves: dict[str, list[int]], model: ModelConfig) -> int:
    """r of an embedding LoRA from its A [r, vocab] / B [hidden, r] shapes (0: none)."""
    if not halves:
        return 0
    if set(halves) != {"A", "B"}:
        raise _fail(path, f"embed_tokens has lora_embedding_{''.join(halves)} but not both A and B")
    r = halves["A"][0] if len(halves["A"]) == 2 else -1
    if halves["A"] != [r, model.vocab_size] or halves["B"] != [model.hidden_size, r]:
        raise _fail(
            path,
            f"embed_tokens: lora_embedding_A {halves['A']} / lora_embedding_B {halves['B']} do not "
            f"fit the base (expected [r, {model.vocab_size}] and [{model.hidden_size}, r])",
        )
    return r


def variant_params(variants: Variants, model: ModelConfig) -> int:
    """Values the variants add to what a decode step reads for the adapter (the full matrices
    aside): a d_out vector per DoRA / lora_bias module, and the embedding's B (its A is read one
    column per token, like the base's embedding table)."""
    dims = model.projection_dims()
    vectors = sum(dims[m][1] for _, m in variants.dora | variants.lora_bias)
    return vectors + variants.embedding_rank * model.hidden_size


def full_matrix_params(variants: Variants) -> int:
    """Values of the adapter's own full matrices (``modules_to_save``)."""
    total = 0
    for shape in variants.full_matrices.values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def is_variant_key(key: str) -> bool:
    """Whether a weights-file key is one of the variants' tensors (not a LoRA A/B weight)."""
    return any(p.match(key) for p in (_MAGNITUDE, _LORA_BIAS, _EMBEDDING, _EMBED_BASE_COPY, _FULL_MATRIX))


def variants_to_json(v: Variants) -> dict:
    """``v`` as the registry stores it beside the spec (see :func:`variants_from_json`)."""
    return {
        "dora": sorted(v.dora),
        "lora_bias": sorted(v.lora_bias),
        "embedding": [v.embedding_rank, v.embedding_scale],
        "full_matrices": v.full_matrices,
    }


def variants_from_json(data: dict | None) -> Variants:
    """The variants :func:`variants_to_json` stored (None: a spec stored without any: plain LoRA)."""
    if not data:
        return NO_VARIANTS
    rank, scale = data["embedding"]
    return Variants(
        dora=frozenset((layer, m) for layer, m in data["dora"]),
        lora_bias=frozenset((layer, m) for layer, m in data["lora_bias"]),
        embedding_rank=rank,
        embedding_scale=scale,
        full_matrices={k: list(s) for k, s in data["full_matrices"].items()},
    )


def split_variant(name: str, t: Tensor, model: ModelConfig | None) -> dict[str, Tensor]:
    """A variant tensor by its packer name (:func:`variant_name`), a fused module's vector split
    into its parts' rows (``dora.L.qkv_proj`` -> ``dora.L.q_proj``, ...), as B is."""
    kind, _, rest = name.partition(".")
    layer, _, module = rest.partition(".")
    parts = family_of(model).fused.get(module) if model is not None and kind in ("dora", "bias") else None
    if not parts:
        return {name: t}
    assert model is not None
    dims, out, row = model.projection_dims(), {}, 0
    for p in parts:
        out[f"{kind}.{layer}.{p}"] = t[row : row + dims[p][1]]
        row += dims[p][1]
    return out


def variant_name(key: str) -> str | None:
    """The name the packer knows a variant tensor by (``dora.L.M``, ``bias.L.M``, ``embedding.A``
    / ``embedding.B``), None for a tensor it does not read (the base's embedding copy, full
    matrices, LoRA A/B)."""
    if m := _MAGNITUDE.match(key):
        return f"dora.{int(m.group(1))}.{m.group(2)}"
    if m := _LORA_BIAS.match(key):
        return f"bias.{int(m.group(1))}.{m.group(2)}"
    if m := _EMBEDDING.match(key):
        return f"embedding.{m.group(1)}"
    return None


def check_pairs(path: Path, cfg: dict, variants: Variants, pairs: set[tuple[int, str]], model: ModelConfig) -> None:
    """Every LoRA pair has the vectors its config promises (PEFT gives every targeted module a
    magnitude under use_dora, a lora_B bias under lora_bias), and no vector lacks its pair.
    ``pairs`` as the checkpoint names them (a fused module: its parts)."""
    pairs = set(split_fused_values(model, dict.fromkeys(pairs)))
    for flag, have, what in (("use_dora", variants.dora, "lora_magnitude_vector"), ("lora_bias", variants.lora_bias,
                                                                                     "lora_B bias")):  # fmt: skip
        if extra := sorted(have - pairs):
            layer, module = extra[0]
            raise _fail(path, f"layers.{layer}.{module} has a {what} but no lora_A / lora_B")
        if cfg.get(flag) and (missing := sorted(pairs - have)):
            layer, module = missing[0]
            raise _fail(
                path, f"{flag} is set but layers.{layer}.{module} has no {what} (a partial or hand-edited save?)"
            )
