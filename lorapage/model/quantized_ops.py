"""The kernel ops of a quantized base: the base's projections packed and multiplied as the served
scheme (``--quantization``, or a pre-quantized checkpoint's) wants, on one device or on each
tensor-parallel rank over its shard (each rank packs its own; a row-parallel shard's rows are
scaled over the columns it holds, as vLLM quantizes each rank's shard)."""

from __future__ import annotations

import dataclasses
import logging

import torch

from lorapage.kernels.backend import KernelOps
from lorapage.kernels.cpu_isa import cpu_flags, int8_dot_product
from lorapage.kernels.linear_cpu import keep_weight, pack_weight
from lorapage.kernels.linear_fp8 import linear_fp8, pack_fp8
from lorapage.kernels.linear_int8 import linear_int8, pack_int8
from lorapage.kernels.linear_w8a8 import linear_w8a8
from lorapage.kernels.linear_w8a8_fbgemm import fbgemm_available, linear_w8a8_fbgemm
from lorapage.model.config import ModelConfig
from lorapage.model.quant_scheme import serving_quantization

log = logging.getLogger("lorapage.engine")


def quantized_ops(
    ops: KernelOps, quantization: str | None, device: torch.device, model: ModelConfig, lm_head: bool = False
) -> KernelOps:
    """``ops`` with the base's projections quantized: as ``quantization`` names (EngineConfig checked
    the name and the dtype), or as the pre-quantized checkpoint is (``model.quantization``; the two
    must agree); ``ops`` as they are when neither is. On a CPU int8 weight-only
    (``kernels/linear_int8.py``) or w8a8, the same int8 weights with the activations quantized per
    token (``kernels/linear_w8a8.py``; on an x86 CPU without int8 dot products, FBGEMM's GEMM with
    7-bit activations, ``kernels/linear_w8a8_fbgemm.py``); fp8 weight-only anywhere (``kernels/linear_fp8.py``: on a
    CPU a slow correctness path). A MoE base's experts are packed and run as the projections are
    (``MoeMlp.pack``, one ``linear`` per expert). ValueError where it cannot run: int8 or w8a8 on
    CUDA. ``lm_head`` (int8 and w8a8): the logits' weight quantized too; otherwise it stays float32,
    packed as the float32 projections are."""
    name = serving_quantization(quantization, model.quantization)
    if lm_head and name not in ("int8", "w8a8"):  # the served scheme: named, or the checkpoint's
        raise ValueError(
            f"EngineConfig.quantize_lm_head needs an int8 or w8a8 base (lm_head in their int8 rows); this one "
            f"serves {name or 'unquantized'}"
        )
    if name is None:
        return ops
    if name == "fp8":  # the logits' lm_head stays in the model's dtype, a plain tensor for F.linear
        return dataclasses.replace(ops, pack_weight=pack_fp8, linear=linear_fp8, pack_logits=keep_weight)
    if device.type != "cpu":
        raise ValueError(
            f"EngineConfig.quantization {name!r} runs on a CPU only (torch's int8 GEMMs there); "
            "on CUDA serve fp8 or the unquantized base"
        )
    linear = linear_w8a8 if name == "w8a8" else linear_int8
    if name == "w8a8" and int8_dot_product(cpu_flags()) is False:
        # torch's int8 GEMM takes a reference path without them (25-60x slower than float32 at 32 rows).
        if fbgemm_available():
            linear = linear_w8a8_fbgemm
            log.info("quantization 'w8a8' on a CPU without int8 dot products: FBGEMM's int8 GEMM, 7-bit activations")
        else:
            log.warning(
                "quantization 'w8a8' on a CPU without int8 dot-product instructions (VNNI, AMX, SDOT) and a "
                "torch without FBGEMM: torch's int8 GEMM takes a slow path here (a w8a8 engine measured 13x "
                "slower than float32 on an AVX2 AMD EPYC); serve 'int8' or the unquantized base (docs/kernels.md)"
            )
    logits = pack_int8 if lm_head else pack_weight
    return dataclasses.replace(ops, pack_weight=pack_int8, linear=linear, pack_logits=logits)
