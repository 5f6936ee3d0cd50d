"""Dense families against transformers + peft: Qwen3 (q/k norms, head_dim of its own, tied
embeddings, yarn), Phi-3/4 (fused qkv / gate_up in the checkpoint and in the adapters, partial
rotation, sharded safetensors, longrope), Llama 3.x rope scaling (yarn, dynamic); one mixed batch
(the base and two adapters) on the torch and C kernel paths, Triton interpreted for Qwen3.

Bounds: greedy tokens identical, and every log-probability within 1e-4 of transformers' in
float32 (as tests/engine/test_parity.py): for these 2-layer models of width <= 256 each logit
sums a few hundred products of O(0.1) values, so reordered float32 sums move it by well under
1e-5 on any CPU, while one wrong norm weight, rotation column or B row moves it by 1e-2 or more.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from engine_util import collect
from hf_reference import make_peft_adapter, make_random_model, peft_greedy

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.adapters.peft_format import load_adapter_tensors, read_adapter_spec
from lorapage.errors import AdapterFormatError
from lorapage.model.config import GROUPS, ModelConfig, context_length
from lorapage.model.families import group_weight
from lorapage.model.llama import PROJECTIONS, LlamaModel
from lorapage.model.loader import load_state_dict
from lorapage.model.merge import merge_adapter
from lorapage.model.rope import dynamic_ntk_base, inv_freq, rope_tables

VOCAB, EOS = 261, 257
PROMPTS = [[5, 9, 17, 33, 60, 2, 8], [100, 3, 41, 7], [12, 250, 31, 4, 77, 9], [8, 61, 2, 30], [44, 7, 120, 3, 9],
           [200, 13, 5, 66, 21]]  # fmt: skip
# One mixed batch: the base, two all-module adapters, DoRA on every module, an embedding LoRA and
# lora_bias (on a fused module's name where the family fuses).
ROWS = [None, "a", "b", "dora", "emb", "bias"]
MAX_TOKENS = 4
TOL = 1e-4
LLAMA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3_MODULES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def _qwen3(path):
    from transformers import Qwen3Config

    return make_random_model(
        path,
        Qwen3Config,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # not hidden / heads (16): Qwen3's head_dim is its own
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=EOS,
        bos_token_id=None,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )


def _phi3(path):
    from transformers import Phi3Config

    return make_random_model(
        path,
        Phi3Config,
        max_shard_size="60KB",
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # head_dim 24, 12 of its columns rotate
        partial_rotary_factor=0.5,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=EOS,
        bos_token_id=None,
        pad_token_id=None,
    )


FAMILIES = {"qwen3": (_qwen3, LLAMA_MODULES), "phi3": (_phi3, PHI3_MODULES)}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(base dir, adapter dirs, references): each family's checkpoint and two all-module adapters,
    built once, with transformers + peft's greedy rows (unmerged, and merged for ``a``)."""
    build, modules = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    base = build(root / "base")
    adapters = {
        # alpha_pattern / rank_pattern keyed by the family's own names (a fused one on Phi-3)
        "a": make_peft_adapter(
            base,
            root / "a",
            r=8,
            targets=modules,
            seed=1,
            alpha_pattern={modules[0]: 24},
            rank_pattern={modules[-1]: 2},
        ),
        "b": make_peft_adapter(base, root / "b", r=4, targets=modules, seed=2, use_rslora=True),
        "dora": make_peft_adapter(base, root / "dora", r=4, targets=modules, seed=3, use_dora=True),
        "emb": make_peft_adapter(base, root / "emb", r=4, targets=["embed_tokens", modules[-1]], seed=4),
        "bias": make_peft_adapter(base, root / "bias", r=4, targets=[modules[0], modules[2]], seed=5, lora_bias=True),
    }
    refs = [peft_greedy(base, adapters.get(name), p, MAX_TOKENS) for name, p in zip(ROWS, PROMPTS)]
    # merge_and_unload's too: PEFT cannot merge lora_bias into these bias-free projections, and an
    # embedding LoRA on a tied base (Qwen3 here) would move lm_head with it, so those rows are unmerged only.
    tied = ModelConfig.from_dir(base).tie_word_embeddings
    mergeable = ["a", "dora"] if tied else ["a", "dora", "emb"]
    merged = {n: peft_greedy(base, adapters[n], PROMPTS[ROWS.index(n)], MAX_TOKENS, merged=True) for n in mergeable}
    return request.param, base, adapters, refs, merged


def _mixed_batch(base, adapters, backend, max_tokens=MAX_TOKENS, rows=ROWS):
    engine = Engine(
        EngineConfig(model=str(base), kernel_backend=backend, block_size=4, max_model_len=128, max_loras=len(ROWS))
    )
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    return engine.generate_batch([(PROMPTS[ROWS.index(r)], r) for r in rows], params)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_mixed_batch_matches_transformers_and_peft(family, backend):
    name, base, adapters, refs, merged = family
    outs = _mixed_batch(base, adapters, backend)
    for row, out, (tokens, lps) in zip(ROWS, outs, refs):
        assert out.token_ids == tokens, f"{name} {row}"
        assert [x.logprob for x in out.logprobs] == pytest.approx(lps, abs=TOL), f"{name} {row}"
    for row, (tokens, lps) in merged.items():  # merge_and_unload's greedy tokens too
        out = outs[ROWS.index(row)]
        assert out.token_ids == tokens, f"{name} {row} merged"
        assert [x.logprob for x in out.logprobs] == pytest.approx(lps, abs=TOL), f"{name} {row} merged"


