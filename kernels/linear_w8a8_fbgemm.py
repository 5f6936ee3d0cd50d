"""w8a8 on an x86 CPU without int8 dot products (AVX2, no VNNI): FBGEMM's int8 GEMM, which torch
ships, in place of ``torch._int_mm`` (whose oneDNN kernel takes a reference path there: on an AVX2
AMD EPYC 25-60x slower than float32 at 32 rows; FBGEMM's AVX2 kernel 1.9-2.7x *faster* than
float32 at one thread, :mod:`bench.bench_gemm_int8`).

The weights are the w8a8 base's own int8 rows and scales (:class:`~lorapage.kernels.linear_int8.Int8Rows`),
packed once more into FBGEMM's layout (``linear_prepack``; kept on the weight, remade when its
scales or values change): the int8 weights are held twice, half float32's bytes in all.

FBGEMM's activations are unsigned 8-bit with a zero point, one scale per call. Per-token scaling
is recovered by dividing each row by its largest magnitude first (every row then spans [-1, 1])
and multiplying the output row back, since a linear map commutes with a row's scale; the step is
fixed at ``2 / 127`` with zero point 64 (``linear_with_input_q_dq_qweight_dq_output_fp32``), so
each token is quantized on its own, whatever it is batched with (FBGEMM's dynamic linear would
pick the step from the whole batch). The values stay within 0..128: AVX2's paired ``u8 x s8``
products then sum in int16 without saturating (FBGEMM's ``reduce_range``, 7 bits, for the same
reason). The PyTorch expression, for ``x`` [T, d_in] float32 and a weight ``q`` [d_out, d_in] int8
with scales ``s_w`` [d_out]::

    a = x.abs().amax(1, keepdim=True)                  # 1 for a row with a < 2^-100 (zeros)
    x_q = torch.round(x / a * 63.5) / 63.5 * a         # 63.5 = 127 / 2: integers in [-64, 64]
    y = x_q @ (q * s_w).T + bias

:func:`linear_w8a8_fbgemm` runs the division before the GEMM and the products after it in C
(``linear_w8a8.h``'s ``w8a8_unit_rows`` / ``w8a8_scale_rows``, where the CPU kernels are built; the
same quotients and products, a bias's add possibly fused): as torch ops they cost as much as the
GEMM at a few rows.

Each activation is within ``a / 127`` (half a step; twice ``linear_w8a8``'s ``a / 254``: 7 bits
over both signs against 8 over a magnitude), each weight within ``linear_int8``'s ``s_w / 2``; the
int32 sums are exact and the output takes a few float32 roundings.

Why not torchao: its int8 dynamic-activation configuration runs ``torch._int_mm`` on a CPU, the
slow path this module avoids. Building the packed weight goes through torch's quantized-tensor API,
which torch marks deprecated (a warning at pack time, silenced here: it is made once per weight);
:func:`fbgemm_available` checks that it still runs, and the engine keeps ``linear_w8a8`` where it
does not.
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch
from torch import Tensor

from lorapage.kernels import linear_cpu as cpu
from lorapage.kernels.cpu_build import cpu_kernels
from lorapage.kernels.linear_int8 import Int8Rows, dequantize, pack_int8

log = logging.getLogger("lorapage.kernels")

TINY = 2.0**-100  # a row whose largest |x| is below it is not rescaled (as linear_w8a8's)
STEP, ZERO = 2.0 / 127, 64  # each row over [-1, 1]: u8 codes 0..128 (see above)


def packed_weight(weight: Int8Rows) -> object:
    """``weight``'s int8 rows and scales in FBGEMM's layout (an opaque ``LinearPackedParams``): made
    once and kept on the weight, made again when its values or scales change (a merge edits them)."""
    s, q = weight.scales, weight.as_subclass(Tensor)
    kept = weight.__dict__.get("_w8a8_fbgemm")
    if kept is None or kept[0] is not s or kept[1] != (s._version, weight._version):
        zeros = torch.zeros(q.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # the quantized-tensor API's deprecation: once per weight, see above
            warnings.simplefilter("ignore", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(q.contiguous(), s.double(), zeros, 0)
            packed = torch.ops.quantized.linear_prepack(qw, None)
        kept = (s, (s._version, weight._version), packed)
        weight.__dict__["_w8a8_fbgemm"] = kept
    return kept[2]


def row_scales(rows: Tensor) -> Tensor:
    """Each row's largest |x| [..., 1], what the row is divided by; 1 for a row whose largest is
    under ``TINY`` (zeros stay zeros)."""
    a = rows.abs().amax(-1, keepdim=True)
    return torch.where(a >= TINY, a, torch.ones_like(a))


def quantize_activations_ref(x: Tensor) -> Tensor:
    """Each row of ``x`` [..., d_in] as the module docstring quantizes it, back in float32 (``x_q``)."""
    a = row_scales(x.float())
    return torch.round(x.float() / a * (1 / STEP)) * STEP * a


def linear_w8a8_fbgemm_ref(x: Tensor, weight: Int8Rows, bias: Tensor | None = None) -> Tensor:
    """The reference: ``F.linear(x_q, q * s_w, bias)`` in float32."""
    y = quantize_activations_ref(x) @ dequantize(weight).T
    return (y if bias is None else y + bias).to(x.dtype)


def _gemm(unit_rows: Tensor, weight: Int8Rows) -> Tensor:
    """FBGEMM's GEMM of rows over [-1, 1], quantized in it at the fixed step (see above)."""
    op = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
    return op(unit_rows, STEP, ZERO, packed_weight(weight))


