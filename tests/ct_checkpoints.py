"""Pre-quantized checkpoints written by compressed-tensors' own API (the format vLLM loads), from a
float checkpoint saved by transformers: the scales computed as llm-compressor's min-max observer
computes them (``calculate_qparams`` over each output row, or the whole tensor), the weights
compressed by ``ModelCompressor`` and ``config.json`` written by it."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from hf_reference import TOKENIZER_FILES

from lorapage.kernels.linear_w8a8_fbgemm import quantize_activations_ref


def compress_checkpoint(
    src: Path,
    out: Path,
    *,
    weight_type: str = "int",
    strategy: str = "channel",
    activations: bool = False,
    fmt: str | None = None,
    ignore: tuple[str, ...] = ("lm_head",),
) -> Path:
    """``src`` (a float checkpoint) quantized to 8-bit ``weight_type`` weights (int | float) with
    ``strategy`` scales, dynamic per-token int8 activations when ``activations`` (W8A8), saved to
    ``out`` in ``fmt`` (default: int-quantized / float-quantized)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    weights = QuantizationArgs(num_bits=8, type=weight_type, symmetric=True, strategy=strategy)
    acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts if activations else None)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.data
            dims = dict(dim=1, keepdim=True) if strategy == "channel" else {}
            lo, hi = (w.amin(**dims), w.amax(**dims)) if dims else (w.min(), w.max())
            scale, zero = calculate_qparams(lo, hi, module.quantization_scheme.weights)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    fmt = fmt or ("int-quantized" if weight_type == "int" else "float-quantized")
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for f in TOKENIZER_FILES:
        shutil.copy(src / f, out / f)
    return out


def round_like_the_int8_kernel(model: torch.nn.Module) -> None:
    """Hooks on every quantized projection of a transformers model (a module with a ``weight_scale``,
    decompressed) that round as ``quantization int8``'s kernel does with a checkpoint's float32
    scales (kernels/linear_int8.py): the input to bfloat16, and the product before its row's scale
    ``bf16(x @ q.T) * s``. Its reference then differs from lorapage by float32 sums only."""
    bf16 = lambda t: t.to(torch.bfloat16).to(t.dtype)  # noqa: E731

    def output(module: torch.nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        s = module.weight_scale.reshape(-1)
        return bf16(out / s) * s

    for module in model.modules():
        if hasattr(module, "weight_scale"):
            module.register_forward_pre_hook(lambda _m, args: (bf16(args[0]), *args[1:]))
            module.register_forward_hook(output)


def quantize_activations_like_w8a8(model: torch.nn.Module, fbgemm: bool = False) -> None:
    """On every quantized projection of a transformers model: compressed-tensors' own activation
    quantization off (it divides each token's absmax by 127.5 and clamps to [-128, 127]), and a hook
    that quantizes each token's input as ``quantization w8a8`` does (kernels/linear_w8a8.py, vLLM's
    dynamic per-token int8: ``round(x * (127 / absmax))`` in [-127, 127], scale ``absmax / 127``),
    so the reference differs from lorapage by float32 sums only. ``fbgemm``: as the route a CPU
    without int8 dot products runs (kernels/linear_w8a8_fbgemm.py: 7-bit steps over each token's
    [-absmax, absmax])."""

    def quantize(_module: torch.nn.Module, args: tuple) -> tuple:
        x = args[0]
        if fbgemm:
            return (quantize_activations_ref(x), *args[1:])
        a = x.abs().amax(-1, keepdim=True)
        q = torch.round(x * torch.where(a > 0, 127 / a, torch.zeros_like(a))).clamp(-127, 127)
        return (q * (a / 127), *args[1:])

    for module in model.modules():
        if hasattr(module, "weight_scale"):
            module.quantization_enabled = False
            module.register_forward_pre_hook(quantize)