def test_triton_interpreted_matches_for_qwen3(family):
    name, base, adapters, refs, _ = family
    if name != "qwen3":
        pytest.skip("Triton interpreted runs for one family (it is slow)")
    # a prefill and a decode step: the interpreter is slow
    outs = _mixed_batch(base, adapters, "triton", max_tokens=2, rows=[None, "a", "dora", "emb"])
    for row, out in zip([None, "a", "dora", "emb"], outs):
        tokens, lps = refs[ROWS.index(row)]
        assert out.token_ids == tokens[:2]
        assert [x.logprob for x in out.logprobs] == pytest.approx(lps[:2], abs=TOL)


def test_merged_weights_equal_peft_merge_and_unload(family):
    """A dedicated deployment's merge (model/merge.py) of each family's adapter, fused modules
    included, equals PEFT's merged checkpoint, group by group."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, base, adapters, _, _ = family
    config = ModelConfig.from_dir(base)
    model = LlamaModel(config, load_state_dict(base, torch.float32), torch.device("cpu"), torch.float32, 64)
    spec = read_adapter_spec(adapters["a"], config, 64)
    merge_adapter(model, load_adapter_tensors(spec, torch.float32), spec.scales)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapters["a"])
    reference = peft.merge_and_unload().state_dict()
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        for key, prefix, group in zip(PROJECTIONS, ("self_attn.", "self_attn.", "mlp.", "mlp."), GROUPS):
            want = group_weight(lambda k: reference[k + ".weight"], p + prefix, config, group)
            # W + scale * B @ A in float32 both; only the order of the scale's product differs.
            torch.testing.assert_close(model.dense_weight(layer, key), want, rtol=0, atol=1e-6)


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager(family):
    """The families' step shapes (q/k norms, partial rotation, fused-module adapters) under graph capture."""
    _, base, adapters, _, _ = family
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = []
    for eager in (False, True):
        config = EngineConfig(
            model=str(base), device="cuda", kernel_backend="triton", enforce_eager=eager, max_num_seqs=4, max_loras=8
        )
        engine = Engine(config)
        assert (engine.debug.runner.graphs is None) == eager
        for name, path in adapters.items():
            engine.add_adapter(name, path)
        outs.append(engine.generate_batch(list(zip(PROMPTS, ROWS)), params))
    for g, w in zip(*outs):
        assert g.token_ids == w.token_ids
        assert [x.logprob for x in g.logprobs] == pytest.approx([x.logprob for x in w.logprobs], abs=1e-3)


async def test_a_fused_module_adapter_serves_after_a_restart(family, tmp_path):
    """Restored from the registry (its spec stored per part), a Phi-3 adapter still splits its
    fused weights when read, and a DoRA one its fused magnitudes."""
    name, base, adapters, refs, _ = family
    if name != "phi3":
        pytest.skip("the fused-module case")
    config = EngineConfig(model=str(base), kernel_backend="torch", state_dir=str(tmp_path / "state"), max_model_len=128)
    engine = Engine(config)
    for row in ("a", "dora"):
        engine.add_adapter(row, adapters[row])
    await engine.close()
    engine = Engine(config)
    try:
        for row in ("a", "dora"):
            i = ROWS.index(row)
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            last, _ = await collect(engine, PROMPTS[i], row, params)
            assert last.token_ids == refs[i][0], row
    finally:
        await engine.close()


def test_adapter_of_another_family_is_refused_naming_the_modules(family, tmp_path):
    name, base, adapters, _, _ = family
    other = "phi3" if name == "qwen3" else "qwen3"
    foreign = make_peft_adapter(
        FAMILIES[other][0](tmp_path / "other"), tmp_path / "foreign", r=4, targets=FAMILIES[other][1], seed=3
    )
    engine = Engine(EngineConfig(model=str(base), kernel_backend="torch"))
    own = ", ".join(FAMILIES[name][1])
    with pytest.raises(AdapterFormatError, match=rf"whose LoRA target modules are {own}\. Was the adapter trained"):
        engine.add_adapter("x", foreign)


