"""Reading PEFT LoRA directories: ``adapter_config.json`` + ``adapter_model.safetensors``.

Registration reads the config and the safetensors header (shapes only) and refuses anything the
engine would serve wrongly; the weights themselves are read later, in a worker thread, when a
request first needs them, and are refused then if any value is NaN or Inf. Nothing user-supplied
can run code or take unbounded time: ``adapter_model.bin`` (a pickle) is never opened, and PEFT's
``rank_pattern`` / ``alpha_pattern`` keys, which are regexes, are bounded and matched with RE2
(linear time). ``base_model_name_or_path`` is never trusted for shapes (they are checked against
the loaded base); it is only the name registration looks the trained-on base up by
(:mod:`lorapage.adapters.binding`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

import re2
import torch

from lorapage.adapters.files import read_regular
from lorapage.adapters.moe_format import (
    check_expert_forms,
    expert_geometry,
    parse_expert_key,
    peft_module_name,
    split_fused,
)
from lorapage.adapters.peft_variants import (
    NO_VARIANTS,
    Variants,
    check_pairs,
    is_variant_key,
    read_variants,
    refuse_config,
    unknown_key,
)
from lorapage.adapters.safetensors_buffer import (
    ReadBuffer,
    SafetensorsFormatError,
    read_header,
    read_stamped,
    tensor_views,
)
from lorapage.adapters.verified import FileStamp
from lorapage.errors import AdapterFormatError
from lorapage.model.config import MODULES, ModelConfig
from lorapage.model.families import checkpoint_module_dims, refuse_foreign_module, split_fused_pairs, split_fused_values
from lorapage.model.moe_config import ordered_kinds

_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)
# Bounds on rank_pattern / alpha_pattern: PEFT writes at most one key per module (under 900 on
# the largest Llama), and a key longer than a module name has no reason to be.
MAX_PATTERN_KEYS = 1024
MAX_PATTERN_KEY_CHARS = 512
# Bounds on what registration reads before it knows the adapter fits the base: a config holding
# the largest patterns above is about 1 MB; a header has one entry (~150 bytes) per weight, under
# 2,000 on the largest Llama. The weights' bytes then follow from shapes checked against the base.
MAX_CONFIG_BYTES = 4 << 20
MAX_HEADER_BYTES = 16 << 20
_Regex: TypeAlias = re2._Regexp  # google-re2 has no public name for a compiled pattern
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a refused key is reported to the caller, not logged by RE2
_RE2_OPTIONS.never_capture = True  # only "does it match" is asked: lets RE2 use its DFA
_RE2_OPTIONS.max_mem = 64 << 10  # a key whose program outgrows this (e.g. nested {999}) is refused


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter is, as registered: per (layer, module) its rank and scale."""

    path: Path
    weights_file: Path
    ranks: dict[tuple[int, str], int]  # (layer, module) -> rank, for every targeted pair
    scales: dict[tuple[int, str], float]  # (layer, module) -> alpha / r (or alpha / sqrt(r))
    target_modules: tuple[str, ...]
    max_rank: int
    size_bytes: int  # bytes of the weights file
    trained_on: str | None = None  # base_model_name_or_path as the config says it (None: absent); not stored
    model: ModelConfig | None = None  # the base it was checked against: splits a fused module's weights (Phi-3)
    # (experts, hidden, expert intermediate) of the MoE base it was read against: how its fused
    # expert LoRA splits per expert (moe_format.py); None: a dense base.
    expert_geometry: tuple[int, int, int] | None = None
    variants: Variants = NO_VARIANTS  # DoRA, lora_bias, embedding LoRA, modules_to_save (peft_variants.py)

    def num_params(self, model: ModelConfig) -> int:
        dims = model.lora_dims()
        return sum(r * sum(dims[m]) for (_, m), r in self.ranks.items())


def at_path(spec: AdapterSpec, path: Path) -> AdapterSpec:
    """The same spec, its files read from ``path`` (a fetched copy of the same content)."""
    return dataclasses.replace(spec, path=path, weights_file=path / spec.weights_file.name)


def _fail(path: Path, why: str) -> AdapterFormatError:
    return AdapterFormatError(f"adapter at {path}: {why}")


