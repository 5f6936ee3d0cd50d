"""The cost model by shape and the shared envelope, against the design's own figures.

Seed 000 sizes a 70B (80 layers, hidden 8,192, GQA KV 1,024, MLP 28,672, 16-bit): adapters of
65 MB (attention-only rank 8) to 1.66 GB (all modules, rank 64), a 25x spread; at batch 128 with
distinct adapters +6% and +151% decode bandwidth; +75.7% at batch 64 for the latter (its 400);
and the envelope "rank<=16 attention-only, or rank<=8 all-modules" under a 10% bound at batch 64.
Seed 001 sizes a 7B adapter: rank 16 on every module = 39,976,960 values, 80 MB.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from lorapage.adapters.cost import ATTENTION_MODULES, MLP_MODULES, project_cost, uniform_ranks
from lorapage.adapters.envelope import Envelope, ServingTier, ShapeRule, format_bytes, refusal
from lorapage.config import EngineConfig, parse_envelope_rules
from lorapage.model.config import MODULES, ModelConfig

SEED_BASE_BYTES = 140_000_000_000  # seed 000 rounds the 70B's weights to 140 GB


def llama_config(path: Path, *, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int) -> ModelConfig:
    """A Hugging Face config.json of that shape (no weights: the cost model reads shapes only)."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": mlp,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": 32000,
        "torch_dtype": "float16",
    }
    (path / "config.json").write_text(json.dumps(config))
    return ModelConfig.from_dir(path)


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory) -> ModelConfig:
    return llama_config(tmp_path_factory.mktemp("70b"), hidden=8192, layers=80, heads=64, kv_heads=8, mlp=28672)


@pytest.fixture(scope="module")
def llama7b(tmp_path_factory) -> ModelConfig:
    return llama_config(tmp_path_factory.mktemp("7b"), hidden=4096, layers=32, heads=32, kv_heads=32, mlp=11008)


def cost_of(model: ModelConfig, rank: int, modules, batch: int = 64):
    return project_cost(model, uniform_ranks(model, rank, modules), reference_batch=batch)


def test_seed_000_adapter_sizes_and_spread(llama70b):
    small, big = cost_of(llama70b, 8, ATTENTION_MODULES), cost_of(llama70b, 64, MODULES)
    assert format_bytes(small.adapter_bytes) == "65.5 MB"  # the seed's "65 MB"
    assert format_bytes(big.adapter_bytes) == "1.66 GB"  # the seed's "1.66 GB"
    assert big.adapter_bytes / small.adapter_bytes == pytest.approx(25.3, abs=0.05)  # "a 25x spread"


def test_seed_000_decode_cost_figures(llama70b):
    """+6% and +151% at batch 128, +75.7% at batch 64: exactly with the seed's 140 GB base, and
    within 2.5% of them with the base this shape reads per step (137.4 GB: the seed rounds)."""
    small, big = cost_of(llama70b, 8, ATTENTION_MODULES), cost_of(llama70b, 64, MODULES)
    seed_small, seed_big = (dataclasses.replace(c, base_bytes=SEED_BASE_BYTES) for c in (small, big))
    assert round(seed_small.bytes_pct_at(128)) == 6
    assert round(seed_big.bytes_pct_at(128)) == 151
    assert round(seed_big.projected_cost_pct, 1) == 75.7  # batch 64: the design's 400
    assert small.bytes_pct_at(128) == pytest.approx(6.0, rel=0.025)
    assert big.bytes_pct_at(128) == pytest.approx(151, rel=0.025)
    assert big.projected_cost_pct == pytest.approx(75.7, rel=0.025)
    assert format_bytes(big.base_bytes) == "137 GB"


