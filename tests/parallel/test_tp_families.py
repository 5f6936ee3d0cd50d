"""Tensor parallelism on this CPU for the families beyond Llama: Phi-3 (fused qkv_proj and
gate_up_proj, split per part on each rank; partial rotary) and Gemma 2 (four norms a layer, soft-caps,
tied embeddings that are vocabulary-parallel too), each TP=2 over gloo against TP=1 in one mixed
batch of adapters whose ranks do not divide by 2 (a fully sharded LoRA-A ends in a zero row), with
6-token steps (prompts prefill in chunks beside decode rows; prompt logprobs across chunks), and
the pages each rank holds per adapter (1/2 of TP=1's, but for rounding up to whole pages).

The logprob bound is tests/parallel/test_tp.py's argument (two summation orders of float32 sums
of ``N`` terms, carried through ``2 L`` residual blocks with a gain budget), for the longest sum
here; as there, the adapters' own effect is checked to be larger than the bound.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch
from hf_reference import TOKENIZER_FILES, make_peft_adapter
from numeric_bounds import U32, gamma

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.tiny import TINY_BASE_DIR

LAYERS, HIDDEN, INTERMEDIATE, MAX_RANK = 2, 64, 96, 8
GAIN, MAX_LOGIT = 4.0, 4.0
BOUND = 2 * 2 * gamma(INTERMEDIATE + MAX_RANK, U32) * (1 + GAIN) ** (2 * LAYERS) * MAX_LOGIT
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0)
ROWS = [([1, 2, 3, 4, 5], None), ([7, 8, 9], "a"), ([10, 11, 12, 13], "b"), ([5, 6], "a")]


def _checkpoint(path, config_class, **kwargs):
    """A random checkpoint (2-D weights at 0.08; 1-D ones near 0, Gemma's norms scale by ``1 + w``,
    Phi-3's by ``w``: made 1 + noise there) beside the tiny model's tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_class(**kwargs))
    gemma = "Gemma" in config_class.__name__
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08) if p.dim() == 2 else p.copy_((0 if gemma else 1) + 0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    for f in TOKENIZER_FILES:
        shutil.copy(TINY_BASE_DIR / f, path / f)
    return path


def _phi3(path):
    from transformers import Phi3Config

    return _checkpoint(
        path, Phi3Config, vocab_size=261, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5,
        max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=260, bos_token_id=None,
        pad_token_id=None,
    ), ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # fmt: skip


def _gemma2(path):
    from transformers import Gemma2Config

    return _checkpoint(
        path, Gemma2Config, vocab_size=261, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        query_pre_attn_scalar=16, sliding_window=4, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        max_position_embeddings=256, eos_token_id=260, bos_token_id=None, pad_token_id=None,
    ), ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # fmt: skip


@pytest.fixture(scope="module", params=["phi3", "gemma2"])
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    base, modules = {"phi3": _phi3, "gemma2": _gemma2}[request.param](root / "base")
    # ranks 5 and 3: a column-parallel group's stacked A (15 or 9 rows, 10 or 6 on Phi-3) split 2 ways
    make_peft_adapter(base, root / "a", r=5, targets=modules, seed=1)
    make_peft_adapter(base, root / "b", r=3, targets=modules[:2] + modules[-1:], seed=2)
    engines = {}
    for tp in (1, 2):  # 6-token steps: prompts prefill in chunks beside decode rows
        config = EngineConfig(
            model=str(base), tensor_parallel_size=tp, max_lora_rank=MAX_RANK, max_num_seqs=4,
            max_num_batched_tokens=6, enable_chunked_prefill=True,
        )  # fmt: skip
        engines[tp] = Engine(config)
        for name in ("a", "b"):
            engines[tp].add_adapter(name, str(root / name))
    yield engines
    for engine in engines.values():
        asyncio.run(engine.close())


def test_tp2_matches_tp1(family):
    want, got = (family[tp].generate_batch(ROWS, GREEDY) for tp in (1, 2))
    assert BOUND < 0.1
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        assert [x.logprob for x in g.logprobs] == pytest.approx([x.logprob for x in w.logprobs], abs=BOUND)
    adapted = family[2].generate_batch([(ROWS[0][0], "a")], GREEDY)[0]
    moved = abs(adapted.logprobs[0].logprob - got[0].logprobs[0].logprob)
    assert adapted.token_ids != got[0].token_ids or moved > BOUND


def test_each_rank_holds_half_of_an_adapter(family):
    """Fully sharded: a rank's pages (half as wide: its KV heads) hold half of every matrix, so an
    adapter takes as many pages per rank as on one device, up to one page of rounding and the zero
    row padding each column-parallel group's A."""
    one, two = family[1], family[2]
    assert two._sizing.page_size * 2 == one._sizing.page_size
    for name in ("a", "b"):
        whole, per_rank = one.admin.info(name).num_pages, two.admin.info(name).num_pages
        assert whole <= per_rank <= whole + 1


def test_prompt_logprobs_are_gathered_with_the_sampled_rows(family):
    """A prefill row asking for prompt logprobs beside sampling rows: rank 0 gathers every rank's
    vocabulary share of all those rows at once; the values are TP=1's."""
    asked = SamplingParams(max_tokens=2, temperature=0.0, logprobs=0, prompt_logprobs=2)
    rows = [([3, 4, 5, 6, 7], "a"), ([9, 8, 7], None)]
    want, got = (family[tp].generate_batch(rows, asked) for tp in (1, 2))
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs) > 0
        for a, b in zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:], strict=True):
            assert b.token_id == a.token_id and b.logprob == pytest.approx(a.logprob, abs=BOUND)
