"""int8 weight-only quantization of a base (quantization int8): the rounding each part may add,
proved from the arithmetic (not this CPU's last bits), merging into a quantized weight, and the
engine over a quantized tiny model."""

from __future__ import annotations

import pytest
import torch

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.kernels.linear_int8 import QMAX, Int8Rows, dense_weight, dequantize, linear_int8, pack_int8, quantize_rows
from lorapage.model.merge import merge_adapter

U_BF16 = 2.0**-8  # bfloat16's unit roundoff
U_F32 = 2.0**-24


def test_each_weight_is_within_half_its_rows_scale():
    w = torch.randn(48, 40) * torch.logspace(-3, 1, 48)[:, None]
    w[5] = 0.0
    q, s = quantize_rows(w)
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16 and int(q.abs().max()) <= QMAX
    assert bool((s.float() * QMAX >= w.abs().amax(1)).all())  # rounded up: no row clips
    err = (q.float() * s.float()[:, None] - w).abs()
    assert bool((err <= s.float()[:, None] / 2).all())


def test_linear_int8_is_the_bf16_activations_product_rounded_once():
    """``y = bf16((bf16(x) @ q.T) * s)``: against that product in float64, the output's bfloat16
    rounding (U_BF16 |y|) plus float32 sums of K terms (K U_F32 sum |x q s|, doubled for the scale)."""
    torch.manual_seed(0)
    w, x, bias = torch.randn(96, 64) * 0.1, torch.randn(5, 64), torch.randn(96)
    packed = pack_int8(w)
    assert isinstance(packed, Int8Rows)
    y = linear_int8(x, packed, bias)
    xb = x.to(torch.bfloat16).double()
    exact = xb @ dequantize(packed).double().T
    sums = xb.abs() @ dequantize(packed).double().abs().T
    bound = U_BF16 * exact.abs() + 2 * 64 * U_F32 * sums + 1e-12
    assert y.dtype == torch.float32
    assert bool(((y - bias - exact).abs() <= bound * (1 + U_BF16) + U_F32 * bias.abs()).all())


def test_merging_into_an_int8_weight_requantizes_within_half_the_new_scale():
    """A merged (dedicated-tier) adapter on a quantized base: ``W' = q s + scale B A`` quantized
    again, each weight within half its row's new scale of W' (merge.py through dense_weight)."""
    engine = Engine(EngineConfig(quantization="int8", num_threads=1))
    model = engine.debug.runner.ctx.model
    before = dense_weight(model.layers[0]["qkv"])
    dims = model.config.module_dims()["q_proj"]
    a, b = torch.randn(4, dims[0]) * 0.1, torch.randn(dims[1], 4) * 0.1
    merge_adapter(model, {(0, "q_proj"): (a, b)}, {(0, "q_proj"): 0.5})
    after = model.layers[0]["qkv"]
    assert isinstance(after, Int8Rows)
    want = before.clone()
    want[: dims[1]] += 0.5 * b @ a
    err = (dequantize(after) - want).abs()
    assert bool((err <= after.scales.float()[:, None] / 2 * (1 + 1e-6) + 1e-7).all())


def test_the_quantized_tiny_model_keeps_its_greedy_tokens():
    prompts = [([5, 9, 17, 33, 60, 2, 8], None), ([100, 3, 41], None)]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    wide = Engine(EngineConfig(num_threads=1)).generate_batch(prompts, params)
    quant = Engine(EngineConfig(quantization="int8", num_threads=1)).generate_batch(prompts, params)
    assert [o.token_ids for o in quant] == [o.token_ids for o in wide]


def test_quantization_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="needs dtype float32"):
        EngineConfig(quantization="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="must be one of"):
        EngineConfig(quantization="int4")


def test_the_merge_check_passes_on_the_quantized_tiny_model():
    """The dedicated tier's equivalence check on an int8 base: the merged weights re-quantized
    differ from the LoRA path by that rounding, within float32's default tolerance here (a larger
    model's may not: the check then refuses the merge with its numbers)."""
    import asyncio

    from lorapage.engine.merge_check import merge_and_check
    from lorapage.tiny import demo_adapter_dirs

    engine = Engine(EngineConfig(quantization="int8", num_threads=1, max_lora_rank=64))
    name, path = sorted(demo_adapter_dirs().items())[0]
    engine.add_adapter(name, str(path))
    check = asyncio.run(merge_and_check(engine, name, max_tokens=8))
    assert check.passed and check.mismatched_prompts == 0, check
    assert isinstance(engine.debug.runner.ctx.model.layers[0]["qkv"], Int8Rows)