def _compile_patterns(path: Path, cfg: dict, field: str) -> list[tuple[_Regex, object]]:
    r"""``cfg[field]`` as (compiled key, value) pairs in PEFT's order, or a specific refusal.

    PEFT (``peft.utils.other.get_pattern_key``) takes the first key for which
    ``re.match(rf"(.*\.)?({key})$", module_name)`` matches; the same template is compiled here
    with RE2, which refuses what it cannot run in linear time (backreferences, lookaround).
    """
    patterns = cfg.get(field) or {}
    if not isinstance(patterns, dict):
        raise _fail(path, f"{field} must be a JSON object of module-name regex -> value")
    if len(patterns) > MAX_PATTERN_KEYS:
        raise _fail(path, f"{field} has {len(patterns)} keys; at most {MAX_PATTERN_KEYS} are accepted")
    compiled = []
    for key, value in patterns.items():
        shown = key if len(key) <= 80 else f"{key[:80]}..."
        if len(key) > MAX_PATTERN_KEY_CHARS:
            raise _fail(path, f"{field} key {shown!r} is {len(key)} characters; at most {MAX_PATTERN_KEY_CHARS}")
        try:
            compiled.append((re2.compile(rf"(.*\.)?({key})$", _RE2_OPTIONS), value))
        except re2.error as e:
            why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
            raise _fail(
                path,
                f"{field} key {shown!r} is not a regex RE2 accepts ({why}); keys are matched in linear "
                "time, so backreferences, lookaround and very large repetitions are refused",
            ) from None
    return compiled


def _pattern_value(patterns: list[tuple[_Regex, object]], module_name: str, default: object) -> object:
    """PEFT's rank_pattern / alpha_pattern lookup: the value of the first key that matches."""
    for regex, value in patterns:
        if regex.match(module_name):
            return value
    return default


def _alpha(path: Path, value: object, where: str) -> float:
    # JSON admits NaN and Infinity; a non-finite alpha would make every output of the adapter NaN.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(path, f"{where} must be a finite number; got {value!r}")
    return float(value)


def read_config_bytes(path: Path) -> bytes:
    """``adapter_config.json`` of the adapter directory ``path``, a regular file of at most
    :data:`MAX_CONFIG_BYTES`; else an AdapterFormatError saying why."""
    cfg_file = path / "adapter_config.json"
    if not path.is_dir():
        raise _fail(path, "not a directory")
    if not cfg_file.exists():
        raise _fail(path, "no adapter_config.json (expected a PEFT LoRA directory)")
    try:
        return read_regular(cfg_file, MAX_CONFIG_BYTES)
    except OSError as e:
        raise _fail(path, f"adapter_config.json cannot be read ({e.strerror or e})") from None


