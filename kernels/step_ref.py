"""The per-layer elementwise ops around the GEMMs, in PyTorch: the reference of ``step_cpu.py``'s C
kernels and every other backend's ops (the arithmetic of transformers' Llama modules).

- :func:`rms_norm_ref`: the residual added, then ``LlamaRMSNorm`` (float32 inside).
- :func:`rope_ref`: ``apply_rotary_pos_emb`` over the first ``cos.shape[-1]`` columns of each head.
- :func:`silu_mul_ref`: ``LlamaMLP``'s ``act_fn(gate) * up`` over a fused ``[gate | up]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm_ref(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``x + residual`` (``x`` itself when None) and its RMS norm times ``weight``: ``(x', norm(x'))``.
    ``x`` may be updated in place (the CPU kernel does) or replaced: use the returned one."""
    if residual is not None:
        x = x + residual
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return x, weight * xf.to(x.dtype)


def rope_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x`` [T, heads, D] rotated by each token's ``cos`` / ``sin`` [T, rotary_dim] (a partial
    rotation passes the rest of each head through). May rotate ``x`` in place (the CPU kernel
    does): use the returned tensor."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat((rope_ref(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_mul_ref(gate_up: Tensor, inter: int) -> Tensor:
    """``silu(gate_up[:, :inter]) * gate_up[:, inter:]``."""
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
