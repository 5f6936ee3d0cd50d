"""Gemma 2 and Gemma 3 text against transformers + peft: random-weight checkpoints made by their
own config classes, with sliding-window layers (a window of 6 the prompts cross) between global
ones, Gemma 2's attention and final logit soft-capping, Gemma 3's q/k norms, local rope base and
linear rope scaling on its global layers; LoRA on all seven projections; one mixed batch (a base
row and two adapters' rows) per kernel path. The reference runs HF's eager attention, the one
that soft-caps (sdpa cannot). Also: all-windowed models (an all-local Gemma 2, Mistral's
sliding_window), whose blocks behind the window are freed."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_reference import TOKENIZER_FILES, make_peft_adapter

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.adapters.peft_format import load_adapter_tensors, read_adapter_spec
from lorapage.memory.kv import held_pages
from lorapage.model.config import ModelConfig
from lorapage.model.windows import blocks_out_of_window
from lorapage.tiny import TINY_BASE_DIR

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WINDOW = 6
# Longer than the window, so the local layers' reads leave the prompt's start behind.
PROMPTS = [
    [5, 9, 17, 33, 60, 2, 8, 11, 40, 7, 90, 3],
    [100, 3, 41, 8, 7, 6, 5, 4, 3, 2, 1],
    [12, 13, 14, 15, 16, 17, 18, 19, 20],
    [61, 7, 150, 22, 9, 31, 4, 88],
    [3, 250, 19, 47, 2, 6, 73],
    [9, 14, 201, 35, 8, 66],
]
# One row each: the base, two all-module adapters, DoRA on every module, an embedding LoRA (its
# delta scaled by sqrt(hidden) with the embeddings, as PEFT's layer scales it on Gemma), lora_bias.
ADAPTERS = [None, "a0", "a1", "a2", "a3", "a4"]
MAX_TOKENS = 5
TOL = 1e-4  # max |dlogprob| in float32, as tests/model/test_model_variants.py
COMMON = dict(
    vocab_size=261,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # heads * head_dim != hidden, as in every Gemma
    query_pre_attn_scalar=24,  # not head_dim: the scale must come from it
    sliding_window=WINDOW,
    max_position_embeddings=256,
    eos_token_id=260,
    bos_token_id=None,
    pad_token_id=0,
)


def _build(kind: str):
    """The family's own config class and model: Gemma 2 (local, global: its default alternation,
    the real soft-caps) or Gemma 3 text (local, local, global; 1e4 local base, 1e6 global base
    with linear x8 scaling as the 4B+ models)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    if kind == "gemma2":
        caps = dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
        return Gemma2ForCausalLM(Gemma2Config(num_hidden_layers=2, **caps, **COMMON))
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    layer_types = ["sliding_attention", "sliding_attention", "full_attention"]
    return Gemma3ForCausalLM(
        Gemma3TextConfig(num_hidden_layers=3, layer_types=layer_types, rope_parameters=rope, **COMMON)
    )


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def family(request, tmp_path_factory):
    """(checkpoint, adapter dirs) of one family, built once per module."""
    torch.manual_seed(0)
    model = _build(request.param)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Larger q and k weights give scores of ~10-20, where a cap of 50 bends them visibly.
            big = "q_proj" in name or "k_proj" in name
            p.normal_(0, 0.5 if big else 0.08) if p.dim() == 2 else p.normal_(0, 0.3)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    for f in TOKENIZER_FILES:
        shutil.copy(TINY_BASE_DIR / f, path / f)
    adapters = [
        make_peft_adapter(path, path.parent / f"{path.name}_a{i}", r=8, targets=TARGETS, seed=i + 1) for i in range(2)
    ]
    adapters.append(make_peft_adapter(path, path.parent / f"{path.name}_a2", r=4, targets=TARGETS, seed=3,
                                      use_dora=True))  # fmt: skip
    adapters.append(
        make_peft_adapter(path, path.parent / f"{path.name}_a3", r=4, targets=["embed_tokens", "q_proj"], seed=4)
    )
    adapters.append(make_peft_adapter(path, path.parent / f"{path.name}_a4", r=4, targets=["v_proj", "gate_proj"],
                                      seed=5, lora_bias=True))  # fmt: skip
    return path, adapters


