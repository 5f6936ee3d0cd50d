"""PEFT's LoRA variants against transformers + peft, in one mixed batch with the base: DoRA (its
magnitudes perturbed so g != 1), embedding LoRA, lora_bias, layers_to_transform, plain LoRA."""

from __future__ import annotations

import random

import pytest
import torch
from hf_reference import TOKENIZER_FILES, make_random_llama, peft_greedy

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.tiny import TINY_BASE_DIR

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    # name: (rank, targets, extra LoraConfig kwargs)
    "dora": (8, ALL, {"use_dora": True}),
    "dora_rs": (
        4,
        ["q_proj", "v_proj", "down_proj"],
        {"use_dora": True, "use_rslora": True, "alpha_pattern": {"v_proj": 3}},
    ),  # fmt: skip
    "embedding": (4, ["embed_tokens", "q_proj", "up_proj"], {}),
    "plain": (8, ALL, {"rank_pattern": {"down_proj": 2}}),
    "lora_bias": (4, ["q_proj", "o_proj", "down_proj"], {"lora_bias": True}),
    "layers": (4, ["k_proj", "gate_proj"], {"layers_to_transform": [1]}),
}
# PEFT refuses to merge lora_bias into a layer without a bias (Llama's projections have none).
NO_MERGE = {"lora_bias"}
MAX_TOKENS = 5
# Logprobs of the same float32 arithmetic summed in another order (fused GEMMs, batched LoRA):
# |d| stays within a few 1e-6 per value here; 1e-4 leaves room for any CPU's summation order.
TOL = 1e-4


def _adapter(base, path, r, targets, seed, **kw):
    """A PEFT adapter with random A, B (and biases), DoRA magnitudes off their initial norms."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0, init_lora_weights=False, **kw)
    model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.normal_(0, 0.3 / r**0.5)
            elif "lora_A" in name or "lora_embedding_A" in name:
                p.normal_(0, 0.3)
            elif "lora_magnitude_vector" in name:
                p.mul_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    base = make_random_llama(root / "base")
    adapters = {
        name: _adapter(base, root / name, r, t, seed=i + 1, **kw)
        for i, (name, (r, t, kw)) in enumerate(ADAPTERS.items())
    }
    return base, adapters


@pytest.fixture(scope="module")
def references(checkpoint):
    """PEFT's greedy tokens and logprobs per (row's adapter, prompt), unmerged and merged."""
    base, adapters = checkpoint
    rows = [None, *adapters]
    prompts = _prompts(len(rows))
    out = {}
    for adapter, prompt in zip(rows, prompts):
        path = adapters.get(adapter)
        out[(adapter, False)] = peft_greedy(base, path, prompt, MAX_TOKENS)
        if adapter is not None and adapter not in NO_MERGE:
            out[(adapter, True)] = peft_greedy(base, path, prompt, MAX_TOKENS, merged=True)
    return rows, prompts, out


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(4, 12))] for _ in range(n)]


@pytest.mark.parametrize(
    "backend, chunk", [("torch", None), ("cpu", None), ("torch", 8)], ids=["torch", "cpu", "torch_chunked_prefill"]
)
def test_mixed_batch_matches_peft_unmerged_and_merged(checkpoint, references, backend, chunk):
    """Every row of one mixed batch (prompts split into chunks of 8 tokens in the last case, so
    prefill and decode rows of different variants share steps) equals PEFT's alone."""
    base, adapters = checkpoint
    rows, prompts, ref = references
    extra = dict(max_num_batched_tokens=chunk, max_num_seqs=8) if chunk else {}
    engine = Engine(EngineConfig(model=str(base), kernel_backend=backend, max_loras=8, block_size=4, **extra))
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    outs = engine.generate_batch(
        list(zip(prompts, rows)), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)
    )
    for adapter, out in zip(rows, outs):
        got = [lp.logprob for lp in out.logprobs]
        for merged in (False, True):
            if (adapter, merged) not in ref:
                continue
            tokens, lps = ref[(adapter, merged)]
            assert out.token_ids == tokens, (adapter, merged)
            assert got == pytest.approx(lps, abs=TOL), (adapter, merged)


