"""The shard arithmetic alone (no ranks): what each rank holds recombines to the whole, and what
tensor parallelism refuses is refused with the reason."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lorapage.model.config import ModelConfig
from lorapage.model.rank_comm import RankComm, gather_shrink, vocab_embed, vocab_logits
from lorapage.parallel import check_tensor_parallel, shard_config
from lorapage.parallel.group import rank_device
from lorapage.parallel.shards import shard_base, shard_lora, shard_section
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
        ({"architecture": "OlmoForCausalLM"}, "not served under tensor parallelism"),
        ({"num_kv_heads": 3}, "num_key_value_heads"),
        ({"intermediate_size": 15}, "intermediate_size"),
        ({"hidden_size": 63}, "hidden_size"),
    ],
)
def test_refusals_name_the_reason(tiny, change, message):
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(dataclasses.replace(tiny, **change), 2)


def test_moe_is_served_and_its_refusals_name_the_reason(tiny):
    """Mixtral's experts split by columns (each rank: 1/2 of every expert's intermediate); an
    expert intermediate the ranks cannot split evenly, and OLMoE (q / k norms over every head), are
    refused with the reason."""
    moe = ModelConfig.from_dir(_moe_dir("MixtralForCausalLM"))
    check_tensor_parallel(moe, 2)
    assert moe.moe is not None and shard_config(moe, 2).moe == dataclasses.replace(
        moe.moe, intermediate_size=moe.moe.intermediate_size // 2
    )
    odd = dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, intermediate_size=15))
    with pytest.raises(ValueError, match="intermediate size of an expert"):
        check_tensor_parallel(odd, 2)
    with pytest.raises(ValueError, match="OLMoE's q / k RMSNorm spans every head"):
        check_tensor_parallel(ModelConfig.from_dir(_moe_dir("OlmoeForCausalLM")), 2)
    check_tensor_parallel(dataclasses.replace(tiny, architecture="Phi3ForCausalLM"), 2)
    check_tensor_parallel(dataclasses.replace(tiny, architecture="Gemma2ForCausalLM"), 2)


def test_expert_lora_shards_put_back_together():
    """An expert's LoRA split 2 ways: the fused gate_up's A by rank rows (3 of 5, a zero row
    padding rank 1's), its B's gate and up halves each by rows; down's A by columns, B by rows."""
    g = torch.Generator().manual_seed(0)
    fused = (torch.randn(5, 8, generator=g), torch.randn(12, 5, generator=g))
    down = (torch.randn(4, 6, generator=g), torch.randn(8, 4, generator=g))
    whole = {(0, "experts.1.gate_up_proj"): fused, (0, "experts.1.down_proj"): down}
    shards = [shard_lora(whole, rank, 2) for rank in range(2)]
    a = torch.cat([s[(0, "experts.1.gate_up_proj")][0] for s in shards])
    assert torch.equal(a[:5], fused[0]) and not a[5:].any()
    b = [s[(0, "experts.1.gate_up_proj")][1] for s in shards]
    assert torch.equal(torch.cat([b[0][:3], b[1][:3], b[0][3:], b[1][3:]]), fused[1])
    assert torch.equal(torch.cat([s[(0, "experts.1.down_proj")][0] for s in shards], dim=1), down[0])
    assert torch.equal(torch.cat([s[(0, "experts.1.down_proj")][1] for s in shards]), down[1])


def _moe_dir(arch):
    import json
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp())
    raw = json.loads((TINY_BASE_DIR / "config.json").read_text())
    raw |= {"architectures": [arch], "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2}
    (d / "config.json").write_text(json.dumps(raw))
    return d


def _row_update(shards, tp, module, x):
    """What the ranks compute from their shards of row-parallel ``module``'s LoRA on input ``x``:
    the partial shrinks summed (the all-reduce), then each rank's B rows, side by side."""
    step = x.shape[1] // tp
    h = sum(x[:, k * step : (k + 1) * step] @ s[(0, module)][0].T for k, s in enumerate(shards))
    return torch.cat([h @ s[(0, module)][1].T for s in shards], dim=1)


@pytest.mark.parametrize(("tp", "ranks"), [(2, (4, 4, 4)), (2, (3, 0, 2)), (4, (5, 3, 0)), (3, (1, 1, 1))])
def test_fully_sharded_lora_recombines_to_the_whole_update(tp, ranks):
    """Column-parallel: the ranks' shares of the group's stacked A gathered (rank order) are the
    stacked A (then zero rows), and each rank's B rows times the whole h are its output rows;
    row-parallel: the partial shrinks sum to the whole h and the B rows side by side are the whole
    expand. Each rank holds 1/tp of every matrix (A up to tp - 1 zero rows a group)."""
    g = torch.Generator().manual_seed(0)
    hidden, inner = 12, 24
    x = torch.randn(3, hidden, generator=g, dtype=torch.float64)
    x_inner = torch.randn(3, inner, generator=g, dtype=torch.float64)

    def pair(d_in, d_out, r):
        return torch.randn(r, d_in, generator=g).double(), torch.randn(d_out, r, generator=g).double()

    tensors = {(0, m): pair(hidden, inner, r) for m, r in zip(("q_proj", "k_proj", "v_proj"), ranks, strict=True) if r}
    tensors[(0, "down_proj")] = pair(inner, hidden, 2)
    shards = [shard_lora(tensors, rank, tp) for rank in range(tp)]
    stacked = torch.cat([tensors[(0, m)][0] for m in ("q_proj", "k_proj", "v_proj") if (0, m) in tensors])
    shares = [torch.cat([s[(0, m)][0] for m in ("q_proj", "k_proj", "v_proj") if (0, m) in s]) for s in shards]
    assert {share.shape[0] for share in shares} == {-(-stacked.shape[0] // tp)}
    gathered = torch.cat(shares)
    torch.testing.assert_close(gathered[: stacked.shape[0]], stacked)
    assert not gathered[stacked.shape[0] :].any()
    h = x @ gathered.T
    start = 0
    for m in ("q_proj", "k_proj", "v_proj"):
        if (0, m) not in tensors:
            continue
        a, b = tensors[(0, m)]
        r = a.shape[0]
        got = torch.cat([h[:, start : start + r] @ s[(0, m)][1].T for s in shards], dim=1)
        torch.testing.assert_close(got, x @ a.T @ b.T)
        start += r
    a, b = tensors[(0, "down_proj")]
    torch.testing.assert_close(_row_update(shards, tp, "down_proj", x_inner), x_inner @ a.T @ b.T)


def _fake_comm(parts, rank=0):
    """A RankComm over ``parts`` (every rank's tensor, as the collective would see them)."""
    world = len(parts)
    return RankComm(
        rank,
        world,
        all_reduce=lambda t: t.copy_(sum(parts)),
        all_gather=lambda t: torch.stack(parts),
        gather=lambda t: torch.stack(parts) if rank == 0 else t,
    )


def test_gather_shrink_puts_each_tokens_shares_back_in_place():
    """Two adapters of different ranks in one step: token t's rank j wrote ``w_t`` columns (its rows
    of the stacked A); after the gather each token's h is its whole shrink."""
    T, W, world = 3, 9, 2
    whole = torch.arange(T * W, dtype=torch.float32).view(T, W)
    rows = torch.tensor([5, 2, 4])  # ceil(9 / 2), ceil(3 / 2), ceil(7 / 2): whole ranks 9, 3 (+1 pad), 7 (+1)
    width = -(-W // world)
    parts = []
    for j in range(world):
        h = torch.full((T, width), float("nan"))
        for t in range(T):
            w = int(rows[t])
            share = whole[t, j * w : (j + 1) * w]
            h[t, : share.numel()] = share
        parts.append(h)
    h = torch.full((T, W), -1.0)
    gather_shrink(h, _fake_comm(parts), rows)
    for t, whole_rank in enumerate((9, 3, 7)):
        torch.testing.assert_close(h[t, :whole_rank], whole[t, :whole_rank])


def test_vocab_parallel_embedding_and_logits_recombine():
    vocab, hidden, world = 11, 4, 2
    g = torch.Generator().manual_seed(0)
    table = torch.randn(vocab, hidden, generator=g)
    state = {"model.embed_tokens.weight": table}
    shards = [shard_base(state, r, world, _tiny())["model.embed_tokens.weight"] for r in range(world)]
    assert [s.shape[0] for s in shards] == [6, 6] and not shards[1][-1].any()  # 11 rows: one zero row pads
    ids = torch.tensor([0, 5, 6, 10])
    looked = [None] * world
    for r in range(world):  # each rank's masked lookup, then the sum the all-reduce makes
        looked[r] = shards[r][(ids - 6 * r).clamp(0, 5)] * ((ids >= 6 * r) & (ids < 6 * (r + 1)))[:, None]
    x = vocab_embed(shards[0], ids, _fake_comm(looked))
    torch.testing.assert_close(x, table[ids])
    h = torch.randn(3, hidden, generator=g)
    logits = vocab_logits(h @ shards[0].T, _fake_comm([h @ s.T for s in shards]), vocab)
    torch.testing.assert_close(logits, h @ table.T)


def _tiny() -> ModelConfig:
    return ModelConfig.from_dir(TINY_BASE_DIR)


def test_phi3_fused_weights_split_per_part():
    """qkv_proj [q + k + v, hidden]: a rank's rows are its q heads, then its k and v heads; gate_up:
    its gate columns then its up columns."""
    phi = dataclasses.replace(_tiny(), architecture="Phi3ForCausalLM")
    q, kv, inter = phi.q_size, phi.kv_size, phi.intermediate_size
    qkv = torch.arange(float(q + 2 * kv))[:, None].expand(-1, 2)
    gate_up = torch.arange(float(2 * inter))[:, None].expand(-1, 2)
    state = {"model.layers.0.self_attn.qkv_proj.weight": qkv, "model.layers.0.mlp.gate_up_proj.weight": gate_up}
    one = shard_base(dict(state), 1, 2, phi)
    want = torch.cat([qkv[q // 2 : q], qkv[q + kv // 2 : q + kv], qkv[q + kv + kv // 2 :]])
    assert torch.equal(one["model.layers.0.self_attn.qkv_proj.weight"], want)
    want = torch.cat([gate_up[inter // 2 : inter], gate_up[inter + inter // 2 :]])
    assert torch.equal(one["model.layers.0.mlp.gate_up_proj.weight"], want)


def test_base_shards_split_projections_and_keep_the_rest():
    state = {
        "model.layers.0.self_attn.q_proj.weight": torch.arange(32.0).view(8, 4),
        "model.layers.0.self_attn.q_proj.bias": torch.arange(8.0),
        "model.layers.0.self_attn.o_proj.weight": torch.arange(32.0).view(4, 8),
        "model.layers.0.mlp.down_proj.weight": torch.arange(24.0).view(4, 6),
        "model.layers.0.self_attn.q_norm.weight": torch.ones(4),
        "model.norm.weight": torch.ones(4),
    }
    one = {k.removeprefix("model.layers.0."): v for k, v in shard_base(state, 1, 2, _tiny()).items()}
    whole = {k.removeprefix("model.layers.0."): v for k, v in state.items()}
    assert torch.equal(one["self_attn.q_proj.weight"], whole["self_attn.q_proj.weight"][4:])
    assert torch.equal(one["self_attn.q_proj.bias"], torch.arange(4.0, 8.0))
    assert torch.equal(one["self_attn.o_proj.weight"], whole["self_attn.o_proj.weight"][:, 4:])
    assert torch.equal(one["mlp.down_proj.weight"], whole["mlp.down_proj.weight"][:, 3:])
    assert one["self_attn.q_norm.weight"] is whole["self_attn.q_norm.weight"]
    assert one["model.norm.weight"] is whole["model.norm.weight"]


def test_rank_devices():
    assert [rank_device("cuda", r) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert rank_device("cuda:2", 1) == "cuda:3"
    assert rank_device("cpu", 1) == "cpu"


def test_dora_and_bias_rows_follow_their_columns():
    """A section's dora and bias rows [layers, 2 * total]: q/k/v/gate/up's columns split with their
    outputs; o/down's factors whole on every rank, their bias on rank 0 only."""
    tiny = _tiny()
    dims = tiny.projection_dims()
    total = sum(d for _, d in dims.values())
    section = torch.arange(2.0 * total)[None].expand(2, -1) + 1
    shards = [shard_section(section, r, 2, tiny) for r in range(2)]
    shard_total = sum(d for _, d in shard_config(tiny, 2).projection_dims().values())
    assert all(s.shape == (2, 2 * shard_total) for s in shards)
    col = {}
    for m, (_, d) in dims.items():
        col[m] = (sum(dims[x][1] for x in list(dims)[: list(dims).index(m)]), d)
    q0, q = col["q_proj"]
    torch.testing.assert_close(shards[1][:, : q // 2], section[:, q0 + q // 2 : q0 + q])
    o0, o = col["o_proj"]  # after the rank's half of q, k and v
    start = (col["k_proj"][1] + col["v_proj"][1] + q) // 2
    for r in range(2):
        torch.testing.assert_close(shards[r][:, start : start + o], section[:, o0 : o0 + o])
        bias = shards[r][:, shard_total + start : shard_total + start + o]
        assert bias.eq(section[:, total + o0 : total + o0 + o]).all() if r == 0 else not bias.any()


def test_experts_shard_alike_in_either_checkpoint_spelling():
    """transformers 5's fused ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I]
    split as the per-expert tensors (Mixtral's w1 / w3 by rows, w2 by columns); the router whole."""
    moe = ModelConfig.from_dir(_moe_dir("MixtralForCausalLM"))
    g = torch.Generator().manual_seed(0)
    E, INTER, H = 4, 6, 8
    gate, up, down = (
        torch.randn(E, INTER, H, generator=g),
        torch.randn(E, INTER, H, generator=g),
        torch.randn(E, H, INTER, generator=g),
    )
    router = torch.randn(E, H, generator=g)
    p = "model.layers.0.block_sparse_moe."
    fused = {
        p + "gate.weight": router,
        p + "experts.gate_up_proj": torch.cat([gate, up], 1),
        p + "experts.down_proj": down,
    }
    per_expert = {p + "gate.weight": router}
    for e in range(E):
        per_expert |= {p + f"experts.{e}.w1.weight": gate[e], p + f"experts.{e}.w3.weight": up[e]}
        per_expert[p + f"experts.{e}.w2.weight"] = down[e]
    for rank in range(2):
        a, b = shard_base(fused, rank, 2, moe), shard_base(per_expert, rank, 2, moe)
        assert torch.equal(a[p + "gate.weight"], router) and torch.equal(b[p + "gate.weight"], router)
        for e in range(E):
            w1, w3, w2 = (b[p + f"experts.{e}.{w}.weight"] for w in ("w1", "w3", "w2"))
            assert torch.equal(w1, gate[e, rank * 3 : rank * 3 + 3]) and torch.equal(w3, up[e, rank * 3 : rank * 3 + 3])
            assert torch.equal(w2, down[e, :, rank * 3 : rank * 3 + 3])
            assert torch.equal(a[p + "experts.gate_up_proj"][e], torch.cat([w1, w3]))
            assert torch.equal(a[p + "experts.down_proj"][e], w2)