def _reference(path, adapters, prompts=PROMPTS, names=ADAPTERS, max_tokens=MAX_TOKENS, merged=False, **overrides):
    """Greedy tokens and log-probabilities per row from transformers (+ peft, unmerged, or with
    ``merged`` its one adapter's ``merge_and_unload``), eager attention; ``overrides`` change the
    config (to show what a setting is worth)."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, **overrides)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32, attn_implementation="eager")
    if adapters:
        model = PeftModel.from_pretrained(model, adapters[0], adapter_name="a0")
        for i, adapter in enumerate(adapters[1:], 1):
            model.load_adapter(adapter, adapter_name=f"a{i}")
    if merged:  # one adapter, merged into the base's weights (rows then name None)
        model = model.merge_and_unload()
        adapters = []
    model.eval()

    def logits(ids: list[int], name: str | None) -> torch.Tensor:
        if name is None and adapters:
            with model.disable_adapter():
                return model(torch.tensor([ids])).logits[0, -1].float()
        if name is not None:
            model.set_adapter(name)
        return model(torch.tensor([ids])).logits[0, -1].float()

    out = []
    for prompt, name in zip(prompts, names, strict=True):
        ids, tokens, logprobs = list(prompt), [], []
        for _ in range(max_tokens):
            with torch.no_grad():
                row = logits(ids, name)
            t = int(torch.argmax(row))
            tokens.append(t)
            logprobs.append(float(torch.log_softmax(row, -1)[t]))
            ids.append(t)
        out.append((tokens, logprobs))
    return out


@pytest.fixture(scope="module")
def reference(family):
    return _reference(*family)


def _engine(path, adapters, backend: str, **kw) -> Engine:
    kw.setdefault("max_loras", len(ADAPTERS))
    engine = Engine(EngineConfig(model=str(path), max_lora_rank=16, kernel_backend=backend, block_size=4, **kw))
    for i, a in enumerate(adapters):
        engine.add_adapter(f"a{i}", a)
    return engine


def _generate(engine: Engine, prompts=PROMPTS, names=ADAPTERS):
    outs = engine.generate_batch(
        list(zip(prompts, names, strict=True)), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)
    )
    return [(o.token_ids, [x.logprob for x in o.logprobs]) for o in outs]


def _assert_matches(got, want) -> None:
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert lps == pytest.approx(want_lps, abs=TOL)


def test_config_reads_windows_rope_and_soft_caps(family):
    path, _ = family
    mc = ModelConfig.from_dir(path)
    assert mc.gemma is not None and mc.tie_word_embeddings
    if mc.architecture == "Gemma2ForCausalLM":
        assert mc.layer_windows == (WINDOW, None)
        assert (mc.gemma.attn_logit_softcapping, mc.gemma.final_logit_softcapping) == (50.0, 30.0)
        assert mc.gemma.local_rope_theta == mc.rope_theta == 10_000.0
    else:
        assert mc.layer_windows == (WINDOW, WINDOW, None)
        assert (mc.gemma.local_rope_theta, mc.rope_theta) == (10_000.0, 1_000_000.0)
        assert mc.rope_scaling is not None and mc.rope_scaling["factor"] == 8.0
        assert mc.gemma.qk_norm and mc.gemma.attn_logit_softcapping is None


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_mixed_batch_matches_transformers_and_peft(family, reference, backend):
    _assert_matches(_generate(_engine(*family, backend)), reference)


def test_chunked_prefill_and_a_prefix_hit_past_the_window(family, reference):
    """Prompts computed 4 tokens a step, and a second pass whose prompts start with cached blocks:
    a cached block holds the K/V the same tokens at the same positions give (each position's K/V
    depends only on the tokens up to it), and the new tokens' windows read those pages as the
    first pass did, so a hit changes nothing while no page a window still reads is freed."""
    engine = _engine(*family, "torch", max_num_batched_tokens=4, max_num_seqs=4)
    _assert_matches(_generate(engine), reference)
    hits_before = engine.stats().prefix_cache_hit_rate
    _assert_matches(_generate(engine), reference)
    assert engine.stats().prefix_cache_hit_rate > hits_before


@pytest.mark.parametrize("family", ["gemma2"], indirect=True)
def test_triton_interpreted_matches(family, reference):
    """Gemma 2 (window and both soft-caps) on the Triton kernels, interpreted on a CPU: one adapter
    row, its prefill and a decode step (kept short: the interpreter runs each launch in Python)."""
    pytest.importorskip("triton")
    engine = _engine(*family, "triton")
    out = engine.generate_batch([(PROMPTS[1], "a0")], SamplingParams(max_tokens=2, temperature=0.0, logprobs=0))[0]
    want_tokens, want_lps = reference[1]
    assert out.token_ids == want_tokens[:2]
    assert [x.logprob for x in out.logprobs] == pytest.approx(want_lps[:2], abs=TOL)


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager(family):
    """Gemma's step shapes (windowed and global layers, soft-caps, four norms, the scaled embedding
    LoRA, DoRA rows) under CUDA-graph capture give eager's tokens."""
    path, adapters = family
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = []
    for eager in (False, True):
        engine = _engine(path, adapters, "triton", device="cuda", enforce_eager=eager, max_num_seqs=8)
        assert (engine.debug.runner.graphs is None) == eager
        outs.append(engine.generate_batch(list(zip(PROMPTS, ADAPTERS, strict=True)), params))
    for g, w in zip(*outs):
        assert g.token_ids == w.token_ids
        assert [x.logprob for x in g.logprobs] == pytest.approx([x.logprob for x in w.logprobs], abs=1e-3)


