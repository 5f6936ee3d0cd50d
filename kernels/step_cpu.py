"""The CPU path's per-layer elementwise ops in C (``step_cpu.h``, built with the LoRA kernels): the
residual add with the RMS norm, the rotary embedding, the K/V write and SiLU * up, one call each,
on the calling thread for a decode step's rows. Where the C kernel cannot take the tensors (another
dtype, a layout it does not read, no kernels built) the PyTorch reference runs instead
(``step_ref.py``, ``attention_ref.write_kv_ref``): same signatures, same results within float32's
rounding (bit for bit but the norm's sum and SiLU's exp; see ``step_cpu.h``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lorapage.kernels.attention_ref import write_kv_ref
from lorapage.kernels.cpu_build import cpu_kernels
from lorapage.kernels.step_ref import rms_norm_ref, rope_ref, silu_mul_ref


def _f32_rows(*tensors: Tensor) -> bool:
    """float32 CPU tensors whose last dimension is packed."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)


def rms_norm_cpu(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """:func:`rms_norm_ref`; ``x`` [T, D] takes the residual in place."""
    lib = cpu_kernels()
    parts = (x, weight) if residual is None else (x, weight, residual)
    if lib is None or x.dim() != 2 or not _f32_rows(*parts) or not weight.is_contiguous():
        return rms_norm_ref(x, residual, weight, eps)
    out = torch.empty_like(x)
    res, res_stride = (0, 0) if residual is None else (residual.data_ptr(), residual.stride(0))
    rows, dim = x.shape
    lib.rms_norm_f32(out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), res, res_stride, weight.data_ptr(),
                     rows, dim, eps, torch.get_num_threads())  # fmt: skip
    return x, out


def rope_cpu(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`rope_ref`, in place on ``x`` [T, heads, D] (each head's columns packed)."""
    lib = cpu_kernels()
    rows, heads, dim = x.shape
    if (
        lib is None
        or not _f32_rows(x, cos, sin)
        or x.stride(1) != dim
        or cos.stride() != sin.stride()
        or cos.shape[-1] > dim
        or cos.shape[-1] % 2
    ):
        return rope_ref(x, cos, sin)
    lib.rope_f32(x.data_ptr(), x.stride(0), heads, dim, cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                 cos.shape[-1], rows, torch.get_num_threads())  # fmt: skip
    return x


def silu_mul_cpu(gate_up: Tensor, inter: int) -> Tensor:
    """:func:`silu_mul_ref` into a new [T, inter] tensor."""
    lib = cpu_kernels()
    if lib is None or gate_up.dim() != 2 or not _f32_rows(gate_up):
        return silu_mul_ref(gate_up, inter)
    out = gate_up.new_empty(gate_up.shape[0], inter)
    lib.silu_mul_f32(out.data_ptr(), out.stride(0), gate_up.data_ptr(), gate_up.stride(0), gate_up.shape[0], inter,
                     torch.get_num_threads())  # fmt: skip
    return out


def write_kv_cpu(kv: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """:func:`write_kv_ref` for float32 pages: each token's K and V rows copied into its slot."""
    lib = cpu_kernels()
    if (
        lib is None
        or not _f32_rows(kv, k, v)
        or not kv[0].is_contiguous()
        or k.stride(1) != k.shape[2]
        or v.stride(1) != v.shape[2]
        or slot_mapping.dtype != torch.int64
        or not slot_mapping.is_contiguous()
    ):
        write_kv_ref(kv, k, v, slot_mapping)
        return
    width = kv.shape[3] * kv.shape[4]
    lib.write_kv_f32(kv.data_ptr(), kv.stride(0), kv.shape[2], width, k.data_ptr(), k.stride(0), v.data_ptr(),
                     v.stride(0), slot_mapping.data_ptr(), k.shape[0])  # fmt: skip


def greedy_rows_cpu(logits: Tensor) -> list[int] | None:
    """Each row's ``argmax`` of ``logits`` [rows, vocab], or -1 where the row holds a NaN or an
    infinity, in one C pass (``greedy_rows_f32``); None where the kernel cannot take them (then the
    caller's torch ops run)."""
    lib = cpu_kernels()
    if lib is None or logits.dim() != 2 or not _f32_rows(logits):
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.greedy_rows_f32(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], out.data_ptr(),
                        torch.get_num_threads())  # fmt: skip
    return out.tolist()