def _llama(path, rope):
    from transformers import LlamaConfig

    return make_random_model(
        path,
        LlamaConfig,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        eos_token_id=EOS,
        bos_token_id=None,
        rope_parameters={"rope_theta": 10000.0, **rope},
    )


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8, "beta_fast": 16},
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16, "mscale": 2, "mscale_all_dim": 1},
        {"rope_type": "dynamic", "factor": 4.0},  # within max_position_embeddings: HF's plain table
        {"rope_type": "linear", "factor": 3.0},
    ],
    ids=["yarn", "yarn-mscale", "dynamic", "linear"],
)
def test_llama_rope_scaling_matches_transformers(rope, tmp_path):
    base = _llama(tmp_path / "llama", rope)
    engine = Engine(EngineConfig(model=str(base), kernel_backend="torch", max_model_len=64))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    for prompt, out in zip(PROMPTS, engine.generate_batch([(p, None) for p in PROMPTS], params)):
        tokens, lps = peft_greedy(base, None, prompt, MAX_TOKENS)
        assert out.token_ids == tokens
        assert [x.logprob for x in out.logprobs] == pytest.approx(lps, abs=TOL)


def _cached_greedy(base, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy decode with its KV cache, as ``generate`` runs it: the prompt in one
    forward, then one token per forward (longrope picks short or long factors per forward)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    tokens, lps = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_tokens):
            lp = torch.log_softmax(out.logits[0, -1].float(), -1)
            t = int(torch.argmax(lp))
            tokens.append(t)
            lps.append(float(lp[t]))
            out = model(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, lps


def test_phi3_longrope_matches_transformers_generate_across_the_original_length(tmp_path):
    """Prompts within ``original_max_position_embeddings`` (8), decoding past it: each position
    rotates as transformers' cached generation rotated it (short factors below 8, long from 8 on)."""
    from transformers import Phi3Config

    half = 6  # rotary_dim 12 / 2
    base = make_random_model(
        tmp_path / "phi3",
        Phi3Config,
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        partial_rotary_factor=0.5,
        max_position_embeddings=64,
        original_max_position_embeddings=8,
        eos_token_id=EOS,
        bos_token_id=None,
        pad_token_id=None,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "short_factor": [1.0 + 0.3 * i for i in range(half)],
            "long_factor": [2.0 + i for i in range(half)],
            "original_max_position_embeddings": 8,
        },
    )
    engine = Engine(EngineConfig(model=str(base), kernel_backend="torch", max_model_len=64))
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
    for prompt, out in zip(PROMPTS, engine.generate_batch([(p, None) for p in PROMPTS], params)):
        tokens, lps = _cached_greedy(base, prompt, 6)
        assert out.token_ids == tokens
        assert [x.logprob for x in out.logprobs] == pytest.approx(lps, abs=TOL)
    config = ModelConfig.from_dir(base)
    cos, _ = rope_tables(config, 64)
    scale = math.sqrt(1 + math.log(64 / 8) / math.log(8))  # the attention factor, at every position
    long = 1.0 / (torch.tensor([2.0 + i for i in range(half)]) * 10000.0 ** (torch.arange(0, 12, 2).float() / 12))
    assert torch.allclose(cos[40, :half], torch.cos(40 * long) * scale, atol=1e-6)


def _config(tmp_path, **raw) -> ModelConfig:
    base = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps({**base, "num_attention_heads": 4, **raw}))
    return ModelConfig.from_dir(tmp_path)


def test_dynamic_past_the_positions_is_vllms_fixed_table(tmp_path):
    config = _config(tmp_path, max_position_embeddings=64, rope_scaling={"type": "dynamic", "factor": 4.0})
    assert context_length(config, None) == 256  # vLLM's derived length: positions * factor
    dim, base = 16, 10000.0
    # vLLM (DynamicNTKScalingRotaryEmbedding since vllm#41277): HF's base at the served length.
    served, trained, factor = 200, 64, 4.0
    want_base = base * ((factor * served / trained) - (factor - 1)) ** (dim / (dim - 2))
    assert dynamic_ntk_base(base, factor, dim, served, trained) == pytest.approx(want_base, rel=1e-12)
    want = 1.0 / (want_base ** (torch.arange(0, dim, 2).float() / dim))
    assert torch.allclose(inv_freq(config, served), want, rtol=1e-6)
    plain = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    assert torch.equal(inv_freq(config, 64), plain)  # within the positions: HF's own numbers


def test_rope_parameters_spelling_reads_as_rope_scaling(tmp_path):
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    old = _config(tmp_path, max_position_embeddings=128, rope_theta=5e5, rope_scaling=scaling)
    new = _config(tmp_path, max_position_embeddings=128, rope_parameters={"rope_theta": 5e5, **scaling})
    assert old == new
    assert torch.equal(rope_tables(old, 200)[0], rope_tables(new, 200)[0])


def test_unsupported_architecture_and_rope_are_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel' is not supported; lorapage runs .*Qwen3ForCausalLM"):
        _config(tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"rope_scaling type 'mrope' is not supported; lorapage computes default"):
        _config(tmp_path, rope_scaling={"rope_type": "mrope", "factor": 2.0})


def test_phi3_sliding_window_caps_the_context(tmp_path):
    config = _config(tmp_path, architectures=["Phi3ForCausalLM"], max_position_embeddings=4096, sliding_window=2047)
    assert context_length(config, None) == 2047
    with pytest.raises(ValueError, match=r"sliding window \(2047\).*at most 2047"):
        context_length(config, 4096)
