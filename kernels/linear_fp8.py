"""An fp8 base (``quantization fp8``, vLLM's name): float8 e4m3 weight-only, one float32 scale per
output row, the activations and the LoRA path in the model's dtype.

``pack_fp8(W)`` keeps ``q = e4m3(W / s)`` per output row with ``s = max|W_row| / 448`` (e4m3's
largest value, as compressed-tensors and vLLM scale it): each weight within ``2^-4 |W|`` (three
mantissa bits, round to nearest) or ``2^-10 s`` (the subnormal spacing's half), whichever is larger.
``linear_fp8(x, Wq) = (x @ q.T) * s``: an e4m3 value is exact in bfloat16, float16 and float32, so
the GEMM runs on the exact weights in ``x``'s dtype and the scale multiplies its output (one more
rounding). That is ``x @ (q * s).T`` reordered, the product compressed-tensors decompresses to.

How it runs: the weight is widened to ``x``'s dtype on every call and torch's GEMM takes it (on
CUDA cuBLAS, on a CPU oneDNN). Half (bf16) or a quarter (float32) of the resident weight bytes, not
yet a faster GEMM: vLLM's weight-only fp8 (its Marlin kernel on GPUs without fp8 tensor cores)
dequantizes inside the GEMM's tiles instead, and on fp8 tensor cores it quantizes activations
too (W8A8, ``torch._scaled_mm``), which is not weight-only. On a CPU this path is slow and there for
correctness (tests compare it with transformers on the same checkpoint).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lorapage.kernels.linear_int8 import ScaledRows

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


class Fp8Rows(ScaledRows):
    """A float8_e4m3fn weight [d_out, d_in] carrying its per-row ``scales`` [d_out] (float32)."""


def fp8_rows(q: Tensor, scales: Tensor) -> Fp8Rows:
    """``q`` (float8_e4m3fn [d_out, d_in]) with ``scales`` ([d_out], any float dtype) as Fp8Rows."""
    assert q.dtype == FP8 and q.dim() == 2 and scales.shape == (q.shape[0],), (q.dtype, q.shape, scales.shape)
    rows = q.contiguous().as_subclass(Fp8Rows)
    rows.scales = scales.float().contiguous()
    return rows


def quantize_fp8_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """``(q, s)``: ``weight`` [d_out, d_in] as e4m3 rows ``q`` and float32 scales ``s`` [d_out] (the
    module docstring's bound; an all-zero row gets scale 1)."""
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1)
    scales = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    q = (w / scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scales


def pack_fp8(weight: Tensor) -> Tensor:
    """``weight`` quantized (:func:`quantize_fp8_rows`), held as :class:`Fp8Rows`; an Fp8Rows as it is."""
    if isinstance(weight, Fp8Rows):
        return weight
    return fp8_rows(*quantize_fp8_rows(weight))


def linear_fp8(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, q * s, bias)`` for a packed ``weight`` as the module docstring computes it, in
    ``x``'s dtype; another weight (the logits' ``lm_head``, unquantized) is a plain ``F.linear``."""
    if not isinstance(weight, Fp8Rows):
        return F.linear(x, weight, bias)
    y = (F.linear(x, weight.as_subclass(Tensor).to(x.dtype)) * weight.scales).to(x.dtype)
    return y if bias is None else y + bias