def test_cost_scales_with_distinct_adapters_and_flops_do_not(llama70b):
    """Bytes: one read per distinct adapter per step; FLOPs: every row its own product, so the
    same share at any batch (and equal to one adapter's bytes when both are 16-bit)."""
    c = cost_of(llama70b, 16, ATTENTION_MODULES, batch=64)
    assert c.bytes_pct_at(32) == pytest.approx(c.projected_cost_pct / 2)
    assert c.bytes_pct_at(1) == pytest.approx(c.flops_pct)
    assert c.flops_pct == pytest.approx(cost_of(llama70b, 16, ATTENTION_MODULES, batch=128).flops_pct)
    # The seed's per-projection FLOPs: 16 x 16,384 / 8,192^2 = 0.39% for q_proj at rank 16.
    q = project_cost(llama70b, {(0, "q_proj"): 16})
    assert 100 * q.adapter_params / (8192 * 8192) == pytest.approx(0.39, abs=0.005)


def test_narrower_adapter_dtype_halves_the_bytes_not_the_flops(llama7b):
    ranks = uniform_ranks(llama7b, 16, MODULES)
    wide = project_cost(llama7b, ranks, base_bytes_per_param=4, adapter_bytes_per_param=4)
    narrow = project_cost(llama7b, ranks, base_bytes_per_param=4, adapter_bytes_per_param=2)
    assert narrow.projected_cost_pct == pytest.approx(wide.projected_cost_pct / 2)
    assert narrow.flops_pct == wide.flops_pct


def test_seed_001_adapter_values(llama7b):
    """Rank 16 on attention and MLP of the 7B: 4 x 131,072 + 3 x 241,664 per layer, x 32 layers."""
    c = cost_of(llama7b, 16, MODULES)
    assert c.adapter_params == 32 * (4 * 131_072 + 3 * 241_664) == 39_976_960
    assert format_bytes(c.adapter_bytes) == "80.0 MB"


def test_design_envelope_is_its_ten_percent_bound(llama70b):
    """On the design's 70B, the shapes "rank<=16 attention-only, or rank<=8 all-modules" are the
    ones a 10% bound at batch 64 lets through, for every power-of-two rank and module class."""
    by_shape = Envelope(llama70b, (ShapeRule("attention", 16), ShapeRule("all", 8)), None, 64, 2, 2)
    by_cost = Envelope(llama70b, (), 10.0, 64, 2, 2)
    shared = []
    for modules in (ATTENTION_MODULES, MLP_MODULES, MODULES):
        for rank in (4, 8, 16, 32, 64):
            ranks = uniform_ranks(llama70b, rank, modules)
            tiers = {e.tier(ranks, e.cost(ranks)) for e in (by_shape, by_cost)}
            assert len(tiers) == 1, (modules, rank)
            if tiers == {ServingTier.SHARED}:
                shared.append((len(modules), rank))
    assert (4, 16) in shared and (4, 32) not in shared and (7, 8) in shared and (7, 16) not in shared
    assert by_shape.allowed() == "rank<=16 attention-only, or rank<=8 on any modules"


def test_the_refusal_carries_its_arithmetic(llama70b):
    """The design's 400: the projected cost at the reference batch and the allowed shapes."""
    envelope = Envelope(llama70b, (ShapeRule("attention", 16), ShapeRule("all", 8)), None, 64, 2, 2)
    ranks = uniform_ranks(llama70b, 64, MODULES)
    cost = envelope.cost(ranks)
    assert envelope.tier(ranks, cost) is ServingTier.DEDICATED
    err = refusal("/adapters/big", envelope, ranks, cost)
    assert err.status == 400 and err.code == "adapter_outside_envelope"
    assert "rank 64 on 7 modules (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) x 80 layers" in (
        err.message
    )
    assert f"+{cost.projected_cost_pct:.1f}% decode cost at batch 64" in err.message
    assert "1.66 GB read per decode step against 137 GB of base weights" in err.message
    assert "Allowed on the shared tier: rank<=16 attention-only, or rank<=8 on any modules" in err.message
    assert "dedicated" in err.message


