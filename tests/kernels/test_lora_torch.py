"""The batched CPU LoRA ops equal the per-segment reference, however adapters and tokens are placed.

"Equal" within what float32 arithmetic allows in any summation order (tests/numeric_bounds.py),
against the reference computed in float64 from the same weights.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from numeric_bounds import FLOAT32, Rounding, assert_within

from lorapage.adapters.layout import AdapterLayout
from lorapage.adapters.peft_format import AdapterSpec
from lorapage.kernels import LoraIndices
from lorapage.kernels.cpu_build import cpu_kernels
from lorapage.kernels.lora_cpu import lora_expand_cpu, lora_shrink_cpu
from lorapage.kernels.lora_plan import plan_lora_batches
from lorapage.kernels.lora_ref import lora_expand_ref, lora_shrink_ref
from lorapage.kernels.lora_torch import lora_expand_torch, lora_shrink_torch
from lorapage.model.config import GROUPS, MODULES, ModelConfig
from lorapage.model.lora_tables import LoraTables

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
PLACEMENTS = ("stride", "grid_holes", "runs", "scattered")


def build(ranks: list[int], placement: str, seed: int, model: ModelConfig = MODEL):
    """A pool holding one adapter per rank (all modules): back to back, on a page grid with
    holes and slots out of page order (what evictions leave), at irregular runs, or with each
    adapter's pages scattered one by one. Its free pages hold NaN: a hole that leaked into a
    result would show."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    layouts = []
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
        layouts.append(AdapterLayout.plan(spec, model, PAGE))
    cell = max(lay.num_pages for lay in layouts)
    num_pages = 2 + 3 * len(ranks) * cell
    pool = torch.full((model.num_layers, num_pages, PAGE), float("nan"))
    tables = LoraTables(model, len(ranks), cell, torch.device("cpu"))
    free = set(range(1, num_pages))
    cursor = 1
    grid = rng.permutation(2 * len(ranks))
    for slot, layout in enumerate(layouts, start=1):
        n = layout.num_pages
        if placement == "stride":
            pages = list(range(cursor, cursor + n))
            cursor += n
        elif placement == "grid_holes":
            first = 1 + int(grid[slot - 1]) * cell
            pages = list(range(first, first + n))
        elif placement == "runs":
            cursor += int(rng.integers(0, 5))
            pages = list(range(cursor, cursor + n))
            cursor += n
        else:
            pages = sorted(rng.choice(sorted(free), size=n, replace=False).tolist())
        free -= set(pages)
        pool[:, pages] = torch.randn(model.num_layers, n, PAGE, generator=gen)
        tables.write_slot(slot, layout, pages)
    return pool, tables


def indices_for(slots: list[int], lengths: list[int]) -> tuple[LoraIndices, int]:
    """Rows in the given order, row i of ``lengths[i]`` tokens on ``slots[i]``, equal neighbours
    merged into one segment as the runner does."""
    segments, token_slot, t = [], [], 0
    for s, n in zip(slots, lengths):
        if s and segments and segments[-1][2] == s and segments[-1][1] == t:
            segments[-1] = (segments[-1][0], t + n, s)
        elif s:
            segments.append((t, t + n, s))
        token_slot += [s] * n
        t += n
    return LoraIndices(torch.tensor(token_slot, dtype=torch.int32), tuple(segments)), t


CASES = {
    # name: (ranks, slots per row, tokens per row)
    "decode_distinct": ([8] * 6, [0, 1, 2, 3, 4, 5, 6], [1] * 7),
    "decode_skewed": ([8] * 6, [0, 1, 1, 1, 2, 3, 3, 4, 5, 6], [1] * 10),
    "uniform_prefill": ([8] * 6, [0, 3, 1, 2, 6, 4, 5], [3] * 7),
    "mixed_step": ([8] * 6, [2, 0, 5, 1, 0, 2, 6, 3, 4], [1, 1, 1, 1, 20, 19, 2, 5, 40]),
    "mixed_ranks": ([4, 8, 16, 8, 1, 8], [0, 1, 2, 3, 4, 5, 6, 2, 5], [1, 1, 1, 1, 1, 1, 1, 7, 30]),
    # Short segments of one adapter, apart, adding up past the longest length class (slot 1: 8 tokens).
    "one_adapter_apart": ([8] * 3, [1, 2, 1, 2, 1, 3, 1], [1, 1, 2, 1, 3, 1, 2]),
    # Two length classes interleaved: neither class's tokens are one range of rows.
    "interleaved_classes": ([8] * 4, [1, 2, 3, 4], [1, 3, 1, 3]),
}


