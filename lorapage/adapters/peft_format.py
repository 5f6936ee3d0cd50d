"""Reading PEFT LoRA directories: ``adapter_config.json`` + ``adapter_model.safetensors`` (or .bin).

Registration reads the config and the safetensors header (shapes only) and refuses anything the
engine would serve wrongly; the weights themselves are read later, in a worker thread, when a
request first needs them. ``base_model_name_or_path`` is never trusted: shapes are checked
against the loaded base instead.
"""

from __future__ import annotations

import io
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors_bytes

from lorapage.errors import AdapterFormatError
from lorapage.model.config import MODULES, ModelConfig

_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)
_UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head")
SAFETENSORS_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}


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

    def num_params(self, model: ModelConfig) -> int:
        dims = model.module_dims()
        return sum(r * sum(dims[m]) for (_, m), r in self.ranks.items())


def _fail(path: Path, why: str) -> AdapterFormatError:
    return AdapterFormatError(f"adapter at {path}: {why}")


def _pattern_value(patterns: dict, module_name: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: first key matching the module name's suffix."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module_name):
            return value
    return default


def _read_config(path: Path) -> dict:
    cfg_file = path / "adapter_config.json"
    if not path.is_dir():
        raise _fail(path, "not a directory")
    if not cfg_file.exists():
        raise _fail(path, "no adapter_config.json (expected a PEFT LoRA directory)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise _fail(path, f"adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise _fail(path, "adapter_config.json must hold a JSON object")
    refusals = (
        (cfg.get("peft_type", "LORA") != "LORA", f"peft_type {cfg.get('peft_type')!r} is not LORA"),
        (bool(cfg.get("use_dora")), "DoRA adapters (use_dora=true) are not supported"),
        (
            bool(cfg.get("modules_to_save")),
            f"modules_to_save {cfg.get('modules_to_save')} is not supported: only LoRA deltas can be batched",
        ),
        (cfg.get("bias", "none") != "none", f"bias={cfg.get('bias')!r} is not supported (only 'none')"),
        (bool(cfg.get("fan_in_fan_out")), "fan_in_fan_out=true is for Conv1D models, not Llama-family"),
    )
    for bad, why in refusals:
        if bad:
            raise _fail(path, why)
    targets = cfg.get("target_modules") or []
    names = [targets] if isinstance(targets, str) else list(targets)
    for t in names:
        if any(u in t for u in _UNSUPPORTED_TARGETS):
            raise _fail(path, f"LoRA on {t!r} (embedding / lm_head) is not supported")
    return cfg


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (tensor names, dtypes, shapes), without its data."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                raise ValueError("header length is implausible")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise _fail(path.parent, f"{path.name} is not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return header


def _tensor_shapes(path: Path) -> tuple[Path, dict[str, list[int]]]:
    st = path / "adapter_model.safetensors"
    if st.exists():
        header = read_safetensors_header(st)
        for key, meta in header.items():
            if meta.get("dtype") not in SAFETENSORS_DTYPES:
                raise _fail(path, f"tensor {key} has dtype {meta.get('dtype')}; expected F32, F16 or BF16")
        return st, {k: v["shape"] for k, v in header.items()}
    binf = path / "adapter_model.bin"
    if binf.exists():
        state = _load_bin(binf)
        return binf, {k: list(v.shape) for k, v in state.items()}
    raise _fail(path, "no adapter_model.safetensors or adapter_model.bin")


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        return torch.load(io.BytesIO(path.read_bytes()), map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a bad pickle
        raise _fail(path.parent, f"{path.name} could not be read ({e})") from None


def parse_key(path: Path, key: str) -> tuple[int, str, str]:
    """(layer, module, "A" | "B") of a LoRA weight key, or a specific refusal."""
    if "lora_embedding" in key or any(u in key for u in _UNSUPPORTED_TARGETS):
        raise _fail(path, f"tensor {key}: LoRA on embeddings / lm_head is not supported")
    m = _KEY.match(key)
    if not m:
        raise _fail(path, f"tensor {key} is not a LoRA A/B weight of a Llama-family projection")
    layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
    if module not in MODULES:
        raise _fail(path, f"tensor {key}: module {module!r} is not one of {MODULES}")
    return layer, module, ab


def read_adapter_spec(path: str | Path, model: ModelConfig, max_lora_rank: int) -> AdapterSpec:
    """Validate a PEFT LoRA directory against ``model`` without reading its weight data."""
    path = Path(path)
    cfg = _read_config(path)
    weights_file, shapes = _tensor_shapes(path)
    dims = model.module_dims()
    pairs: dict[tuple[int, str], dict[str, list[int]]] = {}
    for key, shape in shapes.items():
        layer, module, ab = parse_key(path, key)
        if layer >= model.num_layers:
            raise _fail(path, f"tensor {key}: layer {layer} does not exist (base has {model.num_layers})")
        pairs.setdefault((layer, module), {})[ab] = shape
    if not pairs:
        raise _fail(path, "no LoRA weights found")
    ranks, scales = {}, {}
    alpha_default = cfg.get("lora_alpha", cfg.get("r", 8))
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise _fail(path, f"{where} has lora_{''.join(ab)} but not both lora_A and lora_B")
        d_in, d_out = dims[module]
        r = ab["A"][0] if len(ab["A"]) == 2 else -1
        if ab["A"] != [r, d_in] or ab["B"] != [d_out, r]:
            raise _fail(
                path,
                f"{where}: lora_A {ab['A']} / lora_B {ab['B']} do not fit the base "
                f"(expected [r, {d_in}] and [{d_out}, r]); was it trained on another model?",
            )
        if not 1 <= r <= max_lora_rank:
            raise _fail(path, f"{where}: rank {r} exceeds max_lora_rank {max_lora_rank}")
        name = f"model.layers.{layer}.{'self_attn' if module in MODULES[:4] else 'mlp'}.{module}"
        alpha = _pattern_value(cfg.get("alpha_pattern") or {}, name, alpha_default)
        ranks[(layer, module)] = r
        scales[(layer, module)] = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return AdapterSpec(
        path=path,
        weights_file=weights_file,
        ranks=ranks,
        scales=scales,
        target_modules=tuple(m for m in MODULES if any(k[1] == m for k in ranks)),
        max_rank=max(ranks.values()),
        size_bytes=weights_file.stat().st_size,
    )


def load_adapter_tensors(
    spec: AdapterSpec, dtype: torch.dtype
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Read the weights: (layer, module) -> (A [r, d_in], B [d_out, r]) in ``dtype``.

    Reads the file in one go (no mmap), so this is the part that runs in a worker thread.
    """
    if spec.weights_file.suffix == ".bin":
        state = _load_bin(spec.weights_file)
    else:
        try:
            state = load_safetensors_bytes(spec.weights_file.read_bytes())
        except Exception as e:  # safetensors raises its own error types for truncated files
            raise _fail(spec.path, f"{spec.weights_file.name} could not be read ({e})") from None
    out: dict[tuple[int, str], list] = {}
    for key, t in state.items():
        layer, module, ab = parse_key(spec.path, key)
        out.setdefault((layer, module), [None, None])["AB".index(ab)] = t.to(dtype)
    if out.keys() != spec.ranks.keys():
        raise _fail(spec.path, "weights changed since registration (targeted modules differ)")
    for key, (a, b) in out.items():
        if a.shape[0] != spec.ranks[key] or b.shape[1] != spec.ranks[key]:
            raise _fail(spec.path, f"weights changed since registration (rank of {key} differs)")
    return {k: (v[0], v[1]) for k, v in out.items()}
