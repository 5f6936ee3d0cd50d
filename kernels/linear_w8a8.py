"""A quantized base on a CPU with int8 activations too (``quantization w8a8``): int8 weights per
output channel (an :class:`~lorapage.kernels.linear_int8.Int8Rows`, as ``int8`` keeps them) and
int8 activations quantized per token at run time, multiplied in int32 by torch's int8 GEMM
(``torch._int_mm``: oneDNN, VNNI where the CPU has it). The arithmetic class of llama.cpp's Q8_0
(which scales activations per 32-block) and of vLLM's compressed-tensors W8A8-int8 (per-channel
weights, dynamic per-token activations).

The PyTorch reference (:func:`linear_w8a8_ref`), for ``x`` [T, d_in] float32 and a weight ``q``
[d_out, d_in] int8 with scales ``s_w`` [d_out]::

    a = x.abs().amax(1, keepdim=True)                  # a row with a < 2^-100 (zeros): q_x = 0, s_x = 1
    q_x = torch.round(x * (127 / a)).clamp(-127, 127).to(torch.int8)
    s_x = a / 127
    y = torch._int_mm(q_x, q.T).float() * s_x * s_w.float() + bias

Each activation's error is at most ``s_x (1/2 + 128 g_3)`` (round to nearest, of ``x / s_x`` computed
as ``x * (127 / a)``: three roundings, ``g_3 = 3u / (1 - 3u)``, u = 2^-24), each weight's ``s_w / 2``
(:func:`~lorapage.kernels.linear_int8.quantize_rows`); the int32 sums are exact (|sum| <= d_in * 127^2
< 2^31 for d_in < 133,000), and the float32 conversion and two products round each within float32's
unit. The LoRA ops, norms, attention, residual sums and the logits stay float32 (``lm_head`` is not
quantized).

:func:`linear_w8a8` runs the same with the two passes around the GEMM in C (``linear_w8a8.h``, built
with the CPU path's kernels): as torch ops they cost as much as the GEMM itself at 32 rows. The
activations' quantization is the reference's bit for bit; the rescale writes float32 over the GEMM's
int32 result in place. Where the C kernels are not built, the reference runs.

Why not ``_weight_int8pack_mm`` (``int8``): it takes bfloat16 activations and its GEMM is no faster
than float32 at 32 rows; an int8 x int8 GEMM reads a quarter of float32's bytes and runs 4 products per
32-bit element (VNNI). The weight goes in as the transposed view of its [d_out, d_in] rows (``q.T``): oneDNN
takes it as is, faster than a contiguous [d_in, d_out] copy at few rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lorapage.kernels import linear_cpu as cpu
from lorapage.kernels.cpu_build import cpu_kernels
from lorapage.kernels.linear_int8 import QMAX, Int8Rows

TINY = 2.0**-100  # a row whose largest |x| is below it quantizes to zeros (127 / a overflows below ~2^-121)


def gemm_operands(weight: Int8Rows) -> tuple[Tensor, Tensor]:
    """``(q.T, s_w)``: ``weight`` as the GEMM reads it (a transposed view of its int8 rows) and its
    scales in float32 (bfloat16 when :func:`~lorapage.kernels.linear_int8.pack_int8` made it; a loaded
    checkpoint's may be float32); made once and kept on the weight (again if its scales change)."""
    s = weight.scales
    kept = weight.__dict__.get("_w8a8")
    if kept is None or kept[0] is not s or kept[1] != s._version:
        kept = (s, s._version, weight.as_subclass(Tensor).t(), s.float().contiguous())
        weight.__dict__["_w8a8"] = kept
    return kept[2], kept[3]


def quantize_activations_ref(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(q_x, s_x)``: each row of ``x`` [T, d_in] (float32) as int8 over its scale [T, 1], as the module
    docstring's reference rounds it."""
    a = x.abs().amax(1, keepdim=True)
    live = a >= TINY
    inv = torch.where(live, QMAX / a, torch.zeros_like(a))
    q = torch.round(x * inv).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, torch.where(live, a / QMAX, torch.ones_like(a))


def linear_w8a8_ref(x: Tensor, weight: Int8Rows, bias: Tensor | None = None) -> Tensor:
    """The reference: ``F.linear(x, q * s_w, bias)`` with ``x`` quantized per row to int8 first."""
    q_x, s_x = quantize_activations_ref(x.float())
    q_t, s_w = gemm_operands(weight)
    y = torch._int_mm(q_x, q_t).float() * s_x * s_w
    return (y if bias is None else y + bias).to(x.dtype)


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`quantize_activations_ref` in one C pass over ``x`` [T, d_in] float32 (rows unit-stride);
    its scales as a [T] vector. The reference where the C kernels are not built."""
    lib = cpu_kernels()
    if lib is None or x.dtype != torch.float32:
        q, s = quantize_activations_ref(x.float())
        return q, s[:, 0]
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, d_in = x.shape
    q = torch.empty(rows, d_in, dtype=torch.int8)
    s = torch.empty(rows, dtype=torch.float32)
    lib.w8a8_quantize_rows(x.data_ptr(), x.stride(0), rows, d_in, q.data_ptr(), s.data_ptr(), torch.get_num_threads())
    return q, s


def linear_w8a8(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, q * s_w, bias)`` for an :class:`Int8Rows` ``weight`` with ``x`` [T, d_in]
    quantized per row to int8, as the module docstring computes it, in ``x``'s dtype; another weight
    (the logits' ``lm_head``, float32) runs :func:`~lorapage.kernels.linear_cpu.linear_cpu`."""
    if not isinstance(weight, Int8Rows):
        return cpu.linear_cpu(x, weight, bias)
    lib = cpu_kernels()
    if lib is None or x.dtype != torch.float32 or x.dim() != 2:
        return linear_w8a8_ref(x.reshape(-1, x.shape[-1]), weight, bias).reshape(*x.shape[:-1], -1)
    threads = torch.get_num_threads()
    q_t, s_w = gemm_operands(weight)
    q_x, s_x = quantize_activations(x)
    acc = torch._int_mm(q_x, q_t)
    rows, d_out = acc.shape
    if bias is not None:
        bias = bias.float().contiguous()
    lib.w8a8_rescale(
        acc.data_ptr(), rows, d_out, s_x.data_ptr(), s_w.data_ptr(), 0 if bias is None else bias.data_ptr(), threads
    )
    return acc.view(torch.float32)
