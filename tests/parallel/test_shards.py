"""The shard arithmetic alone (no ranks): what each rank holds recombines to the whole, and what
tensor parallelism refuses is refused with the reason."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lorapage.model.config import ModelConfig
from lorapage.parallel import check_tensor_parallel, shard_config
from lorapage.parallel.group import rank_device
from lorapage.parallel.shards import shard_base, shard_lora
from lorapage.tiny import TINY_BASE_DIR


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.from_dir(TINY_BASE_DIR)


def test_a_rank_model_divides_heads_and_intermediate(tiny):
    tp = 2
    check_tensor_parallel(tiny, tp)
    shard = shard_config(tiny, tp)
    assert (shard.num_heads * tp, shard.num_kv_heads * tp, shard.intermediate_size * tp) == (
        tiny.num_heads,
        tiny.num_kv_heads,
        tiny.intermediate_size,
    )
    assert (shard.head_dim, shard.hidden_size) == (tiny.head_dim, tiny.hidden_size)
    assert shard_config(tiny, 1) is tiny


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architecture": "Gemma2ForCausalLM"}, "not served under tensor parallelism"),
        ({"architecture": "Phi3ForCausalLM"}, "fused Phi-3"),
        ({"architecture": "MixtralForCausalLM"}, "MoE"),
        ({"num_kv_heads": 3}, "num_key_value_heads"),
        ({"intermediate_size": 15}, "intermediate_size"),
    ],
)
def test_refusals_name_the_reason(tiny, change, message):
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(dataclasses.replace(tiny, **change), 2)


@pytest.mark.parametrize("tp", [2, 4])
def test_lora_shards_recombine_to_the_whole_update(tp):
    """Column-parallel: each rank's rows of ``x A^T B^T`` side by side are the whole; row-parallel:
    the ranks' partial updates sum to the whole (what the one all-reduce does)."""
    g = torch.Generator().manual_seed(0)
    hidden, inner, r = 16, 24, 4
    x, x_inner = torch.randn(3, hidden, generator=g, dtype=torch.float64), torch.randn(3, inner, generator=g)
    x_inner = x_inner.double()
    tensors = {
        (0, "q_proj"): (torch.randn(r, hidden, generator=g).double(), torch.randn(inner, r, generator=g).double()),
        (0, "down_proj"): (torch.randn(r, inner, generator=g).double(), torch.randn(hidden, r, generator=g).double()),
    }
    shards = [shard_lora(tensors, rank, tp) for rank in range(tp)]
    a, b = tensors[(0, "q_proj")]
    column = torch.cat([x @ s[(0, "q_proj")][0].T @ s[(0, "q_proj")][1].T for s in shards], dim=1)
    torch.testing.assert_close(column, x @ a.T @ b.T)
    a, b = tensors[(0, "down_proj")]
    step = inner // tp
    row = sum(
        x_inner[:, k * step : (k + 1) * step] @ s[(0, "down_proj")][0].T @ s[(0, "down_proj")][1].T
        for k, s in enumerate(shards)
    )
    torch.testing.assert_close(row, x_inner @ a.T @ b.T)


def test_base_shards_split_projections_and_keep_the_rest():
    state = {
        "model.layers.0.self_attn.q_proj.weight": torch.arange(32.0).view(8, 4),
        "model.layers.0.self_attn.q_proj.bias": torch.arange(8.0),
        "model.layers.0.self_attn.o_proj.weight": torch.arange(32.0).view(4, 8),
        "model.layers.0.mlp.down_proj.weight": torch.arange(24.0).view(4, 6),
        "model.layers.0.self_attn.q_norm.weight": torch.ones(4),
        "model.embed_tokens.weight": torch.ones(10, 4),
    }
    one = {k.removeprefix("model.layers.0."): v for k, v in shard_base(state, 1, 2).items()}
    whole = {k.removeprefix("model.layers.0."): v for k, v in state.items()}
    assert torch.equal(one["self_attn.q_proj.weight"], whole["self_attn.q_proj.weight"][4:])
    assert torch.equal(one["self_attn.q_proj.bias"], torch.arange(4.0, 8.0))
    assert torch.equal(one["self_attn.o_proj.weight"], whole["self_attn.o_proj.weight"][:, 4:])
    assert torch.equal(one["mlp.down_proj.weight"], whole["mlp.down_proj.weight"][:, 3:])
    assert one["self_attn.q_norm.weight"] is whole["self_attn.q_norm.weight"]
    assert one["model.embed_tokens.weight"] is whole["model.embed_tokens.weight"]


def test_rank_devices():
    assert [rank_device("cuda", r) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert rank_device("cuda:2", 1) == "cuda:3"
    assert rank_device("cpu", 1) == "cpu"
