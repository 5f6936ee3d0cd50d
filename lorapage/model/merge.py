"""Merging one LoRA adapter into the base weights: a dedicated deployment's model.

PEFT's rule (``LoraLayer.merge``): per targeted module ``W' = W + scale * B @ A``, with ``scale``
``alpha / r`` (rsLoRA: ``alpha / sqrt(r)``) as :class:`~lorapage.adapters.peft_format.AdapterSpec`
holds it. The sum is taken in float32 and rounded to the model's dtype once, so a 16-bit model
carries one rounding of the merged weight rather than one of the delta and one of the sum.
The model keeps its fused projections (qkv, o, gate_up, down): a module's rows are a slice of its
group's weight, written in place, so tensors captured in CUDA graphs stay the ones replayed; a
weight packed for the CPU's GEMM (``kernels/linear_cpu.py``) is unpacked, edited and packed again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from itertools import groupby

import torch
from torch import Tensor

from lorapage.kernels.linear_int8 import dense_weight
from lorapage.model.config import GROUPS
from lorapage.model.llama import PROJECTIONS, LlamaModel
from lorapage.model.moe import MoeMlp
from lorapage.model.moe_config import split_expert_module

# What merges an adapter into a model in place: merge_adapter, or in a test a deliberately wrong one.
MergeFn = Callable[[LlamaModel, Mapping[tuple[int, str], tuple[Tensor, Tensor]], Mapping[tuple[int, str], float]], None]


def merged_weight(weight: Tensor, a: Tensor, b: Tensor, scale: float) -> Tensor:
    """``(weight.float() + scale * b.float() @ a.float()).to(weight.dtype)``: one module's merged
    weight [d_out, d_in] from A [r, d_in] and B [d_out, r], on ``weight``'s device."""
    assert a.dim() == 2 and b.dim() == 2 and b.shape[1] == a.shape[0], (a.shape, b.shape)
    assert weight.shape == (b.shape[0], a.shape[1]), (weight.shape, a.shape, b.shape)
    dev = weight.device
    delta = b.to(dev, torch.float32) @ a.to(dev, torch.float32)
    return (weight.float() + scale * delta).to(weight.dtype)


def module_rows(model: LlamaModel, module: str) -> tuple[str, int, int]:
    """(fused weight key, first row, end row) of ``module``'s weight inside its group's."""
    for group, (modules, key) in enumerate(zip(GROUPS, PROJECTIONS)):
        if module in modules:
            start = model.out_starts[group][modules.index(module)]
            return key, start, start + model.config.module_dims()[module][1]
    raise KeyError(f"{module!r} is not a projection of a Llama-family layer")


def module_weight(model: LlamaModel, layer: int, module: str) -> Tensor:
    """``module``'s base weight [d_out, d_in] in layer ``layer``, as a float32 copy (DoRA's norms)."""
    key, start, end = module_rows(model, module)
    return model.dense_weight(layer, key)[start:end].float().clone()


def merge_adapter(
    model: LlamaModel,
    tensors: Mapping[tuple[int, str], tuple[Tensor, Tensor]],
    scales: Mapping[tuple[int, str], float],
) -> None:
    """Merge an adapter into ``model``'s weights in place: ``tensors`` (layer, module) -> (A, B)
    as :func:`~lorapage.adapters.peft_format.load_adapter_tensors` reads them, ``scales`` the
    spec's. The model then computes base + adapter on the plain base path (no LoRA op)."""

    experts = {k: v for k, v in tensors.items() if split_expert_module(k[1]) is not None}
    tensors = {k: v for k, v in tensors.items() if k not in experts}
    with torch.no_grad():
        for (layer, module), (a, b) in experts.items():
            merge_expert(model.moe_layers[layer], module, a, b, scales[(layer, module)])

    def weight_of(item: tuple[tuple[int, str], object]) -> tuple[int, str]:
        (layer, module), _ = item
        return layer, module_rows(model, module)[0]

    with torch.no_grad():
        for (layer, key), items in groupby(sorted(tensors.items(), key=weight_of), key=weight_of):
            weight = model.dense_weight(layer, key)
            for (_, module), (a, b) in items:
                _, start, end = module_rows(model, module)
                weight[start:end].copy_(merged_weight(weight[start:end], a, b, scales[(layer, module)]))
            model.store_weight(layer, key, weight)


def merge_expert(mlp: MoeMlp, module: str, a: Tensor, b: Tensor, scale: float) -> None:
    """Merge one expert module's LoRA (``experts.{e}.gate_proj``, ``up_proj``, fused
    ``gate_up_proj`` or ``down_proj``) into ``mlp``'s expert weights, as :func:`merge_adapter` does
    a dense module's."""
    parts = split_expert_module(module)
    assert parts is not None, module
    expert, name = parts
    inter = mlp.config.intermediate_size
    weights = mlp.down if name == "down_proj" else mlp.gate_up
    start, end = (inter, 2 * inter) if name == "up_proj" else (0, b.shape[0])
    weight = dense_weight(weights[expert])
    weight[start:end].copy_(merged_weight(weight[start:end], a, b, scale))
    if weight is not weights[expert]:
        weights[expert] = mlp.pack_weight(weight)
