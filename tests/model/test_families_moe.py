"""MoE bases against transformers + peft: Mixtral and Qwen3-MoE (random weights made with their
own config classes), with LoRA on attention and on the experts in both forms PEFT writes (fused
``target_parameters`` and transformers 4's per-expert ``target_modules``), every adapter and the
base in one mixed batch, on each kernel path."""

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


def _save(model, path: Path) -> Path:
    torch.manual_seed(0)
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


def per_expert_adapter(base: Path, path: Path, names: tuple[str, str, str], block: str, *, r: int, seed: int) -> Path:
    """A transformers-4 style adapter (LoRA per expert and matrix, ``names`` gate / up / down as
    the family spells them, and on q / v), which peft converts to the fused form on load."""
    cfg = json.loads((base / "config.json").read_text())
    hidden, experts = cfg["hidden_size"], cfg["num_local_experts"]
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


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def family(request, tmp_path_factory):
    """(base dir, {adapter name: dir}) for one family: attention-only, attention + fused experts,
    per-expert (transformers 4's form)."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "mixtral":
        base, names, block = _mixtral(root / "base"), ("w1", "w3", "w2"), "block_sparse_moe"
    else:
        base, names, block = _qwen3_moe(root / "base"), ("gate_proj", "up_proj", "down_proj"), "mlp"
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    adapters = {
        "attn": make_peft_adapter(base, root / "attn", r=4, targets=ATTENTION, seed=1),
        "fused": make_peft_adapter(base, root / "fused", r=4, targets=ATTENTION, seed=2, target_parameters=experts),
        "per_expert": per_expert_adapter(base, root / "per_expert", names, block, r=2, seed=5),
    }
    return base, adapters


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


def _engine(base: Path, adapters: dict[str, Path], backend: str) -> Engine:
    engine = Engine(EngineConfig(model=str(base), kernel_backend=backend, max_lora_rank=16))
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    return engine


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_mixed_batch_matches_transformers_and_peft(family, backend):
    base, adapters = family
    engine = _engine(base, adapters, backend)
    rows = _rows(adapters)
    outs = engine.generate_batch(rows, SamplingParams(max_tokens=STEPS, temperature=0.0, logprobs=0))
    for (prompt, name), out in zip(rows, outs):
        path = adapters[name] if name else None
        tokens, logprobs = peft_greedy(base, path, prompt, STEPS)
        assert routing_margin(base, path, prompt + tokens[:-1]) > ROUTING_MARGIN, "a near-tie in routing"
        assert out.token_ids == tokens, name
        assert [x.logprob for x in out.logprobs] == pytest.approx(logprobs, abs=1e-4), name


def test_triton_interpreted_matches_torch(family):
    """The Triton kernels (interpreted) give the torch path's tokens with experts' LoRA in the batch."""
    base, adapters = family
    rows = [(PROMPTS[1], None), (PROMPTS[1], "fused"), (PROMPTS[2], "per_expert")]
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=0)
    want = _engine(base, adapters, "torch").generate_batch(rows, params)
    got = _engine(base, adapters, "triton").generate_batch(rows, params)
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == pytest.approx([x.logprob for x in b.logprobs], abs=1e-4)


def test_expert_lora_is_counted_per_expert(family):
    base, adapters = family
    engine = _engine(base, {}, "torch")
    spec = engine.add_adapter("fused", adapters["fused"]) or engine.adapters.spec("fused")
    assert spec is not None


def test_router_lora_and_dense_mlp_lora_are_refused(family, tmp_path):
    base, _ = family
    engine = _engine(base, {}, "torch")
    dense = make_peft_adapter(_dense_twin(base, tmp_path / "dense"), tmp_path / "mlp", r=2, targets=["gate_proj"], seed=4)
    with pytest.raises(AdapterFormatError, match="has no such module"):
        engine.add_adapter("mlp", dense)


def _dense_twin(base: Path, path: Path) -> Path:
    """A Llama with ``base``'s attention shapes (an adapter trained on it targets a dense MLP)."""
    from hf_reference import make_random_llama

    cfg = json.loads((base / "config.json").read_text())
    return make_random_llama(path, hidden=64, heads=4, kv_heads=2, head_dim=cfg.get("head_dim") or 16)
