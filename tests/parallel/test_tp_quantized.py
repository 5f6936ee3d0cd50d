"""A quantized base under tensor parallelism (``--quantization`` with ``--tensor-parallel-size 2``,
over gloo on this CPU): each rank quantizes its own shard, as vLLM quantizes each rank's.

A column-parallel shard (q, k, v, gate, up: whole output rows) quantizes as the unsharded weight
does, row by row; a row-parallel one (o, down: half of every row's columns) takes its rows' scales
over the columns it holds (finer than the whole row's), and w8a8 quantizes a row-parallel
projection's input per token over the rank's columns. So TP=2's quantized model is not TP=1's bit
for bit (the int8 kernel also rounds each rank's partial product to bfloat16 before the all-reduce
adds them): what is checked is that every rank holds exactly its shard quantized, and that TP=2
stays as close to the float32 model as TP=1's quantized model does.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from test_tp import BOUND, LAYERS, _engine, checkpoint  # noqa: F401 (the fixture)

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.kernels.linear_int8 import Int8Rows, pack_int8
from lorapage.model.config import ModelConfig
from lorapage.model.loader import load_state_dict
from lorapage.parallel.shards import shard_base
from lorapage.parallel.worker import build_rank

PROMPTS = [([1, 2, 3, 4, 5, 6, 7], None), ([7, 8, 9, 10, 11], "a1"), ([10, 11, 12, 13, 14, 15], "a1")]
TEACHER = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)


def _prompt_logprobs(engine: Engine) -> list[float]:
    outs = engine.generate_batch(PROMPTS, TEACHER)
    return [lp.logprob for out in outs for lp in out.prompt_logprobs[1:]]


def _distance(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def tp1(checkpoint):
    out = {}
    for q in (None, "int8", "w8a8"):
        engine = _engine(checkpoint, 1, quantization=q)
        out[q] = _prompt_logprobs(engine)
        asyncio.run(engine.close())
    return out


def _same_rows(held: torch.Tensor, want: Int8Rows) -> bool:
    return (
        isinstance(held, Int8Rows)
        and torch.equal(held.as_subclass(torch.Tensor), want.as_subclass(torch.Tensor))
        and torch.equal(held.scales, want.scales)
    )


def test_every_rank_holds_its_own_shard_quantized(checkpoint):
    """Each rank's o (row-parallel: half of each row's columns) and q/k/v (column-parallel: whole
    rows, fused) are its shard of the checkpoint quantized row by row, int8 values and scales
    exactly: rank 0 in the engine, rank 1 built again here from the spec its worker got."""
    engine = _engine(checkpoint, 2, quantization="int8")
    spec = engine.debug.parallel.spec
    whole = ModelConfig.from_dir(spec.model_dir)
    state = load_state_dict(spec.model_dir, spec.dtype)
    models = {0: engine.debug.runner.ctx.model, 1: build_rank(dataclasses.replace(spec, rank=1))[0].ctx.model}
    for rank, model in models.items():
        shard = shard_base(state, rank, 2, whole)
        for layer in range(LAYERS):
            p = f"model.layers.{layer}.self_attn."
            qkv = torch.cat([shard[p + f"{m}_proj.weight"] for m in "qkv"])
            assert _same_rows(model.layers[layer]["o"], pack_int8(shard[p + "o_proj.weight"])), (rank, layer)
            assert _same_rows(model.layers[layer]["qkv"], pack_int8(qkv)), (rank, layer)
    asyncio.run(engine.close())


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_tp2_stays_as_close_to_float32_as_tp1(checkpoint, tp1, quantization):
    """Teacher-forced logprobs of a mixed batch (the base and an all-module adapter): TP=2's
    quantized model is no further from the float32 model than TP=1's, up to a factor of 2 and the
    float32 bound between two orders of sums (tests/parallel/test_tp.py)."""
    engine = _engine(checkpoint, 2, quantization=quantization)
    tp2 = _prompt_logprobs(engine)
    asyncio.run(engine.close())
    quantized = _distance(tp1[quantization], tp1[None])
    assert quantized > 0  # the quantization moved them
    assert _distance(tp2, tp1[None]) <= 2 * quantized + BOUND


def test_a_pre_quantized_checkpoint_is_refused_under_tp(checkpoint, tmp_path):
    """Its scales would have to be cut with the shards (a row-parallel row's one scale serving both
    halves): refused, naming what to do, before any rank starts."""
    from ct_checkpoints import compress_checkpoint

    base = compress_checkpoint(checkpoint / "base", tmp_path / "int8")
    with pytest.raises(ValueError, match="a pre-quantized checkpoint cannot be served with tensor_parallel_size > 1"):
        Engine(EngineConfig(model=str(base), tensor_parallel_size=2))