REF_OPS = (lora_shrink_ref, lora_expand_ref)
OPS = {"torch": (lora_shrink_torch, lora_expand_torch), "cpu": (lora_shrink_cpu, lora_expand_cpu)}


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("planned", [True, False], ids=["step_plan", "per_op_plan"])
@pytest.mark.parametrize("ops", sorted(OPS))
def test_batched_ops_match_reference(placement, case, planned, ops):
    if ops == "cpu" and cpu_kernels() is None:
        pytest.skip("the C kernels did not build here")
    ranks, slots, lengths = CASES[case]
    pool, tables, idx, checks = step_references(MODEL, ranks, placement, len(ranks) + len(slots), slots, lengths)
    if planned:
        layout = (tables.a_offset, tables.a_rows, tables.b_offset, tables.rank, tables.h_start)
        plan = idx.with_cells if ops == "cpu" else idx.with_batches
        idx = plan(tables.page_table, layout, pool[0])
    for layer, g, x, want, bound in checks:
        got = group_output(OPS[ops], MODEL, pool, tables, idx, x, layer, g)
        assert_within(got, want, bound, f"layer {layer}, group {g}")


def step_references(model, ranks, placement, seed, slots, lengths, pages=torch.float32, x_seed=1):
    """One step's pool (:func:`build`, in ``pages``), tables and indices (:func:`indices_for`), and
    for each layer and group its token rows x with :func:`group_reference`'s float64 output and
    bound: ``(pool, tables, idx, ((layer, g, x, want, bound), ...))``, made once per session and
    shared by every op, plan and kernel variant tested on that step (read, never written)."""
    return _step_references(model, tuple(ranks), placement, seed, tuple(slots), tuple(lengths), pages, x_seed)


@functools.cache
def _step_references(model, ranks, placement, seed, slots, lengths, pages, x_seed):
    pool, tables = build(list(ranks), placement, seed=seed, model=model)
    pool = pool.to(pages)
    idx, t = indices_for(list(slots), list(lengths))
    dims = model.module_dims()
    gen = torch.Generator().manual_seed(x_seed)
    checks, exact = [], pool.double()
    for layer in range(model.num_layers):
        for g, group in enumerate(GROUPS):
            x = torch.randn(t, dims[group[0]][0], generator=gen)
            checks.append((layer, g, x, *group_reference(model, exact, tables, idx, x, layer, g)))
    return pool, tables, idx, tuple(checks)


def _group_tables(model, tables, layer, g) -> tuple[tuple, tuple, tuple[int, ...]]:
    """Group ``g``'s lookup tables in ``layer`` as the model passes them: the shrink's (a_offset,
    a_rows), the expand's (b_offset, rank, h_start, scale), and where each module's columns start."""
    dims = model.module_dims()
    group = GROUPS[g]
    m0 = sum(len(earlier) for earlier in GROUPS[:g])
    widths = [dims[m][1] for m in group]
    starts = tuple(int(v) for v in np.cumsum([0] + widths[:-1]))
    tabs = (tables.b_offset, tables.rank, tables.h_start, tables.scale)
    expand = tuple(t[layer, :, m0 : m0 + len(group)] for t in tabs)
    return (tables.a_offset[layer, :, g], tables.a_rows[layer, :, g]), expand, starts


def _shrink_expand(ops, model, pool, tables, idx, x, layer, g, y0: float, scale=lambda s: s, h=None):
    """``y0 + `` group ``g``'s LoRA delta for the token rows ``x`` through ``ops`` (shrink, expand),
    in ``x``'s dtype, with the expand's scales through ``scale``; ``h``: the expand's input
    instead of the shrink's output. Returns (y, h)."""
    (a_offset, a_rows), (b_offset, rank, h_start, scales), starts = _group_tables(model, tables, layer, g)
    shrink, expand = ops
    width = sum(model.module_dims()[m][1] for m in GROUPS[g])
    slab, pt = pool[layer], tables.page_table
    if h is None:
        h = torch.zeros(x.shape[0], 3 * 24, dtype=x.dtype)  # room for 3 modules of the highest rank the tests use
        shrink(h, x, slab, pt, idx, a_offset, a_rows)
    y = torch.full((x.shape[0], width), y0, dtype=x.dtype)
    expand(y, h, slab, pt, idx, b_offset, rank, h_start, scale(scales), starts)
    return y, h


