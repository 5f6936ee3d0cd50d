"""MoE bases against transformers + peft: Mixtral, Qwen3-MoE and OLMoE (random weights made with their
own config classes), with LoRA on attention and on the experts in both forms PEFT writes (fused
``target_parameters`` and transformers 4's per-expert ``target_modules``), DoRA on attention and an
embedding LoRA, every adapter and the base in one mixed batch, on each kernel path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_reference import TOKENIZER_FILES, make_peft_adapter, peft_greedy
from safetensors.torch import save_file

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.errors import AdapterFormatError
from lorapage.tiny import TINY_BASE_DIR

PROMPTS = [[5, 9, 17, 33, 60, 2, 8], [100, 3, 41], [7, 7, 19, 200]]
STEPS = 4
# Router probabilities here are within ~1e-6 of transformers' (float32 rounding through two
# layers); a top-k choice with a margin above this bound is the same in both on any CPU.
ROUTING_MARGIN = 1e-4
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
COMMON = dict(
    vocab_size=261,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    eos_token_id=257,
    bos_token_id=None,
    tie_word_embeddings=False,
)


def _save(model, path: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif "norm" in name:
                p.normal_(1.0, 0.2)  # q_norm / k_norm too: a weight of ones would not test them
    model.save_pretrained(path)
    for f in TOKENIZER_FILES:
        shutil.copy(TINY_BASE_DIR / f, path / f)
    return path


def _mixtral(path: Path) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    return _save(MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_local_experts=4, **COMMON)), path)


def _qwen3_moe(path: Path) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        intermediate_size=96, moe_intermediate_size=32, num_experts=4, head_dim=16, norm_topk_prob=True, **COMMON
    )
    return _save(Qwen3MoeForCausalLM(cfg), path)


def _olmoe(path: Path) -> Path:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    # clip_qkv low enough that some normed q / k values are clamped
    return _save(OlmoeForCausalLM(OlmoeConfig(intermediate_size=32, num_experts=4, clip_qkv=2.0, **COMMON)), path, 1)


def per_expert_adapter(base: Path, path: Path, names: tuple[str, str, str], block: str, *, r: int, seed: int) -> Path:
    """A transformers-4 style adapter (LoRA per expert and matrix, ``names`` gate / up / down as
    the family spells them, and on q / v), which peft converts to the fused form on load."""
    cfg = json.loads((base / "config.json").read_text())
    hidden, experts = cfg["hidden_size"], cfg.get("num_local_experts") or cfg["num_experts"]
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * (cfg.get("head_dim") or hidden // cfg["num_attention_heads"])
    dims = {names[0]: (hidden, inter), names[1]: (hidden, inter), names[2]: (inter, hidden)}
    dims_attn = {"q_proj": (hidden, hidden), "v_proj": (hidden, kv)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}

    def pair(key: str, d_in: int, d_out: int) -> None:
        tensors[f"base_model.model.model.layers.{key}.lora_A.weight"] = torch.randn(r, d_in, generator=g) * 0.3
        tensors[f"base_model.model.model.layers.{key}.lora_B.weight"] = torch.randn(d_out, r, generator=g) * 0.2

    for layer in range(cfg["num_hidden_layers"]):
        for e in range(experts):
            for name, (d_in, d_out) in dims.items():
                pair(f"{layer}.{block}.experts.{e}.{name}", d_in, d_out)
        for name, (d_in, d_out) in dims_attn.items():
            pair(f"{layer}.self_attn.{name}", d_in, d_out)
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": [*names, "q_proj", "v_proj"]}
    config["base_model_name_or_path"] = str(base)
    (path / "adapter_config.json").write_text(json.dumps(config | {"lora_dropout": 0.0, "bias": "none"}))
    return path


_BUILT: dict[str, tuple[Path, dict[str, Path]]] = {}


def _family(name: str, tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """(base dir, {adapter name: dir}) of family ``name``, built once per run: attention-only,
    attention + fused experts, per-expert (transformers 4's form), DoRA on attention, embedding LoRA."""
    if name not in _BUILT:
        root = tmp_path_factory.mktemp(name)
        if name == "mixtral":
            base, names, block = _mixtral(root / "base"), ("w1", "w3", "w2"), "block_sparse_moe"
        else:
            make = _qwen3_moe if name == "qwen3_moe" else _olmoe
            base, names, block = make(root / "base"), ("gate_proj", "up_proj", "down_proj"), "mlp"
        experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        _BUILT[name] = (
            base,
            {
                "attn": make_peft_adapter(base, root / "attn", r=4, targets=ATTENTION, seed=1),
                "fused": make_peft_adapter(
                    base, root / "fused", r=4, targets=ATTENTION, seed=2, target_parameters=experts
                ),
                "per_expert": per_expert_adapter(base, root / "per_expert", names, block, r=2, seed=5),
                # DoRA on attention (peft refuses DoRA on target_parameters; per expert it is refused
                # here), and an embedding LoRA
                "dora": make_peft_adapter(base, root / "dora", r=4, targets=ATTENTION, seed=6, use_dora=True),
                "emb": make_peft_adapter(base, root / "emb", r=4, targets=["embed_tokens", "v_proj"], seed=7),
            },
        )
    return _BUILT[name]


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "olmoe"])
def family(request, tmp_path_factory):
    return _family(request.param, tmp_path_factory)


