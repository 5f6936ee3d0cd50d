"""A quantized base on a CPU (``quantization int8``): int8 weight-only, per-channel symmetric,
through torch's own CPU kernel for it (``torch._weight_int8pack_mm``).

``pack_int8(W)`` keeps ``q = round(W / s)`` in [-127, 127] per output row with ``s = max|W_row| /
127`` rounded *up* to a bfloat16 value (the kernel takes bfloat16 scales: so each weight's error is
at most ``s / 2`` and nothing else). ``linear_int8(x, Wq) = (bf16(x) @ q.T) * s`` rounded to bfloat16,
then widened to ``x``'s dtype: the kernel's fast path takes bfloat16 activations (its float32 path is
a scalar fallback, 30-50x slower than oneDNN's float32 GEMM on the bench CPU). So each projection
carries the weight's rounding (<= s / 2), the activations' rounding to bfloat16 and the output's
(each within 2^-8 relatively). The LoRA ops, norms, attention, residual sums and the logits stay in
the model's float32: ``lm_head`` is not quantized. A pre-quantized checkpoint's scales that are not
bfloat16 values (a float32 model's) are applied to the kernel's output instead of inside it,
``bf16(bf16(x) @ q.T) * s``: the same one bfloat16 rounding of the product, the scales exact.

Why not torchao: its ``Int8WeightOnlyConfig`` (0.18) runs ``mm(x, q.T.to(x.dtype)) * s`` in eager
mode, widening the whole weight on every call (relying on ``torch.compile`` to fuse it): on the bench
CPU 6x slower than the float32 GEMM. oneDNN's int8 GEMMs through torch quantize the activations too.
A weight held here is an :class:`Int8Rows`: the int8 tensor with its scales attached.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lorapage.kernels import linear_cpu as cpu

QMAX = 127


class ScaledRows(Tensor):
    """A quantized weight ``q`` [d_out, d_in] carrying its per-row ``scales`` [d_out]: it stands for
    ``q * scales[:, None]`` (:func:`dequantize`)."""

    scales: Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # plain tensor ops


class Int8Rows(ScaledRows):
    """An int8 weight [d_out, d_in] carrying its per-row ``scales`` [d_out]: bfloat16 (the kernel's),
    or float32 where a pre-quantized checkpoint's scales are not bfloat16 values (applied to the GEMM's
    output instead, so the checkpoint's scales are used exactly)."""


def bf16_round_up(x: Tensor) -> Tensor:
    """The smallest bfloat16 values >= ``x`` (positive float32)."""
    down = x.to(torch.bfloat16)
    below = down.float() < x
    return torch.where(below, torch.nextafter(down, torch.tensor(float("inf"), dtype=torch.bfloat16)), down)


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """``(q, s)``: ``weight`` [d_out, d_in] as int8 rows ``q`` and bfloat16 scales ``s`` [d_out] with
    ``|q * s - weight| <= s / 2`` elementwise (an all-zero row gets scale 1)."""
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1)
    scales = bf16_round_up(torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax)))
    q = torch.round(w / scales.float()[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.contiguous(), scales


def pack_int8(weight: Tensor) -> Tensor:
    """``weight`` quantized (:func:`quantize_rows`), held as :class:`Int8Rows`; an Int8Rows as it is."""
    if isinstance(weight, Int8Rows):
        return weight
    q, scales = quantize_rows(weight)
    rows = q.as_subclass(Int8Rows)
    rows.scales = scales
    return rows


def dequantize(weight: Tensor) -> Tensor:
    """A packed weight (int8 or fp8 rows) as float32 ``q * s`` (a new tensor); any other weight as it is."""
    if not isinstance(weight, ScaledRows):
        return weight
    return weight.as_subclass(Tensor).float() * weight.scales.float()[:, None]


def dense_weight(weight: Tensor) -> Tensor:
    """Any base weight as a plain tensor: an int8 one dequantized to float32, a oneDNN-packed one
    unpacked (:func:`lorapage.kernels.linear_cpu.dense_weight`), others as they are."""
    return dequantize(weight) if isinstance(weight, ScaledRows) else cpu.dense_weight(weight)


def linear_int8(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, q * s, bias)`` for a packed ``weight`` as the module docstring rounds it, in
    ``x``'s dtype; another weight (the logits' ``lm_head``, float32) runs :func:`linear_cpu`."""
    if not isinstance(weight, Int8Rows):
        return cpu.linear_cpu(x, weight, bias)
    xb, q, scales = x.to(torch.bfloat16).contiguous(), weight.as_subclass(Tensor), weight.scales
    if scales.dtype == torch.bfloat16:
        y = torch._weight_int8pack_mm(xb, q, scales).to(x.dtype)
    else:  # a checkpoint's float32 scales: bf16(bf16(x) @ q.T) * s, the same one output rounding
        y = torch._weight_int8pack_mm(xb, q, torch.ones_like(scales, dtype=torch.bfloat16)).to(x.dtype) * scales
    return y if bias is None else y + bias