def linear_w8a8_fbgemm(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, q * s_w, bias)`` for an :class:`Int8Rows` ``weight`` with each row of ``x``
    [..., d_in] scaled to [-1, 1] and quantized in FBGEMM's GEMM, as the module docstring computes it, in
    ``x``'s dtype; another weight (the logits' ``lm_head``, float32) runs
    :func:`~lorapage.kernels.linear_cpu.linear_cpu`."""
    if not isinstance(weight, Int8Rows):
        return cpu.linear_cpu(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1]).float()
    lib = cpu_kernels()
    if lib is None or rows.stride(-1) != 1:
        y = linear_w8a8_fbgemm_ops(rows, weight, bias)
    else:
        # The two passes around the GEMM in C (linear_w8a8.h): as torch ops (abs, amax, where,
        # divide; then two in-place products) they cost as much as the GEMM at a few rows.
        m, k = rows.shape
        threads = torch.get_num_threads()
        unit, a = torch.empty(m, k), torch.empty(m)
        lib.w8a8_unit_rows(rows.data_ptr(), rows.stride(0), m, k, unit.data_ptr(), a.data_ptr(), threads)
        y = _gemm(unit, weight)
        assert y.is_contiguous()
        b = None if bias is None else bias.float().contiguous()
        lib.w8a8_scale_rows(y.data_ptr(), m, y.shape[1], a.data_ptr(), 0 if b is None else b.data_ptr(), threads)
    return y.reshape(*x.shape[:-1], -1).to(x.dtype)


def linear_w8a8_fbgemm_ops(rows: Tensor, weight: Int8Rows, bias: Tensor | None = None) -> Tensor:
    """:func:`linear_w8a8_fbgemm` of float32 ``rows`` [T, d_in] with its passes around the GEMM as
    torch ops (where the C kernels are not built): the same quotients and products."""
    a = row_scales(rows)
    y = _gemm(rows / a, weight)
    y.mul_(a)
    return y if bias is None else y.add_(bias)


@functools.cache
def fbgemm_available() -> bool:
    """Whether this torch packs and runs FBGEMM's int8 linear at a given activation step (its x86
    builds; the op :func:`linear_w8a8_fbgemm` calls): checked once on a tiny weight against the float
    product, within the module docstring's bound."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        w, x = pack_int8(torch.randn(8, 16)), torch.randn(3, 16)
        y, exact = linear_w8a8_fbgemm(x, w), x @ dequantize(w).T
        bound = x.abs().amax(1, keepdim=True) / 127 * dequantize(w).abs().sum(1) + 1e-4 * exact.abs() + 1e-6
        return bool(((y - exact).abs() <= 1.01 * bound).all())
    except (AttributeError, RuntimeError, NotImplementedError) as exc:
        log.info("FBGEMM's int8 linear unavailable (%s): w8a8 runs torch._int_mm", exc)
        return False
