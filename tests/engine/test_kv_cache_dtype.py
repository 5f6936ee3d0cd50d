"""A float32 model over float16 KV pages (kv_cache_dtype fp16) against the same model over float32
pages: the same greedy tokens, and log-probabilities within a bound the float16 rounding of K and V
justifies, computed from the model itself (not fitted to this CPU's last bits)."""

from __future__ import annotations

import pytest
import torch
from hf_reference import make_random_llama

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.tiny import TINY_BASE_DIR

PROMPTS = [[5, 9, 17, 33, 60, 2, 8], [100, 3, 41]]
TOKENS = 6
U16 = 2.0**-11  # float16's unit roundoff: a normal value x is stored within U16 |x|
SUBNORMAL = 2.0**-25  # the most a value under float16's smallest normal moves
FLOAT32_SLACK = 2e-4  # each float32 engine is within 1e-4 of transformers (tests/model): two of them


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_random_llama(tmp_path_factory.mktemp("kv16"), hidden=64, heads=4, kv_heads=2, seed=3)


def run(path, kv_cache_dtype: str):
    engine = Engine(EngineConfig(model=str(path), kv_cache_dtype=kv_cache_dtype, num_threads=1))
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    return engine.generate_batch([(p, None) for p in PROMPTS], params)


def rounding_effect(path, prompt: list[int], tokens: list[int]) -> list[float]:
    """For each generated token t, a first-order bound on how far storing every cached K and V
    value x in float16 moves lp_t: ``sum |d lp_t / d x| |e_x|`` (float64, transformers,
    teacher-forced), with ``|e_x| <= U16 |x| + SUBNORMAL``.

    K is rounded after its rotation, which mixes the pair (i, i + D/2) of each head and keeps its
    norm: ``|g_pair . R^T e_pair| <= |g_pair| |e_pair| <= |g_pair| (U16 |k_pair| + sqrt(2) SUBNORMAL)``,
    so K's term is taken over pairs, from the unrotated projection."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float64).eval()
    dim = model.config.hidden_size // model.config.num_attention_heads
    cached: list[tuple[str, torch.Tensor]] = []

    def keep(kind):
        def hook(_module, _inputs, output):
            output.retain_grad()
            cached.append((kind, output))

        return hook

    for layer in model.model.layers:
        layer.self_attn.k_proj.register_forward_hook(keep("k"))
        layer.self_attn.v_proj.register_forward_hook(keep("v"))
    logprobs = model(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)

    def pairs(y: torch.Tensor) -> torch.Tensor:
        return y.reshape(y.shape[0], -1, 2, dim // 2).norm(dim=2)

    effects = []
    for t, token in enumerate(tokens):
        lp = logprobs[len(prompt) + t - 1, token]
        grads = torch.autograd.grad(lp, [x for _, x in cached], retain_graph=True)
        effect = 0.0
        for (kind, x), g in zip(cached, grads, strict=True):
            x, g = x.detach()[0], g[0]
            if kind == "v":
                effect += float((g.abs() * (U16 * x.abs() + SUBNORMAL)).sum())
            else:
                effect += float((pairs(g) * (U16 * pairs(x) + 2**0.5 * SUBNORMAL)).sum())
        effects.append(effect)
    return effects


def test_fp16_pages_halve_a_blocks_bytes(checkpoint):
    wide = Engine(EngineConfig(model=str(checkpoint), num_pages=64))
    half = Engine(EngineConfig(model=str(checkpoint), num_pages=64, kv_cache_dtype="fp16"))
    assert half.debug.pool.kv_storage.dtype == torch.float16
    assert half.debug.pool.storage.dtype == torch.float32  # activations and the pool stay float32
    assert half.debug.pool.page_size * 2 == wide.debug.pool.page_size  # a block's bytes halved
    assert half.debug.pool.kv_page_size == wide.debug.pool.page_size  # the same values per block


def test_fp16_kv_gives_float32_kvs_tokens_within_the_rounding_bound(checkpoint):
    wide, half = run(checkpoint, "auto"), run(checkpoint, "fp16")
    for prompt, w, h in zip(PROMPTS, wide, half, strict=True):
        assert h.token_ids == w.token_ids
        effects = rounding_effect(checkpoint, prompt, w.token_ids)
        for t, (a, b) in enumerate(zip(w.logprobs, h.logprobs, strict=True)):
            # First order, doubled for the second-order terms (relative size ~U16 of the first). A
            # worst case (every rounding aligned): on this checkpoint ~1e-2, the measured ~1e-4.
            bound = 2 * effects[t] + FLOAT32_SLACK
            assert abs(a.logprob - b.logprob) <= bound, (prompt, t, a.logprob, b.logprob, bound)


def test_fp16_and_bf16_kv_keep_the_tiny_models_greedy_tokens():
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0)
    outs = {
        kv: [
            o.token_ids
            for o in Engine(EngineConfig(model=str(TINY_BASE_DIR), kv_cache_dtype=kv)).generate_batch(
                [(p, None) for p in PROMPTS], params
            )
        ]
        for kv in ("auto", "fp16", "bf16")
    }
    assert outs["fp16"] == outs["auto"] == outs["bf16"]


def test_fp8_and_a_mismatched_16_bit_model_are_refused():
    with pytest.raises(ValueError, match="fp8 KV cache is not supported"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="cannot serve a bfloat16 model"):
        EngineConfig(dtype="bfloat16", kv_cache_dtype="fp16")
    assert EngineConfig(dtype="bfloat16", kv_cache_dtype="bf16").kv_dtype_name == "bfloat16"
