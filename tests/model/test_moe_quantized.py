"""A quantized MoE base (``--quantization int8 | w8a8`` on Mixtral and Qwen3-MoE): every expert's
gate_up and down held as int8 rows, each exactly what ``pack_int8`` makes of the float weight (the
experts run through the same ``linear`` as the dense projections), and the engine's teacher-forced
logprobs of a mixed batch (the base and an adapter with LoRA on attention and on the experts) close
to the float32 engine's: nearer by far than the float32 engine with two experts' weights swapped,
which is what serving a token through the wrong expert's weights would look like."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_families_moe import PROMPTS, _family

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.kernels.linear_int8 import Int8Rows, dense_weight, pack_int8

TEACHER = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
ROWS = [(p, a) for p in PROMPTS for a in (None, "fused")]


def _engine(base, adapters, quantization: str | None) -> Engine:
    engine = Engine(EngineConfig(model=str(base), quantization=quantization, max_lora_rank=8))
    engine.add_adapter("fused", str(adapters["fused"]))
    return engine


def _logprobs(engine: Engine) -> list[float]:
    return [lp.logprob for out in engine.generate_batch(ROWS, TEACHER) for lp in out.prompt_logprobs[1:]]


def _distance(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_experts_are_quantized_and_serve_near_float32(name, quantization, tmp_path_factory):
    base, adapters = _family(name, tmp_path_factory)
    float32, quantized = _engine(base, adapters, None), _engine(base, adapters, quantization)
    for plain, held in zip(
        float32.debug.runner.ctx.model.moe_layers, quantized.debug.runner.ctx.model.moe_layers, strict=True
    ):
        for want, got in [*zip(plain.gate_up, held.gate_up, strict=True), *zip(plain.down, held.down, strict=True)]:
            rows = pack_int8(dense_weight(want))  # the float32 engine holds it packed for its GEMM
            assert isinstance(got, Int8Rows)
            assert torch.equal(got.as_subclass(torch.Tensor), rows.as_subclass(torch.Tensor))
            assert torch.equal(got.scales, rows.scales)
    want, got = _logprobs(float32), _logprobs(quantized)
    for mlp in float32.debug.runner.ctx.model.moe_layers:  # what routing through a wrong expert does
        mlp.gate_up[0], mlp.gate_up[1] = mlp.gate_up[1], mlp.gate_up[0]
        mlp.down[0], mlp.down[1] = mlp.down[1], mlp.down[0]
    swapped = _logprobs(float32)
    for engine in (float32, quantized):
        asyncio.run(engine.close())
    assert 0 < _distance(got, want)
    assert 5 * _distance(got, want) < _distance(swapped, want)