def test_a_cost_bound_and_shape_rules_must_both_pass(llama7b):
    both = Envelope(llama7b, (ShapeRule("all", 16),), 20.0, 64, 2, 2)
    attn16, all16 = uniform_ranks(llama7b, 16, ATTENTION_MODULES), uniform_ranks(llama7b, 16, MODULES)
    assert both.tier(attn16, both.cost(attn16)) is ServingTier.SHARED  # 16.3%
    assert both.tier(all16, both.cost(all16)) is ServingTier.DEDICATED  # 38.7% > 20%
    assert both.allowed() == "rank<=16 on any modules, with a projected cost <= 20% at batch 64"
    none = Envelope(llama7b, (), None, 64, 2, 2)
    assert none.tier(all16, none.cost(all16)) is ServingTier.SHARED and none.allowed() == "any shape"


def test_envelope_config_is_parsed_and_checked():
    assert parse_envelope_rules("attention:16, all:8") == (("attention", 16), ("all", 8))
    assert parse_envelope_rules("") == ()
    assert EngineConfig().envelope_rules == "all:64" and EngineConfig().cost_reference_batch == 64
    for bad in ("attn:16", "all:0", "all", "mlp:x"):
        with pytest.raises(ValueError, match="shared_envelope rule"):
            EngineConfig(shared_envelope=bad)
    with pytest.raises(ValueError, match="cost_reference_batch"):
        EngineConfig(cost_reference_batch=0)
    with pytest.raises(ValueError, match="shared_max_cost_pct"):
        EngineConfig(shared_max_cost_pct=-1.0)


def test_cost_and_envelope_modules_import_no_torch():
    """Pure policy: the cost model and the envelope import nothing that needs torch."""
    root = Path(__file__).resolve().parents[2] / "lorapage" / "adapters"
    for name in ("cost.py", "envelope.py"):
        tree = ast.parse((root / name).read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names} | {
            node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
        }
        assert not any(m.split(".")[0] == "torch" for m in imported), (name, imported)
        assert not any(m.startswith("lorapage.adapters.") and m.split(".")[2] not in ("cost",) for m in imported), (
            name,
            imported,
        )


SMALL = dict(
    vocab_size=261, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0
)


@pytest.mark.parametrize(
    "config_class, extra",
    [
        ("LlamaConfig", {"intermediate_size": 96}),
        ("Qwen2Config", {"intermediate_size": 96}),  # q / k / v biases
        ("Qwen3Config", {"intermediate_size": 96, "head_dim": 32}),  # per-head q / k norms
        ("Phi3Config", {"intermediate_size": 96}),
        ("Gemma2Config", {"intermediate_size": 96, "head_dim": 32}),  # four norms a layer
        ("Gemma3TextConfig", {"intermediate_size": 96, "head_dim": 32}),  # and q / k norms
        ("MixtralConfig", {"intermediate_size": 32, "num_local_experts": 4}),
        ("Qwen3MoeConfig", {"moe_intermediate_size": 32, "num_experts": 4, "head_dim": 16}),
        ("OlmoeConfig", {"intermediate_size": 32, "num_experts": 4}),  # q / k norms over the projections
    ],
)
def test_base_decode_params_are_the_checkpoints_own(config_class, extra, tmp_path):
    """Every parameter transformers builds for the family, the embedding table aside (read by row)
    and the LM head counted once whether tied or not: norms, q / k norms and biases per family."""
    import transformers

    from lorapage.adapters.cost import base_decode_params

    config = getattr(transformers, config_class)(**SMALL, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config)
    config.architectures = [type(model).__name__]
    config.save_pretrained(tmp_path)
    params = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    lm_head = 0 if "lm_head.weight" in dict(model.named_parameters()) else SMALL["vocab_size"] * SMALL["hidden_size"]
    assert base_decode_params(ModelConfig.from_dir(tmp_path)) == params + lm_head
