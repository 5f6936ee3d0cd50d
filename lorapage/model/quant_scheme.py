"""What a pre-quantized checkpoint's ``config.json`` says its weights hold, read the way vLLM reads
compressed-tensors checkpoints (``quantization_config.quant_method == "compressed-tensors"``), and
mapped to lorapage's ``quantization`` names:

- int8 weights, per channel or per tensor, symmetric, no activation quantization -> ``int8``;
- the same with dynamic per-token symmetric int8 activations (W8A8) -> ``w8a8``;
- float8 (e4m3) weights, per channel or per tensor, no activation quantization -> ``fp8``.

Anything else (4-bit or grouped weights, asymmetric, fp8 or static activations, transforms,
sparsity, another ``quant_method``) is refused with a one-line reason naming the scheme. No tensors
here: :mod:`lorapage.model.quantized_checkpoint` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Formats whose 8-bit weights are one int8 / float8 tensor per module beside ``weight_scale``,
# and the one that packs int8 values into int32 words (``weight_packed``, ``weight_shape``).
PLAIN_FORMATS = ("int-quantized", "float-quantized", "naive-quantized")
PACKED_FORMAT = "pack-quantized"
WEIGHT_STRATEGIES = ("channel", "tensor")


@dataclass(frozen=True)
class CheckpointQuantization:
    """A compressed-tensors checkpoint's one weight scheme, as lorapage serves it."""

    name: str  # lorapage's quantization: int8 | w8a8 | fp8
    strategy: str  # channel (a scale per output row) | tensor (one per module)
    packed: bool  # int8 values packed four to an int32 word (pack-quantized)


def _refuse(reason: str) -> ValueError:
    return ValueError(f"config.json quantization_config: {reason}")


def _scheme_name(group: str, weights: dict[str, Any], acts: dict[str, Any] | None) -> str:
    """lorapage's name for one config group's weights and input activations."""
    bits, kind = weights.get("num_bits"), weights.get("type", "int")
    strategy = weights.get("strategy")
    what = f"{group}: {bits}-bit {kind} weights, strategy {strategy}"
    if bits != 8:
        raise _refuse(f"{what}: lorapage serves 8-bit weights only (int8, fp8); use an unquantized base")
    if strategy not in WEIGHT_STRATEGIES:
        raise _refuse(f"{what}: only per-channel or per-tensor scales are supported (not group or block)")
    if not weights.get("symmetric", True) or weights.get("dynamic", False):
        raise _refuse(f"{what}: asymmetric (zero-point) or dynamic weights are not supported")
    if kind not in ("int", "float"):
        raise _refuse(f"{what}: unknown weight type")
    if acts is None:
        return "int8" if kind == "int" else "fp8"
    act = (
        f"{acts.get('num_bits')}-bit {acts.get('type', 'int')} activations, strategy {acts.get('strategy')}, "
        f"dynamic {acts.get('dynamic', False)}"
    )
    w8a8 = (acts.get("num_bits"), acts.get("type", "int"), acts.get("strategy"), acts.get("dynamic"))
    if kind == "int" and w8a8 == (8, "int", "token", True) and acts.get("symmetric", True):
        return "w8a8"
    raise _refuse(
        f"{what} with {act}: activation quantization is served only as dynamic per-token symmetric int8 "
        "(W8A8; fp8 or static activation scales are not supported)"
    )


def checkpoint_quantization(raw: dict[str, Any]) -> CheckpointQuantization | None:
    """The scheme ``config.json`` (``raw``) declares; None when it declares none. ValueError with a
    one-line reason for a scheme lorapage cannot serve."""
    qc = raw.get("quantization_config") or raw.get("compression_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise _refuse(
            f"quant_method {method!r} is not supported: lorapage loads compressed-tensors checkpoints "
            "(int8, W8A8 int8, fp8); or serve the unquantized base with --quantization"
        )
    for key, what in (("sparsity_config", "sparsity"), ("transform_config", "transforms (rotations)")):
        if qc.get(key):
            raise _refuse(f"{what} ({key}) are not supported")
    if qc.get("kv_cache_scheme"):
        raise _refuse("kv_cache_scheme (a quantized KV cache from the checkpoint) is not supported")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(f"quantization_status {status!r}: lorapage reads compressed weights only")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse("no config_groups")
    found = set()
    for group, scheme in groups.items():
        fmt = scheme.get("format") or qc.get("format")
        if fmt not in (*PLAIN_FORMATS, PACKED_FORMAT):
            raise _refuse(f"{group}: format {fmt!r} is not supported (int-quantized, float-quantized, pack-quantized)")
        if scheme.get("output_activations"):
            raise _refuse(f"{group}: output activation quantization is not supported")
        weights = scheme.get("weights")
        if not weights:
            raise _refuse(f"{group}: activation-only quantization is not supported")
        name = _scheme_name(group, weights, scheme.get("input_activations"))
        found.add((name, weights["strategy"], fmt == PACKED_FORMAT))
    if len(found) > 1:
        raise _refuse(f"{len(found)} different schemes across config_groups; lorapage serves one for every projection")
    name, strategy, packed = found.pop()
    if packed and name != "int8":
        raise _refuse(f"pack-quantized {name} weights are not supported")
    return CheckpointQuantization(name=name, strategy=strategy, packed=packed)


def serving_quantization(requested: str | None, checkpoint: CheckpointQuantization | None) -> str | None:
    """The quantization an engine serves: the checkpoint's when it has one (``requested`` must then
    be None or agree), else ``requested`` (applied at load). ValueError when they disagree."""
    if checkpoint is None:
        return requested
    if requested is not None and requested != checkpoint.name:
        raise ValueError(
            f"EngineConfig.quantization {requested!r} disagrees with the checkpoint, which is already quantized "
            f"{checkpoint.name} (compressed-tensors): drop --quantization or pass {checkpoint.name}"
        )
    return checkpoint.name
