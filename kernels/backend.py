"""Choosing the kernel implementation once, at start-up.

``torch`` runs the PyTorch references and batched PyTorch LoRA ops. ``cpu`` is the same with the
LoRA ops' short segments (decode rows) in the C kernels of ``lora_cpu.c``, built on first use with
the system compiler (float32 models only). ``triton`` runs the Triton kernels: compiled on CUDA, and under Triton's
interpreter on a machine without CUDA (that is how the CPU test suite checks them; it is far too
slow to serve with). ``auto`` picks Triton on CUDA when it is installed, else ``cpu`` for a
float32 model on a CPU where the C kernels build, else ``torch``. Triton is imported only when the
``triton`` backend is chosen, so a CPU-only install without it still runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lorapage.kernels.attention_ref import paged_decode_attention_ref, prefill_attention_ref, write_kv_ref
from lorapage.kernels.cpu_build import cpu_kernels
from lorapage.kernels.lora_cpu import lora_expand_cpu, lora_shrink_cpu
from lorapage.kernels.lora_torch import lora_expand_torch, lora_shrink_torch
from lorapage.kernels.triton_import import triton_available, triton_interpreted

BACKENDS = ("auto", "torch", "cpu", "triton")


@dataclass(frozen=True)
class KernelOps:
    """The five ops the model calls; every backend provides the same signatures."""

    name: str
    lora_shrink: Callable
    lora_expand: Callable
    write_kv: Callable
    paged_decode_attention: Callable
    prefill_attention: Callable


TORCH_OPS = KernelOps(
    "torch", lora_shrink_torch, lora_expand_torch, write_kv_ref, paged_decode_attention_ref, prefill_attention_ref
)
CPU_OPS = KernelOps(
    "cpu", lora_shrink_cpu, lora_expand_cpu, write_kv_ref, paged_decode_attention_ref, prefill_attention_ref
)


def _triton_ops() -> KernelOps:
    from lorapage.kernels.attention_triton import paged_decode_attention, prefill_attention, write_kv
    from lorapage.kernels.lora_triton import lora_expand, lora_shrink

    return KernelOps("triton", lora_shrink, lora_expand, write_kv, paged_decode_attention, prefill_attention)


def select_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float32) -> KernelOps:
    """The ops for ``name`` (one of ``BACKENDS``) on ``device`` for a model in ``dtype``; called
    once at start-up."""
    if name not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {BACKENDS}; got {name!r}")
    if name == "auto" and device.type == "cuda":
        name = "triton" if triton_available() else "torch"
    elif name == "auto":
        name = "cpu" if device.type == "cpu" and dtype == torch.float32 and cpu_kernels() is not None else "torch"
    if name == "torch":
        return TORCH_OPS
    if name == "cpu":
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(f"kernel_backend='cpu' runs float32 on the CPU, not {dtype} on {device.type}")
        if cpu_kernels() is None:
            raise ValueError("kernel_backend='cpu' needs its C kernels, which did not build here (see the log)")
        return CPU_OPS
    if not triton_available():
        raise ValueError("kernel_backend='triton' needs the triton package; install lorapage[triton] or use 'torch'")
    if device.type == "cpu" and not triton_interpreted():
        raise ValueError(
            "kernel_backend='triton' on a CPU device runs Triton's interpreter, which must be on before triton is "
            "first imported: set TRITON_INTERPRET=1 (or use 'torch')"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"kernel_backend='triton' runs on CUDA (or CPU under the interpreter), not {device.type}")
    return _triton_ops()