def test_decode_rows_alone_equal_the_batch(checkpoint, references):
    """Each variant row alone gives the batch's tokens (the per-row tables, not the batch, decide)."""
    base, adapters = checkpoint
    rows, prompts, ref = references
    engine = Engine(EngineConfig(model=str(base), kernel_backend="torch", max_loras=8))
    for name in ("dora", "embedding"):
        engine.add_adapter(name, adapters[name])
        i = rows.index(name)
        out = engine.generate_batch([(prompts[i], name)], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        assert out[0].token_ids == ref[(name, False)][0]


def _rerun_capture(step):
    """CUDA-graph capture's stand-in on a CPU: replay reruns the captured step over the static
    buffers into the output captured the first time (tests/kernels/test_kernels_graph_safety.py)."""
    out = step()

    def replay() -> None:
        with torch.inference_mode():
            out.copy_(step())

    return replay, out


def test_triton_eager_and_replayed_decode_steps_match_peft_across_slot_swaps(checkpoint, references):
    """On the Triton kernels (interpreted here): eager steps give PEFT's tokens, and the captured
    decode step (its placeholder segment: variants always applied, read through the per-slot
    tables) gives eager's, before and after the adapters move to other slots; the tables are the
    same tensors throughout (a graph reads them)."""
    import asyncio

    base, adapters = checkpoint
    rows, prompts, ref = references
    pytest.importorskip("triton")  # the graph path's kernels (interpreted here): BGMV reads token_slot
    names = ["dora", "embedding", "lora_bias"]
    batch = [(prompts[rows.index(n)], n) for n in names] + [(prompts[0], None)]
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=0, ignore_eos=True)
    eager, replayed = (
        Engine(EngineConfig(model=str(base), kernel_backend="triton", max_loras=4, max_num_seqs=4, enforce_eager=True))
        for _ in range(2)
    )
    for engine in (eager, replayed):
        for name in names:
            engine.add_adapter(name, adapters[name])
    replayed.debug.runner.capture_decode_graphs(4, capture=_rerun_capture)
    tables = replayed.debug.tables.variants
    pointers = [t.data_ptr() for t in (tables.vector_page, tables.emb_offset, tables.emb_rank, tables.emb_scale)]

    async def swap(engine) -> None:
        for name in names:
            await engine.admin.unload(name)
        for name in reversed(names):
            await engine.admin.load(name)

    for round_ in range(2):
        want = eager.generate_batch(batch, params)
        got = replayed.generate_batch(batch, params)
        for (_, name), w in zip(batch, want):
            assert w.token_ids == ref[(name, False)][0][:3], name
            assert [x.logprob for x in w.logprobs] == pytest.approx(ref[(name, False)][1][:3], abs=TOL), name
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids, round_
            assert [x.logprob for x in g.logprobs] == pytest.approx([x.logprob for x in w.logprobs], abs=TOL)
        asyncio.run(swap(replayed))
    assert pointers == [
        t.data_ptr() for t in (tables.vector_page, tables.emb_offset, tables.emb_rank, tables.emb_scale)
    ]


def test_qwen2_qkv_bias_with_dora_lora_bias_and_embedding(tmp_path):
    """Qwen2's q/k/v have biases: DoRA scales only the bias-free part (y = g * (Wx + lora) + b),
    lora_bias adds to it, and PEFT can merge both there. Its embeddings are tied, where PEFT's
    merge_and_unload of an embedding LoRA would move lm_head too: that row is checked unmerged."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=261, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=257)  # fmt: skip
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0, 0.3)  # the q/k/v biases (the norms' weights stay 1)
    base = tmp_path / "qwen2"
    model.save_pretrained(base, safe_serialization=True)
    for f in TOKENIZER_FILES:
        (base / f).write_bytes((TINY_BASE_DIR / f).read_bytes())
    adapters = {
        "dora": _adapter(base, tmp_path / "dora", 4, ["q_proj", "k_proj", "v_proj", "o_proj"], 11, use_dora=True),
        "lora_bias": _adapter(base, tmp_path / "lora_bias", 4, ["q_proj", "v_proj"], 12, lora_bias=True),
        "embedding": _adapter(base, tmp_path / "embedding", 4, ["embed_tokens", "k_proj"], 13),
    }
    rows = [*adapters, None]
    prompts = _prompts(len(rows))
    engine = Engine(EngineConfig(model=str(base), kernel_backend="cpu", max_loras=4, block_size=4))
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    outs = engine.generate_batch(
        list(zip(prompts, rows)), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)
    )
    for adapter, prompt, out in zip(rows, prompts, outs):
        path = adapters.get(adapter)
        for merged in (False, True) if adapter in ("dora", "lora_bias") else (False,):
            tokens, lps = peft_greedy(base, path, prompt, MAX_TOKENS, merged=merged)
            assert out.token_ids == tokens, (adapter, merged)
            assert [lp.logprob for lp in out.logprobs] == pytest.approx(lps, abs=TOL), (adapter, merged)
