"""The batched CPU LoRA ops equal the per-segment reference, on every path they take."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lorapage.adapters.layout import AdapterLayout, LoraTables
from lorapage.adapters.peft_format import AdapterSpec
from lorapage.kernels import LoraIndices
from lorapage.kernels.lora_ref import lora_expand_ref, lora_shrink_ref
from lorapage.kernels.lora_torch import lora_expand_torch, lora_shrink_torch
from lorapage.model.config import GROUPS, MODULES, ModelConfig

MODEL = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=50,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    rope_scaling=None,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    attention_bias=False,
    bos_token_id=None,
    eos_token_ids=(),
)
PAGE = 64


def build(ranks: list[int], placement: str, seed: int):
    """A pool holding one adapter per rank (all modules), placed at a constant page stride,
    at irregular runs, or scattered page by page."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    num_pages = 600
    pool = torch.randn(MODEL.num_layers, num_pages, PAGE, generator=gen)
    tables = LoraTables(MODEL, len(ranks), 200, torch.device("cpu"))
    free = list(range(1, num_pages))
    cursor = 1
    for slot, r in enumerate(ranks, start=1):
        spec = AdapterSpec(
            path=None,
            weights_file=None,
            size_bytes=0,
            target_modules=MODULES,
            max_rank=r,
            ranks={(layer, m): r for layer in range(2) for m in MODULES},
            scales={(layer, m): 0.5 + slot for layer in range(2) for m in MODULES},
        )
        layout = AdapterLayout.plan(spec, MODEL, PAGE)
        n = layout.num_pages
        if placement == "stride":
            pages = list(range(cursor, cursor + n))
            cursor += n
        elif placement == "runs":
            cursor += int(rng.integers(0, 5))
            pages = list(range(cursor, cursor + n))
            cursor += n
        else:
            pages = sorted(rng.choice(free, size=n, replace=False).tolist())
            free = [p for p in free if p not in pages]
        tables.write_slot(slot, layout, pages)
    return pool, tables


@pytest.mark.parametrize("placement", ["stride", "runs", "scattered"])
@pytest.mark.parametrize(
    "ranks, seq_len, slots, batched",
    [
        ([8] * 6, 1, [0, 1, 2, 3, 4, 5, 6], True),  # decode, one layout: one bmm per group
        ([8] * 6, 3, [0, 3, 1, 2, 6, 4, 5], True),
        ([8] * 6, 1, [0, 1, 2, 2, 3, 4, 5, 6], False),  # one slot twice: segments differ in length
        ([4, 8, 16, 8, 1, 8], 1, [0, 1, 2, 3, 4, 5, 6], False),  # mixed ranks: per-segment reference
    ],
)
def test_batched_ops_match_reference(placement, ranks, seq_len, slots, batched, monkeypatch):
    import lorapage.kernels.lora_torch as fast

    fallbacks = []
    monkeypatch.setattr(fast, "lora_shrink_ref", lambda *a: fallbacks.append(1) or lora_shrink_ref(*a))
    pool, tables = build(ranks, placement, seed=len(ranks) + seq_len)
    segments, token_slot, t = [], [], 0
    for s in slots:
        if s and segments and segments[-1][2] == s:
            segments[-1] = (segments[-1][0], t + seq_len, s)
        elif s:
            segments.append((t, t + seq_len, s))
        token_slot += [s] * seq_len
        t += seq_len
    idx = LoraIndices(torch.tensor(token_slot, dtype=torch.int32), tuple(segments))
    dims = MODEL.module_dims()
    for layer in range(2):
        slab = pool[layer]
        m0 = 0
        for g, group in enumerate(GROUPS):
            m1 = m0 + len(group)
            d_in = dims[group[0]][0]
            widths = [dims[m][1] for m in group]
            starts = tuple(int(x) for x in np.cumsum([0] + widths[:-1]))
            x = torch.randn(t, d_in)
            outs = []
            for shrink, expand in ((lora_shrink_ref, lora_expand_ref), (lora_shrink_torch, lora_expand_torch)):
                h = torch.zeros(t, 3 * 16)
                y = torch.ones(t, sum(widths))
                shrink(h, x, slab, tables.page_table, idx, tables.a_offset[layer, :, g], tables.a_rows[layer, :, g])
                expand(
                    y,
                    h,
                    slab,
                    tables.page_table,
                    idx,
                    tables.b_offset[layer, :, m0:m1],
                    tables.rank[layer, :, m0:m1],
                    tables.h_start[layer, :, m0:m1],
                    tables.scale[layer, :, m0:m1],
                    starts,
                )
                outs.append(y)
            torch.testing.assert_close(
                outs[1], outs[0], rtol=1e-4, atol=1e-4
            )  # scale applied before vs after the product
            m0 = m1
    assert bool(fallbacks) is not batched
