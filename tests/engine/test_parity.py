"""lorapage against transformers + peft: one heterogeneous batch, every row as if alone."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from hf_reference import make_peft_adapter, make_random_llama, peft_greedy, peft_prompt_logprobs

from lorapage import Engine, EngineConfig, SamplingParams

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# pattern_r64 is outside the default shared envelope (rank <= 16); parity is about the math, so
# the engines here take rank 64 on any module.
WIDE = "all:64"
ADAPTERS = {
    # name: (rank, targets, extra LoraConfig kwargs)
    "attn_r4": (4, ["q_proj", "v_proj"], {}),
    "all_r8": (8, ALL, {}),
    "rslora_r16": (16, ALL, {"use_rslora": True}),
    "pattern_r64": (
        64,
        ALL,
        {"rank_pattern": {"down_proj": 4, "layers.0.self_attn.k_proj": 2}, "alpha_pattern": {"q_proj": 40}},
    ),
    "qko_r8": (8, ["q_proj", "k_proj", "o_proj", "up_proj"], {}),
}
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    base = make_random_llama(root / "base", layers=3)
    adapters = {
        name: make_peft_adapter(base, root / name, r=r, targets=t, seed=i + 1, **kw)
        for i, (name, (r, t, kw)) in enumerate(ADAPTERS.items())
    }
    return base, adapters


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(3, 20))] for _ in range(n)]


def _batch_matches_peft(engine, base, rows, references, seed):
    """One heterogeneous batch of ``rows`` (adapter names, None for the base): each row's greedy
    tokens equal PEFT's alone on ``references[name]``, its logprobs within 1e-4. Returns the
    prompts and outputs."""
    prompts = _prompts(len(rows), seed=seed)
    outs = engine.generate_batch(
        list(zip(prompts, rows)), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)
    )
    for prompt, adapter, out in zip(prompts, rows, outs):
        ref_tokens, ref_lps = peft_greedy(base, references.get(adapter), prompt, MAX_TOKENS)
        assert out.token_ids == ref_tokens, f"adapter {adapter}"
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(ref_lps, abs=1e-4), f"adapter {adapter}"
    return prompts, outs


def test_heterogeneous_batch_matches_peft_row_by_row(checkpoint):
    base, adapters = checkpoint
    engine = Engine(EngineConfig(model=str(base), max_lora_rank=64, shared_envelope=WIDE, max_loras=8, block_size=4))
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    _batch_matches_peft(engine, base, [*adapters, None, *adapters, None], adapters, seed=7)


def test_unmerged_equals_merged_copy(checkpoint, tmp_path):
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, adapters = checkpoint
    merged_dir = tmp_path / "merged"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapters["all_r8"])
    model.merge_and_unload().save_pretrained(merged_dir, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / f, merged_dir / f)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)
    prompts = _prompts(4, seed=11)
    unmerged = Engine(EngineConfig(model=str(base), max_lora_rank=64, shared_envelope=WIDE, max_loras=4))
    unmerged.add_adapter("a", adapters["all_r8"])
    merged = Engine(EngineConfig(model=str(merged_dir)))
    got = unmerged.generate_batch([(p, "a") for p in prompts], params)
    want = merged.generate_batch([(p, None) for p in prompts], params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [x.logprob for x in g.logprobs] == pytest.approx([x.logprob for x in w.logprobs], abs=1e-4)


def test_alone_equals_in_batch_with_31_other_adapters(checkpoint, tmp_path):
    base, adapters = checkpoint
    engine = Engine(EngineConfig(model=str(base), max_lora_rank=16, max_loras=32, block_size=8))
    names = []
    for i in range(32):
        r = (4, 8, 16)[i % 3]
        targets = ALL if i % 2 else ["q_proj", "v_proj", "o_proj"]
        names.append(f"t{i}")
        engine.add_adapter(names[-1], make_peft_adapter(base, tmp_path / names[-1], r=r, targets=targets, seed=100 + i))
    prompts = _prompts(32, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    batch = engine.generate_batch(list(zip(prompts, names)), params)
    for i in (0, 13, 31):
        alone = engine.generate_batch([(prompts[i], names[i])], params)[0]
        assert alone.token_ids == batch[i].token_ids


def _rounded_to(adapter: Path, out: Path, dtype: torch.dtype) -> Path:
    """A copy of a PEFT adapter directory whose weights are stored in ``dtype`` (BF16 or F16): each
    one rounded to nearest even, as the engine rounds them into pages of that dtype."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    shutil.copy(adapter / "adapter_config.json", out / "adapter_config.json")
    weights = load_file(adapter / "adapter_model.safetensors")
    save_file({k: v.to(dtype) for k, v in weights.items()}, out / "adapter_model.safetensors")
    return out


