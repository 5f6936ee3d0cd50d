"""A pre-quantized checkpoint's weights (compressed-tensors; :mod:`lorapage.model.quant_scheme`
reads its scheme) held as lorapage's quantized rows, the checkpoint's values and scales used as
they are: never dequantized and quantized again.

:func:`load_checkpoint` reads the tensors. Each projection's quantized values (int8, packed int8
or e4m3) are widened, exactly, to the model's dtype, so the decoder fuses them per group as it
fuses float weights; its ``weight_scale`` ([d_out, 1] per channel, [1] per tensor) becomes a
float32 vector [d_out]. :func:`quantized_base` then narrows each fused projection back to its
8-bit type, exactly, with the group's scales stacked the same way (kernels/linear_int8.py's
:class:`Int8Rows`, kernels/linear_fp8.py's :class:`Fp8Rows`). A quantized module that is not a
projection (an ``lm_head`` the checkpoint did not ignore) is dequantized to the model's dtype, as
transformers decompresses it. Loading holds the widened weights once: the peak is the model in
its dtype, not in 8 bits.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from lorapage.kernels.linear_fp8 import FP8, fp8_rows
from lorapage.kernels.linear_int8 import Int8Rows
from lorapage.model.config import GROUPS, ModelConfig
from lorapage.model.families import family_of, group_weight
from lorapage.model.llama import PROJECTIONS, LlamaModel
from lorapage.model.loader import load_state_dict, weight_files
from lorapage.model.quant_scheme import CheckpointQuantization

# Where each fused projection's modules live in a layer: (LlamaModel.layers key, checkpoint prefix).
PROJECTION_PREFIXES = tuple(zip(PROJECTIONS, ("self_attn.", "self_attn.", "mlp.", "mlp."), strict=True))


def unpack_int8(packed: Tensor, shape: Tensor) -> Tensor:
    """compressed-tensors' pack-quantized 8-bit weights: four values a little-endian int32 word
    along each row, each stored as ``value + 128``; ``shape`` is the weight's [d_out, d_in]."""
    rows, cols = (int(n) for n in shape.tolist())
    if packed.dtype != torch.int32 or packed.shape != (rows, -(-cols // 4)):
        raise ValueError(f"pack-quantized weight {tuple(packed.shape)} {packed.dtype} does not hold {rows}x{cols} int8")
    as_bytes = packed.contiguous().view(torch.uint8).view(rows, -1)
    if torch.tensor([1], dtype=torch.int32).view(torch.uint8)[0] == 0:  # a big-endian host
        as_bytes = as_bytes.view(rows, -1, 4).flip(-1).reshape(rows, -1)
    return (as_bytes[:, :cols].to(torch.int16) - 128).to(torch.int8)


def projection_modules(config: ModelConfig) -> list[str]:
    """The checkpoint names of every module the decoder fuses into its projections."""
    family, out = family_of(config), []
    for i in range(config.num_layers):
        for (_, sub), group in zip(PROJECTION_PREFIXES, GROUPS, strict=True):
            fused = family.fused_name(group)
            out += [f"model.layers.{i}.{sub}{m}" for m in ([fused] if fused else group)]
    return out


def _check_servable(scheme: CheckpointQuantization, dtype: torch.dtype, config: ModelConfig) -> None:
    if scheme.name in ("int8", "w8a8") and dtype != torch.float32:
        raise ValueError(
            f"the checkpoint is {scheme.name}-quantized (compressed-tensors): serve it with dtype float32 "
            f"(its kernel runs bfloat16 activations into an int8 GEMM and widens the result); got {dtype}"
        )
    if config.moe is not None:
        raise ValueError(
            f"a {scheme.name}-quantized MoE checkpoint is not supported yet (its experts' scales are not read); "
            "serve its float checkpoint with --quantization, which quantizes the experts too"
        )


def load_checkpoint(model_dir: str | Path, dtype: torch.dtype, config: ModelConfig) -> tuple[dict, dict]:
    """``(state, scales)``: every tensor of the checkpoint in ``dtype`` (an unquantized one:
    :func:`~lorapage.model.loader.load_state_dict`, and no scales), and for a quantized one each
    projection module's float32 scales [d_out] by module name, its weight the quantized values."""
    scheme = config.quantization
    if scheme is None:
        return load_state_dict(model_dir, dtype), {}
    _check_servable(scheme, dtype, config)
    raw: dict[str, Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            raw.update((key, f.get_tensor(key)) for key in f.keys())
    state, scales = {}, {}
    for key in [k for k in raw if k.endswith(".weight_scale")]:
        module = key.removesuffix(".weight_scale")
        if module + ".weight_packed" in raw:
            q = unpack_int8(raw.pop(module + ".weight_packed"), raw.pop(module + ".weight_shape"))
        else:
            q = raw.pop(module + ".weight")
        if q.dtype not in (torch.int8, FP8):
            raise ValueError(f"{module}.weight is {q.dtype}; a compressed {scheme.name} checkpoint holds int8 or e4m3")
        zero = raw.pop(module + ".weight_zero_point", None)
        if zero is not None and bool(zero.ne(0).any()):
            raise ValueError(f"{module}.weight_zero_point is not zero: asymmetric weights are not supported")
        s = raw.pop(key).float().reshape(-1)
        scales[module] = s.expand(q.shape[0]).contiguous() if s.numel() == 1 else s
        state[module + ".weight"] = q.to(dtype)
    for module in [m for m in scales if m not in set(projection_modules(config))]:
        state[module + ".weight"] = (state[module + ".weight"].float() * scales.pop(module)[:, None]).to(dtype)
    missing = [m for m in projection_modules(config) if m not in scales]
    if missing:
        raise ValueError(
            f"the {scheme.name} checkpoint leaves {missing[0]} (and {len(missing) - 1} more) unquantized: lorapage "
            "serves a quantized base with every projection quantized"
        )
    state.update((k, t.to(dtype) if t.is_floating_point() else t) for k, t in raw.items())
    return state, scales


def quantized_base(model: LlamaModel, scales: dict[str, Tensor]) -> LlamaModel:
    """``model`` with each projection (holding a checkpoint's quantized values, widened) narrowed
    back to its quantized rows with the checkpoint's ``scales``; as it is when ``scales`` is empty."""
    scheme = model.config.quantization
    if scheme is None or not scales:
        return model
    if model.config.lora_shards > 1:
        raise ValueError(
            "a pre-quantized checkpoint cannot be served with tensor_parallel_size > 1 yet (its scales would be cut "
            "with the shards): serve it with tensor_parallel_size 1, or its float checkpoint with --quantization, "
            "which each rank applies to its own shard"
        )
    for i, layer in enumerate(model.layers):
        for (key, sub), group in zip(PROJECTION_PREFIXES, GROUPS, strict=True):
            fused = group_weight(scales.__getitem__, f"model.layers.{i}.{sub}", model.config, group)
            layer[key] = _rows(layer[key], fused.to(model.device), scheme.name)
    if model.device.type == "cuda":  # the widened weights' blocks back to the device: the pool is sized next
        torch.cuda.empty_cache()
    return model


def _rows(values: Tensor, scales: Tensor, name: str) -> Tensor:
    if name == "fp8":
        return fp8_rows(values.to(FP8), scales)
    rows = values.to(torch.int8).as_subclass(Int8Rows)
    # bfloat16 scales go into torch's kernel as they are; others are applied to its output exactly.
    rows.scales = scales.bfloat16() if bool((scales.bfloat16().float() == scales).all()) else scales
    return rows