def _read_config(path: Path) -> dict:
    try:
        cfg = json.loads(read_config_bytes(path))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise _fail(path, f"adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise _fail(path, "adapter_config.json must hold a JSON object")
    refuse_config(path, cfg)
    return cfg


def _tensor_shapes(path: Path) -> tuple[Path, dict[str, list[int]], int]:
    """The weights file, its tensors' shapes and its size, from its header alone."""
    st = path / "adapter_model.safetensors"
    if not st.exists():
        if (path / "adapter_model.bin").exists():
            # A pickle can run code when unpickled (even torch's weights_only loader has had holes).
            raise _fail(
                path,
                "adapter_model.bin (a pickle) is never loaded; convert it to adapter_model.safetensors "
                "(PeftModel.from_pretrained(...).save_pretrained(dir, safe_serialization=True))",
            )
        raise _fail(path, "no adapter_model.safetensors")
    try:
        header = read_header(st, MAX_HEADER_BYTES)
    except OSError as e:
        raise _fail(path, f"{st.name} cannot be read ({e.strerror or e})") from None
    except SafetensorsFormatError as e:
        raise _fail(path, f"{st.name} is not a well-formed safetensors file ({e})") from None
    return st, {k: shape for k, (_, shape) in header.shapes.items()}, header.size


def parse_key(path: Path, key: str, model: ModelConfig | None = None) -> tuple[int, str, str]:
    """(layer, module, "A" | "B") of a LoRA weight key, or a specific refusal. ``module`` is the
    checkpoint's name, checked against ``model``'s family (fused ``qkv_proj`` on Phi-3) when given."""
    if (expert := parse_expert_key(path, key)) is not None:
        return expert
    m = _KEY.match(key)
    if not m:
        raise _fail(path, unknown_key(key))
    layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
    why = refuse_foreign_module(model, module) if model is not None else None
    if why or (model is None and module not in MODULES):
        raise _fail(path, f"tensor {key}: {why or f'module {module!r} is not one of {MODULES}'}")
    return layer, module, ab


def read_adapter_spec(path: str | Path, model: ModelConfig, max_lora_rank: int) -> AdapterSpec:
    """Validate a PEFT LoRA directory against ``model`` without reading its weight data."""
    path = Path(path)
    cfg = _read_config(path)
    if cfg.get("target_parameters") and model.moe is None:
        raise _fail(
            path,
            f"target_parameters {cfg['target_parameters']} (LoRA on raw parameters, e.g. fused MoE experts) "
            f"is served on MoE bases only: this base has no experts ({model.architecture})",
        )
    weights_file, shapes, size_bytes = _tensor_shapes(path)
    shapes = split_fused(path, shapes, expert_geometry(model), list, _expert_shape)
    dims = model.lora_dims() if model.moe is not None else checkpoint_module_dims(model)
    alpha_default = _alpha(path, cfg.get("lora_alpha", cfg.get("r", 8)), "lora_alpha")
    alpha_pattern = _compile_patterns(path, cfg, "alpha_pattern")

    def alpha_of(name: str) -> float:
        return _alpha(path, _pattern_value(alpha_pattern, name, alpha_default), f"alpha_pattern for {name}")

    variants, variant_keys = read_variants(path, cfg, shapes, model, alpha_of)
    pairs: dict[tuple[int, str], dict[str, list[int]]] = {}
    for key, shape in shapes.items():
        if key in variant_keys:
            continue
        layer, module, ab = parse_key(path, key, model)
        if layer >= model.num_layers:
            raise _fail(path, f"tensor {key}: layer {layer} does not exist (base has {model.num_layers})")
        halves = pairs.setdefault((layer, module), {})
        if ab in halves:  # spelled twice (prefixes differ): the file's size would not follow from the base
            raise _fail(path, f"tensor {key}: a second lora_{ab} weight of layers.{layer}.{module}")
        halves[ab] = shape
    check_expert_forms(path, set(pairs))
    if not pairs and not variants.embedding_rank:
        raise _fail(path, "no LoRA weights found")
    if not 0 <= variants.embedding_rank <= max_lora_rank:
        raise _fail(path, f"embed_tokens: rank {variants.embedding_rank} exceeds max_lora_rank {max_lora_rank}")
    check_pairs(path, cfg, variants, set(pairs), model)
    ranks: dict[tuple[int, str], int] = {}
    scales: dict[tuple[int, str], float] = {}
    _compile_patterns(path, cfg, "rank_pattern")  # ranks come from the shapes; its keys are refused alike
    for (layer, module), halves in sorted(pairs.items()):
        where = f"layers.{layer}.{module}"
        if set(halves) != {"A", "B"}:
            raise _fail(path, f"{where} has lora_{''.join(halves)} but not both lora_A and lora_B")
        if module not in dims:
            raise _fail(path, f"{where}: the base ({model.architecture}) has no such module; trained on another?")
        d_in, d_out = dims[module]
        r = halves["A"][0] if len(halves["A"]) == 2 else -1
        if halves["A"] != [r, d_in] or halves["B"] != [d_out, r]:
            raise _fail(
                path,
                f"{where}: lora_A {halves['A']} / lora_B {halves['B']} do not fit the base "
                f"(expected [r, {d_in}] and [{d_out}, r]); was it trained on another model?",
            )
        if not 1 <= r <= max_lora_rank:
            raise _fail(path, f"{where}: rank {r} exceeds max_lora_rank {max_lora_rank}")
        name = peft_module_name(layer, module)
        alpha = alpha_of(name)
        ranks[(layer, module)] = r
        scales[(layer, module)] = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    ranks, scales = split_fused_values(model, ranks), split_fused_values(model, scales)  # a fused module's parts
    return AdapterSpec(
        path=path,
        weights_file=weights_file,
        ranks=ranks,
        scales=scales,
        target_modules=ordered_kinds((m for _, m in ranks), MODULES),
        max_rank=max(ranks.values(), default=variants.embedding_rank),
        size_bytes=size_bytes,
        trained_on=_trained_on(path, cfg),
        model=model,
        expert_geometry=expert_geometry(model),
        variants=variants,
    )


def _expert_shape(shape: list[int], ab: str, expert: int, rank: int) -> list[int]:
    """One expert's A or B shape out of a fused one's (see moe_format.py)."""
    return [rank, shape[1]] if ab == "A" else [shape[0], rank]


def _expert_matrix(t: torch.Tensor, ab: str, expert: int, rank: int) -> torch.Tensor:
    """One expert's A [r, d_in] or B [d_out, r] out of PEFT's fused ``[r * E, d_in]`` / ``[d_out, r * E]``."""
    if ab == "A":
        return t[expert * rank : (expert + 1) * rank]
    return t.view(t.shape[0], rank, -1)[:, :, expert]


def _trained_on(path: Path, cfg: dict) -> str | None:
    name = cfg.get("base_model_name_or_path")
    if name is not None and not isinstance(name, str):
        raise _fail(path, f"base_model_name_or_path must be a string (the base's name or path); got {name!r:.80}")
    return name


def read_weights(spec: AdapterSpec, into: ReadBuffer | None = None) -> torch.Tensor:
    """The weights file's bytes (see :func:`read_file`), refused before any is read unless the
    file is a regular one of the size registration found; a failed read is a format error naming it."""
    return read_weights_stamped(spec, into)[0]


def read_weights_stamped(spec: AdapterSpec, into: ReadBuffer | None = None) -> tuple[torch.Tensor, FileStamp | None]:
    """:func:`read_weights` and the file's stamp as the read saw it (see :func:`read_stamped`)."""
    try:
        return read_stamped(spec.weights_file, into, size=spec.size_bytes)
    except OSError as e:
        raise _fail(spec.path, f"{spec.weights_file.name} could not be read ({e})") from None


def load_adapter_tensors(
    spec: AdapterSpec, dtype: torch.dtype, data: torch.Tensor | None = None, *, check_finite: bool = True
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Read the weights: (layer, module) -> (A [r, d_in], B [d_out, r]) in ``dtype``, from
    ``data`` (the weights file's bytes as uint8, already read and verified) or the file. Weights
    already in ``dtype`` are views of those bytes.

    Reads the file in one go (no mmap), so this is the part that runs in a worker thread. A
    weight with a NaN or Inf value (or one that overflows ``dtype``) is refused, naming it,
    unless ``check_finite`` is False: bytes verified against the digest of files this check
    passed at registration.
    """
    weights = read_weights(spec) if data is None else data
    try:
        state = tensor_views(weights)
    except SafetensorsFormatError as e:
        raise _fail(spec.path, f"{spec.weights_file.name} could not be read ({e})") from None
    if any("experts" in k for k in state):
        state = split_fused(spec.path, state, spec.expert_geometry, lambda t: list(t.shape), _expert_matrix)
    out: dict[tuple[int, str], list] = {}
    read: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (key, as read, in dtype)
    for key, t in state.items():
        if is_variant_key(key):  # read by peft_variants' loader
            continue
        layer, module, ab = parse_key(spec.path, key, spec.model)
        converted = t if t.dtype == dtype else t.to(dtype)
        out.setdefault((layer, module), [None, None])["AB".index(ab)] = converted
        read.append((key, t, converted))
    if spec.model is not None and all(a is not None and b is not None for a, b in out.values()):
        # a fused module (Phi-3's qkv_proj) becomes its parts, as registered
        out = {k: list(v) for k, v in split_fused_pairs(spec.model, {k: (a, b) for k, (a, b) in out.items()}).items()}
    if out.keys() != spec.ranks.keys():
        raise _fail(spec.path, "weights changed since registration (targeted modules differ)")
    for pair, (a, b) in out.items():
        if a.shape[0] != spec.ranks[pair] or b.shape[1] != spec.ranks[pair]:
            raise _fail(spec.path, f"weights changed since registration (rank of {pair} differs)")
    # One finite sum means every value is finite; only otherwise is each weight looked at, to name
    # it. (A sum can overflow where no value does: then the per-weight check passes them all.)
    if check_finite and not torch.isfinite(torch.stack([c.sum() for _, _, c in read])).all():
        for key, t, converted in read:
            _finite(spec.path, key, t, converted)
    return {k: (v[0], v[1]) for k, v in out.items()}


def _finite(path: Path, key: str, weight: torch.Tensor, converted: torch.Tensor) -> None:
    """Refuse ``weight`` (as read) naming it, if a value of it is not finite once ``converted``."""
    if not torch.isfinite(converted).all():
        overflow = torch.isfinite(weight).all()
        why = f"has values that overflow {converted.dtype}" if overflow else "has NaN or Inf values"
        raise _fail(path, f"adapter weight {key!r} {why}; the adapter cannot be served")
