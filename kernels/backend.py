"""Choosing the kernel implementation once, at start-up.

``torch`` runs the PyTorch references and batched PyTorch LoRA ops. ``cpu`` is the same with the
LoRA ops' short segments (decode rows), paged attention and the layers' norms, rotation, K/V
write and SiLU (``step_cpu.py``) in the C kernels of ``lora_cpu.c``, built on first use with the
system compiler (float32 models only), and the base's projections as oneDNN GEMMs over weights
packed once (``linear_cpu.py``). ``triton`` runs the Triton
kernels: compiled on CUDA, and under Triton's interpreter on a machine without CUDA (that is how
the CPU test suite checks them; it is far too slow to serve with). ``auto`` picks Triton on CUDA
when it is installed, else ``cpu`` for a float32 model on a CPU where the C kernels build, else
``torch``. Triton is imported only when the ``triton`` backend is chosen, so a CPU-only install
without it still runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from lorapage.kernels.attention_cpu import paged_decode_attention_cpu, prefill_attention_cpu
from lorapage.kernels.attention_ref import paged_decode_attention_ref, prefill_attention_ref, write_kv_ref
from lorapage.kernels.cpu_build import cpu_kernels
from lorapage.kernels.linear_cpu import keep_weight, linear_cpu, linear_ref, pack_weight
from lorapage.kernels.lora_cpu import c_kernels_take, lora_expand_cpu, lora_group_cpu, lora_shrink_cpu
from lorapage.kernels.lora_ref import LoraIndices
from lorapage.kernels.lora_side import LoraSide
from lorapage.kernels.lora_torch import lora_expand_torch, lora_shrink_torch
from lorapage.kernels.names import BACKENDS
from lorapage.kernels.step_cpu import rms_norm_cpu, rope_cpu, silu_mul_cpu, write_kv_cpu
from lorapage.kernels.step_ref import rms_norm_ref, rope_ref, silu_mul_ref
from lorapage.kernels.triton_import import triton_available, triton_interpreted


class LoraShrink(Protocol):
    """``h[t, :a_rows[s]] = x[t] @ A_s.T`` (see :func:`~lorapage.kernels.lora_ref.lora_shrink_ref`)."""

    def __call__(
        self,
        h: Tensor,
        x: Tensor,
        pool: Tensor,
        page_table: Tensor,
        indices: LoraIndices,
        a_offset: Tensor,
        a_rows: Tensor,
    ) -> None: ...


class LoraExpand(Protocol):
    """``y[t, o_m:o_m+w_m] += scale[s, m] * h[t, hs:hs+r] @ B_{s,m}.T`` (see
    :func:`~lorapage.kernels.lora_ref.lora_expand_ref`)."""

    def __call__(
        self,
        y: Tensor,
        h: Tensor,
        pool: Tensor,
        page_table: Tensor,
        indices: LoraIndices,
        b_offset: Tensor,
        rank: Tensor,
        h_start: Tensor,
        scale: Tensor,
        out_start: tuple[int, ...],
    ) -> None: ...


class LoraGroup(Protocol):
    """One group's :class:`LoraShrink` into ``h``, then its :class:`LoraExpand` into ``y``, as one op
    (a backend without one runs the two)."""

    def __call__(
        self,
        y: Tensor,
        h: Tensor,
        x: Tensor,
        pool: Tensor,
        page_table: Tensor,
        indices: LoraIndices,
        a_offset: Tensor,
        a_rows: Tensor,
        b_offset: Tensor,
        rank: Tensor,
        h_start: Tensor,
        scale: Tensor,
        out_start: tuple[int, ...],
        threads: int | None = None,
    ) -> None: ...


class WriteKv(Protocol):
    def __call__(self, kv: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None: ...


class RmsNorm(Protocol):
    """``x + residual`` (None: ``x``) and its RMS norm times ``weight``, as ``(x', norm)``; ``x`` may
    take the residual in place (:func:`lorapage.kernels.step_ref.rms_norm_ref`)."""

    def __call__(self, x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]: ...


class Rope(Protocol):
    """``x`` [T, heads, D] rotated by ``cos`` / ``sin`` [T, rotary_dim], maybe in place: use the result."""

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor: ...


class SiluMul(Protocol):
    """``silu(gate_up[:, :inter]) * gate_up[:, inter:]``."""

    def __call__(self, gate_up: Tensor, inter: int) -> Tensor: ...


class DecodeAttention(Protocol):
    """``window``: a sliding-window layer's width (None: global); ``softcap``: the attention
    logits' tanh cap (None: none). See :mod:`lorapage.kernels.attention_ref`."""

    def __call__(
        self,
        out: Tensor,
        q: Tensor,
        kv: Tensor,
        block_table: Tensor,
        context_lens: Tensor,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None: ...


class PrefillAttention(Protocol):
    def __call__(
        self,
        out: Tensor,
        q: Tensor,
        kv: Tensor,
        block_table: Tensor,
        query_starts: list[int],
        context_lens: list[int],
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None: ...


class Linear(Protocol):
    """``y = x @ weight.T + bias`` over a weight as :class:`PackWeight` left it."""

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor: ...


class PackWeight(Protocol):
    """A base weight [d_out, d_in] in the layout this backend's :class:`Linear` reads fastest
    (done once at start-up; after an edit of the weight, again)."""

    def __call__(self, weight: Tensor) -> Tensor: ...


class PlanLora(Protocol):
    """A step's LoRA indices as this backend's ops want them, planned once for every layer:
    ``tables`` the lookup tables (page table and the per-layer layout), ``pages`` one layer's
    adapter slab, ``prefill`` whether the step has prompt tokens."""

    def __call__(self, lora: LoraIndices, page_table: Tensor, layout: tuple[Tensor, ...], pages: Tensor,
                 activations: torch.dtype, prefill: bool) -> LoraIndices: ...  # fmt: skip


def _plan_torch(lora, page_table, layout, pages, activations, prefill):
    return lora.with_batches(page_table, layout, pages)


def _plan_cpu(lora, page_table, layout, pages, activations, prefill):
    # The C kernels take the short segments when they read the pages' dtype (float16 pages
    # under a float32 model go to the PyTorch ops whole).
    plan = lora.with_cells if c_kernels_take(activations, pages.dtype) else lora.with_batches
    return plan(page_table, layout, pages)


def _plan_triton(lora, page_table, layout, pages, activations, prefill):
    # Prefill tokens: segment-wise SGMV beats per-token BGMV; a decode step reads token_slot alone
    # (what a captured graph replays).
    return lora.with_segment_table() if prefill else lora


@dataclass(frozen=True)
class KernelOps:
    """The ops the model calls, with the same signatures in every backend, and how the backend
    wants a step's LoRA indices planned."""

    name: str
    lora_shrink: LoraShrink
    lora_expand: LoraExpand
    write_kv: WriteKv
    paged_decode_attention: DecodeAttention
    prefill_attention: PrefillAttention
    plan_lora: PlanLora
    linear: Linear = linear_ref  # the base's dense projections and the logits
    pack_weight: PackWeight = keep_weight
    pack_logits: PackWeight | None = None  # lm_head's, where it differs (a quantized base's stays float32)
    captures_graphs: bool = False  # decode steps may replay CUDA graphs over these ops
    lora_group: LoraGroup | None = None  # shrink then expand in one op, where the backend fuses them
    # The C kernels' LoRA updates beside the base's projections, on a core the forward leaves
    # free (lora_side.py); set per engine by engine/build.py (None: in turn, on the forward thread).
    lora_side: LoraSide | None = None
    rms_norm: RmsNorm = rms_norm_ref  # a dense layer's norms, with the residual add before them
    rope: Rope = rope_ref
    silu_mul: SiluMul = silu_mul_ref


TORCH_OPS = KernelOps(
    "torch",
    lora_shrink_torch,
    lora_expand_torch,
    write_kv_ref,
    paged_decode_attention_ref,
    prefill_attention_ref,
    _plan_torch,
)
CPU_OPS = KernelOps(
    "cpu",
    lora_shrink_cpu,
    lora_expand_cpu,
    write_kv_cpu,
    paged_decode_attention_cpu,
    prefill_attention_cpu,
    _plan_cpu,
    linear=linear_cpu,
    pack_weight=pack_weight,
    lora_group=lora_group_cpu,
    rms_norm=rms_norm_cpu,
    rope=rope_cpu,
    silu_mul=silu_mul_cpu,
)


def _triton_ops() -> KernelOps:
    from lorapage.kernels.attention_triton import paged_decode_attention, prefill_attention, write_kv
    from lorapage.kernels.lora_triton import lora_expand, lora_shrink

    return KernelOps(
        "triton",
        lora_shrink,
        lora_expand,
        write_kv,
        paged_decode_attention,
        prefill_attention,
        _plan_triton,
        captures_graphs=True,
    )


def select_backend(
    name: str, device: torch.device, dtype: torch.dtype = torch.float32, lora_pages: torch.dtype | None = None
) -> KernelOps:
    """The ops for ``name`` (one of ``BACKENDS``) on ``device`` for a model in ``dtype`` whose adapter
    pages are ``lora_pages`` (None: ``dtype``); called once at start-up."""
    ops = _select(name, device, dtype)
    if lora_pages == torch.int8 and ops.name == "triton":  # kernel_backend auto on CUDA, too
        raise ValueError("lora_dtype 'int8': the triton backend cannot read int8 adapter pages (the torch backend can)")
    return ops


def _select(name: str, device: torch.device, dtype: torch.dtype) -> KernelOps:
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