def group_output(ops, model, pool, tables, idx, x, layer, g):
    """``ones + `` group ``g``'s LoRA delta for the token rows ``x``, through ``ops`` (shrink, expand)."""
    return _shrink_expand(ops, model, pool, tables, idx, x, layer, g, 1.0)[0]


def group_reference(model, pool, tables, idx, x, layer, g, rounding: Rounding = FLOAT32):
    """:func:`group_output` in float64 from the same weights (bfloat16 pages widen exactly), and
    the bound on how far any kernel computing it with ``rounding`` may be from it
    (tests/numeric_bounds.py): its sums S, T and P are the reference ops over absolute values."""
    exact = pool.double()  # a no-op for a caller that widened its pool once
    absolute = exact.abs()
    want, h = _shrink_expand(REF_OPS, model, exact, tables, idx, x.double(), layer, g, 1.0)
    # P: S = |x| |A|, expanded by |s B| onto 0; |y0| + T: |h| expanded by |s B| onto |y0| = 1.
    p, _ = _shrink_expand(REF_OPS, model, absolute, tables, idx, x.double().abs(), layer, g, 0.0, torch.abs)
    t, _ = _shrink_expand(REF_OPS, model, absolute, tables, idx, x.double(), layer, g, 1.0, torch.abs, h.abs())
    rank = int(_group_tables(model, tables, layer, g)[1][1].max())
    return want, rounding.lora(t, p, x.shape[1], rank)


def _plan(placement: str, slots: list[int], lengths: list[int]):
    pool, tables = build([8] * 6, placement, seed=3)
    idx, _ = indices_for(slots, lengths)
    layout = (tables.a_offset, tables.a_rows, tables.b_offset, tables.rank, tables.h_start)
    return idx.with_batches(tables.page_table, layout, pool[0]).batches


def test_back_to_back_decode_is_one_batch_of_views():
    (batch,) = _plan("stride", [0, 1, 2, 3, 4, 5, 6], [1] * 7)
    assert batch.cells == 6 and batch.pages is None and batch.gather is None  # no copy of weights or rows


def test_holes_on_the_page_grid_keep_weights_in_place():
    batches = _plan("grid_holes", [0, 1, 2, 3, 4, 5, 6], [1] * 7)
    assert all(b.pages is None for b in batches)
    assert sum(int((b.slots != 0).sum()) for b in batches) == 6
    assert len(batches) < 6  # holes bridged rather than one batch per adapter


def test_scattered_pages_are_copied_and_long_segments_run_alone():
    batches = _plan("scattered", [1, 2, 3, 1], [1, 1, 1, 40])
    lengths = sorted((b.cells, b.length) for b in batches)
    assert lengths == [(1, 40), (3, 1)]
    assert all(b.pages is not None for b in batches)


def test_gathered_rows_go_back_as_one_range_or_token_by_token():
    # Decode rows out of page order: gathered, but their tokens are one range (a slice write).
    batches = _plan("grid_holes", [0, 1, 2, 3, 4, 5, 6], [1] * 7)
    assert all(b.gather is not None and b.span == slice(1, 7) and b.tokens is None for b in batches)
    # Length classes interleaved: each class's tokens are apart (an indexed write).
    batches = _plan("stride", [1, 2, 3, 4], [1, 3, 1, 3])
    assert [b.tokens.tolist() for b in batches if b.tokens is not None] == [[0, 4], [1, 2, 3, 5, 6, 7]]


def test_slot_zero_rows_are_skipped():
    pool, tables = build([8] * 2, "stride", seed=0)
    idx, _ = indices_for([0, 0], [1, 3])
    assert plan_lora_batches(idx.segments, tables.page_table, [tables.rank[0].numpy()], pool[0]) == ()
