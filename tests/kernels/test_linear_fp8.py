"""fp8 weight-only quantization of a base (quantization fp8) and the kernels' checkpoint paths: the
rounding each part may add, proved from the arithmetic (e4m3: 3 mantissa bits, subnormal spacing
2^-9; bfloat16 and float32 unit roundoffs), not this CPU's last bits."""

from __future__ import annotations

import pytest
import torch

from lorapage import Engine, EngineConfig
from lorapage.kernels.linear_fp8 import FP8, FP8_MAX, Fp8Rows, fp8_rows, linear_fp8, pack_fp8, quantize_fp8_rows
from lorapage.kernels.linear_int8 import Int8Rows, dequantize, linear_int8
from lorapage.model.merge import merge_adapter
from lorapage.model.quantized_checkpoint import unpack_int8

U_BF16 = 2.0**-8
U_F32 = 2.0**-24
U_E4M3 = 2.0**-4  # half the spacing relative to a normal e4m3 value
HALF_SUBNORMAL = 2.0**-10  # e4m3's subnormal spacing is 2^-9


def test_each_weight_is_within_e4m3_rounding_of_its_rows_scale():
    w = torch.randn(48, 40) * torch.logspace(-3, 1, 48)[:, None]
    w[5] = 0.0
    w[7, :3] = torch.tensor([1e-9, -3e-4, 2.0])  # subnormals under the row's scale
    q, s = quantize_fp8_rows(w)
    assert q.dtype == FP8 and s.dtype == torch.float32
    assert float(q.float().abs().max()) <= FP8_MAX
    err = (q.float() * s[:, None] - w).abs()
    bound = torch.maximum(U_E4M3 * w.abs(), HALF_SUBNORMAL * s[:, None]) * (1 + 1e-6)
    assert bool((err <= bound).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_fp8_is_the_exact_weights_product_scaled_once(dtype):
    """``y = (x @ q.T) * s`` in ``x``'s dtype: against ``x @ (q s).T`` in float64, float32 sums of
    K terms (K U_F32 sum |x q s|), and in bfloat16 the GEMM's and the scaled output's roundings."""
    torch.manual_seed(0)
    w, x, bias = torch.randn(96, 64) * 0.1, torch.randn(5, 64).to(dtype), torch.randn(96).to(dtype)
    packed = pack_fp8(w)
    assert isinstance(packed, Fp8Rows) and pack_fp8(packed) is packed
    y = linear_fp8(x, packed, bias)
    assert y.dtype == dtype
    exact = x.double() @ dequantize(packed).double().T
    sums = x.double().abs() @ dequantize(packed).double().abs().T
    u = U_F32 if dtype == torch.float32 else U_BF16
    bound = 2 * u * exact.abs() + 64 * U_F32 * sums + u * (exact + bias.double()).abs() + 1e-12
    assert bool(((y.double() - bias.double() - exact).abs() <= bound * 1.01).all())


def test_the_int8_kernel_honours_a_checkpoints_float32_scales():
    """Scales bfloat16 cannot hold are applied to the GEMM's output: ``bf16(bf16(x) @ q.T) * s``, the
    product rounded once to bfloat16 and once to float32, the scales used exactly."""
    torch.manual_seed(1)
    q = torch.randint(-128, 128, (40, 32), dtype=torch.int8)
    s = torch.rand(40) * 1e-2 + 1e-3  # not bfloat16 values
    rows = q.as_subclass(Int8Rows)
    rows.scales = s
    x = torch.randn(3, 32)
    xb = x.to(torch.bfloat16).double()
    exact = xb @ (q.double() * s.double()[:, None]).T
    sums = xb.abs() @ (q.double().abs() * s.double()[:, None]).T
    bound = (U_BF16 + U_F32) * exact.abs() + 32 * U_F32 * sums + 1e-12
    assert bool(((linear_int8(x, rows) - exact).abs() <= bound * 1.01).all())


def test_merging_into_an_fp8_weight_requantizes_it():
    """A merged (dedicated-tier) adapter on an fp8 base: ``W' = q s + scale B A`` quantized again
    (merge.py through dense_weight and the model's pack), within e4m3's rounding of W'."""
    engine = Engine(EngineConfig(quantization="fp8", num_threads=1))
    model = engine.debug.runner.ctx.model
    assert isinstance(model.layers[0]["qkv"], Fp8Rows) and not isinstance(model.lm_head, Fp8Rows)
    before = dequantize(model.layers[0]["qkv"])
    dims = model.config.module_dims()["q_proj"]
    a, b = torch.randn(4, dims[0]) * 0.1, torch.randn(dims[1], 4) * 0.1
    merge_adapter(model, {(0, "q_proj"): (a, b)}, {(0, "q_proj"): 0.5})
    after = model.layers[0]["qkv"]
    assert isinstance(after, Fp8Rows)
    want = before.clone()
    want[: dims[1]] += 0.5 * b @ a
    bound = torch.maximum(U_E4M3 * want.abs(), HALF_SUBNORMAL * after.scales[:, None]) * (1 + 1e-5) + 1e-7
    assert bool(((dequantize(after) - want).abs() <= bound).all())


def test_fp8_rows_checks_its_parts():
    rows = fp8_rows(torch.zeros(3, 4, dtype=FP8), torch.ones(3, dtype=torch.bfloat16))
    assert rows.scales.dtype == torch.float32
    with pytest.raises(AssertionError):
        fp8_rows(torch.zeros(3, 4), torch.ones(3))


def test_unpacking_matches_compressed_tensors_packing():
    packing = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    values = torch.randint(-128, 128, (6, 37), dtype=torch.int8)  # 37: a part-filled last word
    values[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    packed = packing.pack_to_int32(values, 8)
    assert torch.equal(unpack_int8(packed, torch.tensor([6, 37])), values)
    with pytest.raises(ValueError, match="does not hold 6x41 int8"):
        unpack_int8(packed, torch.tensor([6, 41]))