def test_windows_and_soft_caps_change_these_outputs(family, reference):
    """What the parity is worth: transformers without the window (or without a soft-cap) gives
    log-probabilities outside the tolerance on these prompts, so a kernel that ignored it fails."""
    path, adapters = family
    raw = json.loads((path / "config.json").read_text())
    changes = [{"sliding_window": 10_000}]
    if raw.get("attn_logit_softcapping"):
        changes += [{"attn_logit_softcapping": None}, {"final_logit_softcapping": None}]
    for change in changes:
        other = _reference(path, adapters[:2], PROMPTS[:3], ADAPTERS[:3], **change)
        worst = max(abs(a - b) for (_, x), (_, y) in zip(other, reference) for a, b in zip(x, y))
        assert worst > 10 * TOL, change


def test_merge_matches_peft_merge_and_unload(family, reference):
    """A dedicated deployment's merge (model/merge.py) of an all-module adapter into a Gemma base
    equals PEFT's merged checkpoint group by group, and PEFT's merge_and_unload decodes the mixed
    batch's rows (the plain adapter's and DoRA's) greedily to the same tokens. (The embedding LoRA's
    row is checked unmerged only: Gemma ties lm_head to the embedding, which PEFT's merge would move.)"""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lorapage.model.config import GROUPS
    from lorapage.model.families import group_weight
    from lorapage.model.gemma import GemmaModel
    from lorapage.model.llama import PROJECTIONS
    from lorapage.model.loader import load_state_dict
    from lorapage.model.merge import merge_adapter

    path, adapters = family
    config = ModelConfig.from_dir(path)
    model = GemmaModel(config, load_state_dict(path, torch.float32), torch.device("cpu"), torch.float32, 64)
    spec = read_adapter_spec(adapters[0], config, 16)
    merge_adapter(model, load_adapter_tensors(spec, torch.float32), spec.scales)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adapters[0])
    want = peft.merge_and_unload().state_dict()
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        for key, prefix, group in zip(PROJECTIONS, ("self_attn.", "self_attn.", "mlp.", "mlp."), GROUPS):
            merged = group_weight(lambda k: want[k + ".weight"], p + prefix, config, group)
            torch.testing.assert_close(model.dense_weight(layer, key), merged, rtol=0, atol=1e-6)
    for i in (1, 3):  # a0 and the DoRA adapter a2
        row = _reference(path, [adapters[i - 1]], PROMPTS[i : i + 1], [None], merged=True)
        _assert_matches(row, reference[i : i + 1])


