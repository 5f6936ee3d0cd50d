"""The cpu backend's dense projections (oneDNN over packed weights) against a float64 reference,
within what float32 sums in any order can do (numeric_bounds), and the model's weights round-tripped."""

from __future__ import annotations

import pytest
import torch
from numeric_bounds import U32, U64, assert_within, gamma

from lorapage.kernels.backend import CPU_OPS, TORCH_OPS
from lorapage.kernels.linear_cpu import dense_weight, linear_cpu, onednn_linear_available, pack_weight


def _bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``|y^ - y|`` for ``y = b + sum_i x_i w_i`` (d products, then d+1 terms summed in any order)."""
    d = x.shape[1]
    terms = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0)
    return (gamma(d + 1, U32) + gamma(d + 1, U64)) * terms * (1 + gamma(d + 1, U64))


@pytest.mark.parametrize("rows", [0, 1, 4, 32, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_within_float32_of_float64(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 512, generator=gen), torch.randn(1408, 512, generator=gen) * 0.05
    b = torch.randn(1408, generator=gen) if bias else None
    got = linear_cpu(x, pack_weight(w), b)
    want = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert got.shape == (rows, 1408) and got.dtype == torch.float32
    assert_within(got, want, _bound(x, w, b), "oneDNN linear")


def test_a_weight_packs_where_onednn_runs_and_unpacks_to_itself():
    w = torch.randn(96, 64)
    packed = pack_weight(w)
    assert packed.is_mkldnn == onednn_linear_available()
    assert torch.equal(dense_weight(packed), w)
    # Only float32 on a CPU is packed: any other weight is left as it is.
    half = w.to(torch.bfloat16)
    assert pack_weight(half) is half
    # A non-contiguous input (a view into a fused output) is read correctly.
    x = torch.randn(5, 128)[:, :64]
    torch.testing.assert_close(linear_cpu(x, packed), x @ w.T, rtol=1e-5, atol=1e-5)


def test_only_the_cpu_backend_packs():
    w = torch.randn(16, 8)
    assert TORCH_OPS.pack_weight(w) is w
    assert CPU_OPS.pack_weight(w).is_mkldnn == onednn_linear_available()
