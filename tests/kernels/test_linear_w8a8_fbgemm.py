"""w8a8 through FBGEMM on CPUs without int8 dot products (kernels/linear_w8a8_fbgemm.py): each row
scaled to [-1, 1], quantized by FBGEMM in 7 bits and scaled back, held to the bound its docstring
derives (not this CPU's last bits); the packed weight kept and remade when the weight changes."""

from __future__ import annotations

import pytest
import torch

from lorapage.kernels.cpu_build import cpu_kernels
from lorapage.kernels.linear_int8 import QMAX, Int8Rows, dequantize, pack_int8
from lorapage.kernels.linear_w8a8_fbgemm import (
    TINY,
    fbgemm_available,
    linear_w8a8_fbgemm,
    linear_w8a8_fbgemm_ops,
    linear_w8a8_fbgemm_ref,
    packed_weight,
    quantize_activations_ref,
)

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="this torch has no FBGEMM (not an x86 build)")

U = 2.0**-24


def g(n: int) -> float:
    """``n`` roundings' relative bound (Higham's gamma_n, tests/numeric_bounds.py)."""
    return n * U / (1 - n * U)


def _activations(rows: int, d_in: int) -> torch.Tensor:
    """Rows over six decades (per-token scaling must keep the small ones), a row of zeros, and a row
    too small to scale."""
    torch.manual_seed(rows * 1000 + d_in)
    x = torch.randn(rows, d_in) * torch.logspace(-3, 3, max(rows, 1))[:rows, None]
    if rows > 1:
        x[1] = 0.0
    if rows > 3:
        x[3] *= 2.0**-110
    return x


def _bound(x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each activation within a / 127 (FBGEMM's step over [-1, 1] is at most 2 / 127; half of it, and
    the division by a and its rounding, 1% spare), all of x on a row too small to scale, through |q s_w|;
    then the float32 roundings of the rescales and the bias's add (g(8) of the magnitudes)."""
    a = x.abs().amax(1, keepdim=True).double()
    per = torch.where(a >= TINY, a / QMAX * 1.01, a)
    mag = (x.double().abs() + per) @ dense.abs().T + (0 if bias is None else bias.double().abs())
    return per * dense.abs().sum(1)[None, :] + g(8) * mag, mag


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_within_the_bound_of_the_exact_product(rows):
    d_in, d_out = 70, 44
    x = _activations(rows, d_in)
    w, bias = torch.randn(d_out, d_in) * 0.1, torch.randn(d_out)
    packed = pack_int8(w)
    dense = dequantize(packed).double()
    for b in (bias, None):
        exact = x.double() @ dense.T + (0 if b is None else b.double())
        bound, mag = _bound(x, dense, b)
        y = linear_w8a8_fbgemm(x, packed, b)
        assert y.shape == (rows, d_out) and y.dtype == torch.float32
        assert bool(((y.double() - exact).abs() <= bound).all())
    # per token, not per tensor: the rows a million times smaller than the largest keep 2-digit accuracy
    normal = [r for r in range(rows) if r not in (1, 3)]
    assert all(float((bound / mag)[r].max()) < 0.05 for r in normal)


def test_batched_input_lm_head_and_a_zero_input():
    x = torch.randn(2, 3, 24)
    w = pack_int8(torch.randn(16, 24))
    y = linear_w8a8_fbgemm(x, w)
    assert y.shape == (2, 3, 16) and torch.allclose(y, linear_w8a8_fbgemm(x.reshape(6, 24), w).reshape(2, 3, 16))
    plain = torch.randn(16, 24)  # lm_head: not quantized
    assert torch.allclose(linear_w8a8_fbgemm(x, plain), x @ plain.T, rtol=1e-5, atol=1e-5)
    assert not bool(linear_w8a8_fbgemm(torch.zeros(4, 24), w).any())


def test_the_packed_weight_is_kept_and_remade_when_the_weight_changes():
    x = torch.randn(3, 40)
    w = torch.randint(-QMAX, QMAX + 1, (12, 40), dtype=torch.int8).as_subclass(Int8Rows)
    w.scales = torch.rand(12) * 0.01 + 1e-3
    first = packed_weight(w)
    got = linear_w8a8_fbgemm(x, w)
    assert packed_weight(w) is first
    w.scales.mul_(2.0)  # scales edited in place
    assert packed_weight(w) is not first
    assert torch.allclose(linear_w8a8_fbgemm(x, w), 2 * got, rtol=1e-5, atol=1e-6)
    w.as_subclass(torch.Tensor).neg_()  # values edited in place (a merge re-quantizing into them)
    assert torch.allclose(linear_w8a8_fbgemm(x, w), -2 * got, rtol=1e-5, atol=1e-6)


def test_each_token_is_quantized_on_its_own_as_the_reference_does():
    """The step is fixed, not the batch's: a row's output is the same alone or among others (what
    FBGEMM's dynamic linear would not give), and equals the reference's ``x_q @ (q s_w).T`` within
    the float32 roundings of the products and sums."""
    x = _activations(9, 64)
    w = pack_int8(torch.randn(48, 64) * 0.1)
    together = linear_w8a8_fbgemm(x, w)
    for r in range(9):
        assert torch.equal(linear_w8a8_fbgemm(x[r : r + 1], w)[0], together[r])
    dense = dequantize(w).double()
    want = quantize_activations_ref(x).double() @ dense.T
    mag = quantize_activations_ref(x).double().abs() @ dense.abs().T
    for y in (together, linear_w8a8_fbgemm_ref(x, w)):
        assert bool(((y.double() - want).abs() <= g(64 + 8) * mag).all())


def test_the_c_passes_around_the_gemm_match_the_torch_ops():
    """Each row divided by its largest magnitude, and the output row multiplied back, in C
    (``linear_w8a8.h``) where the kernels are built: the same quotients and products as the torch
    ops (``linear_w8a8_fbgemm_ops``), bit for bit; with a bias, its add may fuse into the product."""
    if cpu_kernels() is None:
        pytest.skip("the C kernels are not built here")
    x = _activations(7, 96)
    w, bias = pack_int8(torch.randn(40, 96) * 0.1), torch.randn(40)
    assert torch.equal(linear_w8a8_fbgemm(x, w), linear_w8a8_fbgemm_ops(x, w))
    in_c, in_torch = linear_w8a8_fbgemm(x, w, bias), linear_w8a8_fbgemm_ops(x, w, bias)
    assert bool(((in_c - in_torch).abs() <= g(2) * (in_torch.abs() + bias.abs())).all())