@pytest.mark.parametrize("lora_dtype", ["bfloat16", "float16"])
def test_16_bit_pages_match_peft_on_the_rounded_weights(checkpoint, tmp_path, lora_dtype):
    """--lora-dtype bfloat16 / float16 (llama.cpp's f16 adapters) under a float32 model: what PEFT
    computes with each weight rounded to that dtype (and nothing else changed), in one heterogeneous
    batch. PEFT loads the 16-bit files into the float32 model's LoRA layers, so it computes in
    float32 as the engine does (the C kernels widen each weight exactly)."""
    base, adapters = checkpoint
    dtype = getattr(torch, lora_dtype)
    engine = Engine(
        EngineConfig(
            model=str(base), max_lora_rank=64, shared_envelope=WIDE, max_loras=8, block_size=4, lora_dtype=lora_dtype
        )
    )
    rounded = {}
    for name, path in adapters.items():
        engine.add_adapter(name, path)  # the float32 files: the engine rounds them
        rounded[name] = _rounded_to(path, tmp_path / name, dtype)
    prompts, outs = _batch_matches_peft(engine, base, [*adapters, None], rounded, seed=5)
    # And a 16-bit file is served as it is: its values are in the pages' dtype already, so its pages
    # hold the very bits the float32 file rounded to, and its logprobs are the other row's (up to the
    # base GEMM's float32 sums, which may differ with a row's place in the batch).
    engine.add_adapter("16_bit_file", rounded["all_r8"])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)
    alone = engine.generate_batch([(prompts[1], "16_bit_file"), (prompts[1], "all_r8")], params)
    assert alone[0].token_ids == alone[1].token_ids == outs[1].token_ids
    assert [lp.logprob for lp in alone[0].logprobs] == pytest.approx([lp.logprob for lp in alone[1].logprobs], abs=1e-6)


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole_prompts", "chunked_prefill"])
def test_prompt_logprobs_equal_pefts_teacher_forced_ones(checkpoint, chunk):
    """echo / prompt_logprobs: every prompt token's logprob (and the top 3) of each adapter and the
    base, computed in one heterogeneous batch, equal PEFT's teacher-forced ones within 1e-3."""
    base, adapters = checkpoint
    cfg = dict(model=str(base), max_lora_rank=64, shared_envelope=WIDE, max_loras=8, block_size=4)
    if chunk:
        cfg.update(max_num_batched_tokens=chunk, max_num_seqs=4)
    engine = Engine(EngineConfig(**cfg))
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    rows = [*adapters, None]
    prompts = _prompts(len(rows), seed=11)
    outs = engine.generate_batch(
        list(zip(prompts, rows)), SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    )
    for prompt, adapter, out in zip(prompts, rows, outs):
        ref = peft_prompt_logprobs(base, adapters.get(adapter), prompt)
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        for k in range(1, len(prompt)):
            assert got[k].token_id == prompt[k]
            assert got[k].logprob == pytest.approx(float(ref[k - 1, prompt[k]]), abs=1e-3), (adapter, k)
            top_v, top_i = torch.topk(ref[k - 1], 3)
            assert [v for _, v in got[k].top] == pytest.approx(top_v.tolist(), abs=1e-3)
    # The same prompt without prompt logprobs may hit the cache (those above could not): same tokens.
    plain = engine.generate_batch([(prompts[0], rows[0])], SamplingParams(max_tokens=2, temperature=0.0))
    assert plain[0].prompt_logprobs is None and plain[0].token_ids == outs[0].token_ids


def test_lora_beside_the_projections_matches_peft_row_by_row(checkpoint):
    """The C kernels' LoRA updates on the side thread (kernels/lora_side.py), each beside its base
    projection: what an engine whose forward leaves a core free runs by default."""
    base, adapters = checkpoint
    config = EngineConfig(
        model=str(base), max_lora_rank=64, shared_envelope=WIDE, max_loras=8, block_size=4, lora_side_thread=True
    )
    engine = Engine(config)
    assert engine.debug.ops.lora_side is not None
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    _batch_matches_peft(engine, base, [*adapters, None, *adapters, None], adapters, seed=11)
    assert engine.debug.ops.lora_side.updates >= 4 * 3 * (MAX_TOKENS - 1)  # every decode step's groups