def test_a_model_with_a_global_layer_frees_no_block():
    assert blocks_out_of_window((WINDOW, None), 100, 4) == 0
    assert blocks_out_of_window((), 100, 4) == 0
    # All layers windowed (Mistral's sliding_window): the next token at 100 reads 95..100.
    assert blocks_out_of_window((WINDOW, WINDOW), 100, 4) == 23
    assert blocks_out_of_window((WINDOW, 3), 5, 4) == 0


def test_all_local_layers_free_the_blocks_behind_the_window(tmp_path):
    """A Gemma-2-shaped model whose every layer is windowed (as Mistral's sliding_window): while a
    sequence runs, the blocks no window reads again go back (to the pool, or idle in the prefix
    cache), its table keeps their places as page 0, and the outputs still match transformers."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(3)
    config = Gemma2Config(num_hidden_layers=2, layer_types=["sliding_attention"] * 2, **COMMON)
    model = Gemma2ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08) if p.dim() == 2 else p.normal_(0, 0.3)
    model.save_pretrained(tmp_path)
    for f in TOKENIZER_FILES:
        shutil.copy(TINY_BASE_DIR / f, tmp_path / f)
    assert ModelConfig.from_dir(tmp_path).layer_windows == (WINDOW, WINDOW)
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=4, kernel_backend="cpu"))
    seen: list[tuple[int, int]] = []  # per running sequence per step: (pages held, blocks in its table)
    schedule = engine.debug.policy.schedule

    def watching(now, ctx):
        seen.extend((held_pages(r.block_table), len(r.block_table)) for r in engine.debug.step_planner.running)
        return schedule(now, ctx)

    engine.debug.policy.schedule = watching
    free = engine.debug.pool_free_pages()
    for _ in range(2):  # the second pass starts from cached blocks, some of them freed ones
        out = engine.generate_batch([(PROMPTS[0], None)], SamplingParams(max_tokens=16, temperature=0.0, logprobs=0))
        want_tokens, want_lps = _reference(tmp_path, [], PROMPTS[:1], [None], max_tokens=16)[0]
        assert out[0].token_ids == want_tokens
        assert [x.logprob for x in out[0].logprobs] == pytest.approx(want_lps, abs=TOL)
    # A window of 6 spans at most 3 blocks of 4, plus the block the next token goes to.
    assert max(h for h, _ in seen) <= 4 < max(n for _, n in seen)
    assert engine.debug.pool_free_pages() == free  # every page back, free or idle in the cache; page 0 not freed


def test_mistral_sliding_window_matches_transformers(tmp_path):
    """Mistral windows every layer when ``sliding_window`` is set (v0.1's 4096; 5 here, which the
    prompt and the generated tokens cross), as transformers does."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(4)
    shape = {k: COMMON[k] for k in ("vocab_size", "num_attention_heads", "num_key_value_heads", "eos_token_id")}
    config = MistralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, sliding_window=5, **shape)
    model = MistralForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08) if p.dim() == 2 else p.normal_(0, 0.3)
    model.save_pretrained(tmp_path)
    for f in TOKENIZER_FILES:
        shutil.copy(TINY_BASE_DIR / f, tmp_path / f)
    assert ModelConfig.from_dir(tmp_path).layer_windows == (5, 5)
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=4, kernel_backend="cpu"))
    out = engine.generate_batch([(PROMPTS[0], None)], SamplingParams(max_tokens=8, temperature=0.0, logprobs=0))[0]
    want_tokens, want_lps = _reference(tmp_path, [], PROMPTS[:1], [None], max_tokens=8)[0]
    assert out.token_ids == want_tokens
    assert [x.logprob for x in out.logprobs] == pytest.approx(want_lps, abs=TOL)
    unwindowed = _reference(tmp_path, [], PROMPTS[:1], [None], max_tokens=8, sliding_window=None)[0][1]
    assert max(abs(a - b) for a, b in zip(unwindowed, want_lps)) > 10 * TOL  # the window matters here


def test_gemma3_vision_checkpoint_is_refused_naming_the_text_model(tmp_path):
    # As the Hub's gemma-3-4b-it: the text model's shape nested under text_config.
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {"hidden_size": 2560}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Gemma3ForCausalLM"):
        ModelConfig.from_dir(tmp_path)
