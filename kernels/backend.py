"""Choosing the kernel implementation once, at start-up.

``torch`` runs the PyTorch references (the CPU path). ``triton`` runs the Triton kernels: compiled
on CUDA, and under Triton's interpreter on a machine without CUDA (that is how the CPU test suite
checks them; it is far too slow to serve with). ``auto`` picks Triton on CUDA when it is installed
and PyTorch otherwise. Triton is imported only when the ``triton`` backend is chosen, so a CPU-only
install without it still runs.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lorapage.kernels.attention_ref import paged_decode_attention_ref, prefill_attention_ref, write_kv_ref
from lorapage.kernels.lora_torch import lora_expand_torch, lora_shrink_torch

BACKENDS = ("auto", "torch", "triton")


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


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def import_triton():
    """``import triton``; on a machine without CUDA, first switch Triton to its interpreter.

    Triton decorates its own standard library when it is imported, so TRITON_INTERPRET must be
    set before the first import, not just before our kernels are decorated. Without CUDA nothing
    in this process could run a compiled Triton kernel anyway, so the switch changes nothing else.
    """
    if "triton" not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    return triton


def triton_interpreted() -> bool:
    """Whether Triton kernels run under the interpreter (on CPU tensors) in this process."""
    knobs = getattr(import_triton(), "knobs", None)  # triton < 3.4 has no knobs: read the variable
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _triton_ops() -> KernelOps:
    from lorapage.kernels.attention_triton import paged_decode_attention, write_kv
    from lorapage.kernels.lora_triton import lora_expand, lora_shrink

    # Prefill attention runs once per prompt, not per decode step: PyTorch SDPA is enough.
    return KernelOps("triton", lora_shrink, lora_expand, write_kv, paged_decode_attention, prefill_attention_ref)


def select_backend(name: str, device: torch.device) -> KernelOps:
    """The ops for ``name`` (``auto``, ``torch`` or ``triton``) on ``device``; called once at start-up."""
    if name not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {BACKENDS}; got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "torch":
        return TORCH_OPS
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