def routing_margin(base: Path, adapter: Path | None, ids: list[int]) -> float:
    """The smallest gap between the k-th and (k+1)-th router probability over every layer and
    token of ``ids``, as transformers (+ peft) computes them."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    k = model.config.num_experts_per_tok
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
    probs = torch.cat([torch.softmax(x.float(), -1) for x in logits]).sort(-1, descending=True).values
    return float((probs[:, k - 1] - probs[:, k]).min())


def _rows(adapters: dict[str, Path]) -> list[tuple[list[int], str | None]]:
    names = [None, *adapters]
    return [(PROMPTS[i % len(PROMPTS)], names[i % len(names)]) for i in range(len(names) + 1)]


@pytest.fixture(scope="module")
def reference(family):
    """Each mixed-batch row's greedy tokens and log-probabilities from transformers (+ peft), alone,
    after checking that no routing on the way is a near-tie; and merge_and_unload's for the DoRA and
    embedding rows."""
    base, adapters = family
    out, merged = [], {}
    for prompt, name in _rows(adapters):
        path = adapters[name] if name else None
        tokens, logprobs = peft_greedy(base, path, prompt, STEPS)
        assert routing_margin(base, path, prompt + tokens[:-1]) > ROUTING_MARGIN, f"a near-tie in routing ({name})"
        out.append((tokens, logprobs))
        if name in ("dora", "emb"):  # and merge_and_unload's (these bases are untied)
            merged[name] = peft_greedy(base, path, prompt, STEPS, merged=True)
    return out, merged


def _engine(base: Path, adapters: dict[str, Path], backend: str) -> Engine:
    engine = Engine(EngineConfig(model=str(base), kernel_backend=backend, max_lora_rank=16, max_loras=8))
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    return engine


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_mixed_batch_matches_transformers_and_peft(family, reference, backend):
    base, adapters = family
    rows = _rows(adapters)
    outs = _engine(base, adapters, backend).generate_batch(
        rows, SamplingParams(max_tokens=STEPS, temperature=0.0, logprobs=0, ignore_eos=True)
    )
    unmerged, merged = reference
    for (_, name), out, (tokens, logprobs) in zip(rows, outs, unmerged):
        for want_tokens, want_logprobs in [(tokens, logprobs)] + ([merged[name]] if name in merged else []):
            assert out.token_ids == want_tokens, name
            assert [x.logprob for x in out.logprobs] == pytest.approx(want_logprobs, abs=1e-4), name


def test_triton_interpreted_matches_transformers(tmp_path_factory):
    """The Triton kernels (interpreted: one family, one step) with both expert-LoRA forms in the batch."""
    base, adapters = _family("qwen3_moe", tmp_path_factory)
    rows = [(PROMPTS[1], "fused"), (PROMPTS[2], "per_expert")]
    outs = _engine(base, adapters, "triton").generate_batch(
        rows, SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
    )
    for (prompt, name), out in zip(rows, outs):
        tokens, logprobs = peft_greedy(base, adapters[name], prompt, 1)
        assert out.token_ids == tokens
        assert out.logprobs[0].logprob == pytest.approx(logprobs[0], abs=1e-4)


def _file_values(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
        return sum(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] for k in f.keys())


@pytest.mark.parametrize("name", ["fused", "per_expert"])
def test_expert_lora_is_held_and_costed_per_expert(family, name):
    """Both forms read as per-expert modules whose values are exactly the file's; a token reads its
    top_k of the E experts' LoRA; the envelope names the experts' modules."""
    from lorapage.adapters.cost import adapter_params, project_cost
    from lorapage.adapters.envelope import target_modules
    from lorapage.adapters.layout import AdapterLayout
    from lorapage.adapters.peft_format import read_adapter_spec
    from lorapage.model.config import ModelConfig

    base, adapters = family
    model = ModelConfig.from_dir(base)
    assert model.moe is not None
    spec = read_adapter_spec(adapters[name], model, 16)
    assert adapter_params(model, spec.ranks) == _file_values(adapters[name])
    layout = AdapterLayout.plan(spec, model, 64)
    assert layout.numel * model.num_layers == _file_values(adapters[name])  # every layer alike
    experts = {m: r for (_, m), r in spec.ranks.items() if m.startswith("experts.")}
    kinds = ("experts.gate_up_proj", "experts.down_proj") if name == "fused" else ("experts.gate_proj",)
    assert set(kinds) <= set(target_modules(spec.ranks))
    assert len(experts) == model.moe.num_experts * (2 if name == "fused" else 3)
    attention = sum(r * sum(model.lora_dims()[m]) for (_, m), r in spec.ranks.items() if not m.startswith("e"))
    expert_values = adapter_params(model, spec.ranks) - attention
    cost = project_cost(model, spec.ranks)
    assert cost.adapter_params == attention + expert_values * model.moe.top_k // model.moe.num_experts


def _write_adapter(path: Path, tensors: dict[str, torch.Tensor], targets: list[str]) -> Path:
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": targets, "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def test_what_a_moe_base_refuses(tmp_path, tmp_path_factory):
    """LoRA on the router, on a dense MLP the base does not have, DoRA / lora_bias on an expert,
    and experts on a dense base."""
    from lorapage.adapters.peft_format import read_adapter_spec
    from lorapage.model.config import ModelConfig

    base, adapters = _family("mixtral", tmp_path_factory)
    model = ModelConfig.from_dir(base)
    pre = "base_model.model.model.layers.0."
    pair = lambda key, d_in, d_out: {  # noqa: E731
        f"{pre}{key}.lora_A.weight": torch.zeros(2, d_in),
        f"{pre}{key}.lora_B.weight": torch.zeros(d_out, 2),
    }
    router = _write_adapter(tmp_path / "router", pair("block_sparse_moe.gate", 64, 4), ["gate"])
    with pytest.raises(AdapterFormatError, match="router"):
        read_adapter_spec(router, model, 16)
    dense = _write_adapter(tmp_path / "dense", pair("mlp.gate_proj", 64, 48), ["gate_proj"])
    with pytest.raises(AdapterFormatError, match="has no such module"):
        read_adapter_spec(dense, model, 16)
    # DoRA / lora_bias on an expert (transformers 4's per-expert modules; peft refuses them on target_parameters)
    for what, key in (("DoRA", "lora_magnitude_vector"), ("lora_bias", "lora_B.bias")):
        tensors = pair("block_sparse_moe.experts.0.w1", 64, 48) | {
            f"{pre}block_sparse_moe.experts.0.w1.{key}": torch.ones(48)
        }
        vectors = _write_adapter(tmp_path / what, tensors, ["w1"])
        with pytest.raises(AdapterFormatError, match=f"{what} on a MoE expert is not served"):
            read_adapter_spec(vectors, model, 16)
    llama = ModelConfig.from_dir(TINY_BASE_DIR)
    with pytest.raises(AdapterFormatError, match="base has no experts"):
        read_adapter_spec(adapters["fused"], llama, 16)


@pytest.mark.parametrize("name", ["fused", "per_expert"])
def test_merged_experts_equal_peft_merge_and_unload(family, name):
    """A dedicated deployment's merge of expert LoRA: each expert's weights as PEFT merges them."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lorapage.adapters.peft_format import load_adapter_tensors, read_adapter_spec
    from lorapage.kernels.linear_cpu import dense_weight, linear_cpu, pack_weight
    from lorapage.model.config import ModelConfig
    from lorapage.model.llama import LlamaModel
    from lorapage.model.loader import load_state_dict
    from lorapage.model.merge import merge_adapter

    base, adapters = family
    mc = ModelConfig.from_dir(base)
    model = LlamaModel(mc, load_state_dict(base, torch.float32), torch.device("cpu"), torch.float32, 64)
    model.pack_weights(pack_weight, linear_cpu)
    spec = read_adapter_spec(adapters[name], mc, 16)
    merge_adapter(model, load_adapter_tensors(spec, torch.float32), spec.scales)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapters[name])
    reference = peft.merge_and_unload().state_dict()
    for layer, mlp in enumerate(model.moe_layers):
        for key, weights in (("gate_up_proj", mlp.gate_up), ("down_proj", mlp.down)):
            want = reference[f"model.layers.{layer}.mlp.experts.{key}"]
            got = torch.stack([dense_weight(w) for w in weights])
            # Both sum W + scale * B @ A in float32 (entries <= ~1): a few units of roundoff.
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_stored_spec_still_splits_fused_experts(family):
    """The registry's copy of a spec keeps the base's expert geometry, so a restored version's
    fused expert LoRA splits per expert as at registration."""
    from lorapage.adapters.peft_format import load_adapter_tensors, read_adapter_spec
    from lorapage.model.config import ModelConfig
    from lorapage.registry.prepare import spec_from_json, spec_to_json

    base, adapters = family
    spec = read_adapter_spec(adapters["fused"], ModelConfig.from_dir(base), 16)
    restored = spec_from_json(spec_to_json(spec))
    assert restored.expert_geometry == spec.expert_geometry is not None
    want, got = load_adapter_tensors(spec, torch.float32), load_adapter_tensors(restored, torch.float32)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k][i], got[k][i]) for k in want for i in (0, 1))
