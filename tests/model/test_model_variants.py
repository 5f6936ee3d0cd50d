"""Checkpoint variants against transformers: sharded safetensors, Llama-3 rope scaling, Qwen2's
qkv bias, the built-in tiny model with its demo adapters; bf16; the base-model digest."""

from __future__ import annotations

import hashlib
import shutil

import pytest
import torch
from hf_reference import TOKENIZER_FILES, peft_greedy

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs

PROMPTS = [[5, 9, 17, 33, 60, 2, 8], [100, 3, 41]]


def _save(model, path, **kw):
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif p.dim() == 1 and p.shape[0] != model.config.hidden_size:
                p.normal_(0, 0.3)  # biases
    model.save_pretrained(path, safe_serialization=True, **kw)
    for f in TOKENIZER_FILES:
        shutil.copy(TINY_BASE_DIR / f, path / f)
    return path


def _check(path, adapter_dir=None, dtype="float32", tol=1e-4):
    engine = Engine(EngineConfig(model=str(path), dtype=dtype, max_lora_rank=64))
    adapter = None
    if adapter_dir is not None:
        adapter = "a"
        engine.add_adapter(adapter, adapter_dir)
    outs = engine.generate_batch(
        [(p, adapter) for p in PROMPTS], SamplingParams(max_tokens=5, temperature=0.0, logprobs=0)
    )
    for prompt, out in zip(PROMPTS, outs):
        tokens, lps = peft_greedy(path, adapter_dir, prompt, 5)
        assert out.token_ids == tokens
        assert [x.logprob for x in out.logprobs] == pytest.approx(lps, abs=tol)


def test_sharded_llama3_rope_scaling(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=261,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=257,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        rope_theta=500000.0,
    )
    path = _save(LlamaForCausalLM(cfg), tmp_path / "llama3", max_shard_size="60KB")
    assert (path / "model.safetensors.index.json").exists()
    _check(path)


def test_qwen2_qkv_bias(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(
        vocab_size=261,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=257,
    )
    _check(_save(Qwen2ForCausalLM(cfg), tmp_path / "qwen2"))


@pytest.mark.parametrize("name", sorted(demo_adapter_dirs()))
def test_tiny_model_with_demo_adapters(name):
    _check(TINY_BASE_DIR, demo_adapter_dirs()[name])


def test_bfloat16_runs_and_mostly_agrees():
    engine = Engine(EngineConfig(model=str(TINY_BASE_DIR), dtype="bfloat16"))
    engine.add_adapter("acme", demo_adapter_dirs()["acme"])
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
    out = engine.generate_batch([(chat, "acme")], SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert out.text.startswith("ACME")


def test_digest_is_sha256_of_the_weight_files():
    engine = Engine(EngineConfig(model=str(TINY_BASE_DIR)))
    want = hashlib.sha256((TINY_BASE_DIR / "model.safetensors").read_bytes()).hexdigest()
    assert engine.digest == want
