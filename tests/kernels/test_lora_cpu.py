"""The C kernels of the CPU path (kernels/lora_cpu.c) equal the per-segment reference, in every
variant this CPU runs (baseline x86-64, AVX, AVX2, AVX-512; kernels/cpu_isa.py).

test_lora_torch.py runs them over every placement and step shape on its model; here the shapes
reach the kernels' other branches: rows whose length is not a multiple of 8 (the scalar tail),
rank 16 beside odd ranks, more A rows than one task's block, B wider than one task's block,
cells of 1 to 64 tokens beside a long segment, decode rows run as stripes in lockstep (full,
padded and too few to pad), cells of 5 or more tokens whose 16-bit weights are widened once,
and adapters whose pages are not one run (copied into scratch). Free pages hold NaN, so a read
outside an adapter's pages would show. "Equal": within what float32 sums in any order allow of
the float64 result (tests/numeric_bounds.py), a bound that a single wrong weight breaks.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest
import torch
from numeric_bounds import assert_within, violations
from test_lora_torch import MODEL, _group_tables, build, group_output, indices_for, step_references

from lorapage.kernels import cpu_isa, lora_cpu as lora_cpu_mod
from lorapage.kernels.cpu_build import cpu_kernels, load_variant
from lorapage.kernels.lora_cpu import lora_expand_cpu, lora_group_cpu, lora_shrink_cpu
from lorapage.kernels.lora_plan import CELL_TOKENS
from lorapage.kernels.lora_ref import lora_shrink_ref
from lorapage.model.config import GROUPS

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C kernels did not build here")

C_OPS = (lora_shrink_cpu, lora_expand_cpu)
MODELS = {
    # d_in 20 and 36: every dot product ends in the scalar tail; k/v are 10 wide.
    "odd_widths": dataclasses.replace(MODEL, hidden_size=20, intermediate_size=36, num_heads=4, head_dim=5),
    # gate/up 272 wide (two expand blocks of 256), qkv's stacked A 3 x 24 rows (five shrink blocks).
    "wide": dataclasses.replace(MODEL, hidden_size=64, intermediate_size=272, num_heads=4, head_dim=16),
}
STEPS = {
    # name: (ranks, slots per row, tokens per row)
    "decode": ([3, 16, 24, 16], [1, 0, 2, 3, 4], [1] * 5),
    "short_cells": ([3, 16, 24, 16], [2, 1, 4, 3, 2, 0], [5, 2, 13, 1, 3, 2]),
    "cell_limit_and_long": ([16, 24], [1, 2, 1], [CELL_TOKENS, CELL_TOKENS + 1, 7]),
    # Decode rows as cells of 3, 4 (rank 16: one pass over B for the cell's tokens), 3 (rank 3) and
    # 5 tokens (rank 16: 4 at once, then 1), interleaved, and a row without an adapter.
    "multi_token_cells": ([16, 16, 3, 16], [1, 2, 4, 3, 1, 2, 4, 3, 2, 4, 1, 0, 4, 2, 3, 4], [1] * 16),
    # Decode rows on 15 adapters, as stripes in lockstep: 13 rank-16 stripes (a full pack of 8, then
    # 5 padded), two stripes each of ranks 3 and 24 (packs too small to pad), three 2-token cells,
    # and a 5-token cell beside them that runs alone.
    "many_stripes": (
        [16, 3, 16, 24, 16, 16, 3, 16, 16, 16, 24, 16, 16, 16, 16],
        [*range(1, 16), 1, 5, 9, 0, 3],
        [1] * 19 + [4],
    ),
}
VARIANTS = [v.name for v in cpu_isa.variants()]


@functools.cache
def _library(name: str):
    """Variant ``name``'s kernels, or why this machine cannot run them (a skip's reason)."""
    lacks = cpu_isa.missing(next(v for v in cpu_isa.variants() if v.name == name), cpu_isa.cpu_flags())
    if lacks:
        return f"this CPU lacks {', '.join(sorted(lacks))}"
    try:
        return load_variant(name)
    except RuntimeError as e:  # a compiler that cannot target this ISA level
        return f"the compiler cannot build it: {e}"


@pytest.fixture(params=VARIANTS)
def variant(request, monkeypatch):
    """Each variant of the kernels this CPU runs, as the CPU ops' library (skipped with the reason otherwise)."""
    lib = _library(request.param)
    if isinstance(lib, str):
        pytest.skip(f"{request.param} kernels: {lib}")
    monkeypatch.setattr(lora_cpu_mod, "cpu_kernels", lambda: lib)
    return request.param


def _step(model_name: str, step: str, placement: str, pages: torch.dtype):
    """The step's pool, tables, planned indices and per-group references (made once, shared by the variants)."""
    model = MODELS[model_name]
    ranks, slots, lengths = STEPS[step]
    pool, tables, idx, checks = step_references(model, ranks, placement, len(slots), slots, lengths, pages, x_seed=2)
    layout = (tables.a_offset, tables.a_rows, tables.b_offset, tables.rank, tables.h_start)
    return model, pool, tables, idx.with_cells(tables.page_table, layout, pool[0]), checks


@pytest.mark.parametrize("pages", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("placement", ["grid_holes", "scattered"])
@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_c_kernels_match_reference(variant, model_name, step, placement, pages):
    """float32 activations over float32 pages, and over bfloat16 / float16 pages (--lora-dtype):
    the float64 reference reads the same 16-bit values, which widen exactly."""
    model, pool, tables, planned, checks = _step(model_name, step, placement, pages)
    assert planned.cells is not None  # the C kernels run
    long = [s for s in planned.segments if s[1] - s[0] > CELL_TOKENS]
    assert len(planned.batches) == len(long)  # and only the long segments go to the PyTorch ops
    for layer, g, x, want, bound in checks:
        got = group_output(C_OPS, model, pool, tables, planned, x, layer, g)
        assert_within(got, want, bound, f"{variant}, layer {layer}, group {g}")


def _group_op(model, pool, tables, idx, x, layer, g):
    """``ones + `` group ``g``'s delta through the fused op (lora_group_cpu: shrink then expand, one C call)."""
    (a_offset, a_rows), (b_offset, rank, h_start, scales), starts = _group_tables(model, tables, layer, g)
    h = torch.zeros(x.shape[0], 3 * 24)
    y = torch.ones(x.shape[0], sum(model.module_dims()[m][1] for m in GROUPS[g]))
    a, b = (a_offset, a_rows), (b_offset, rank, h_start, scales)
    lora_group_cpu(y, h, x, pool[layer], tables.page_table, idx, *a, *b, starts)
    return y


@pytest.mark.parametrize("pages", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_the_fused_group_op_is_the_two_ops(step, pages):
    """lora_group_cpu (one C call a group, as the model runs it) gives the shrink-then-expand pair's
    output bit for bit (the same loops in the same order), planned or not, and so the reference's
    within the bound; with a long segment beside the cells too (``cell_limit_and_long``)."""
    model, pool, tables, planned, checks = _step("wide", step, "scattered", pages)
    unplanned = dataclasses.replace(planned, cells=None, batches=None)
    for layer, g, x, want, bound in checks:
        pair = group_output(C_OPS, model, pool, tables, planned, x, layer, g)
        for idx in (planned, unplanned):
            fused = _group_op(model, pool, tables, idx, x, layer, g)
            assert torch.equal(fused, pair), f"layer {layer}, group {g}"
        assert_within(fused, want, bound, f"layer {layer}, group {g}")


@pytest.mark.parametrize("pages", [torch.float32, torch.bfloat16, torch.float16])
def test_variants_agree_within_the_bound(pages, monkeypatch):
    """Every variant this CPU runs gives the same step within twice the bound: each is within it of
    the float64 result, whatever order its ISA sums in."""
    built = {name: lib for name in VARIANTS if not isinstance(lib := _library(name), str)}
    if len(built) < 2:
        pytest.skip(f"this machine runs one kernel variant only ({', '.join(built)})")
    model, pool, tables, planned, checks = _step("wide", "many_stripes", "grid_holes", pages)
    for layer, g, x, _, bound in checks:
        outputs = {}
        for name, lib in built.items():
            monkeypatch.setattr(lora_cpu_mod, "cpu_kernels", lambda lib=lib: lib)
            outputs[name] = group_output(C_OPS, model, pool, tables, planned, x, layer, g)
        for a, b in itertools.combinations(outputs, 2):
            assert_within(outputs[a], outputs[b].double(), 2 * bound, f"{a} against {b}, layer {layer}, group {g}")


@pytest.mark.parametrize("wrong", ["A weight dropped", "B weight 2% off"])
def test_the_bound_catches_a_wrong_weight(wrong):
    """The check is not vacuous: the kernels over a pool with one weight wrong (one term of a
    shrink dropped, or one B weight 2% off) break the bound, and only where that weight reaches."""
    model, pool, tables, planned, checks = _step("wide", "decode", "grid_holes", torch.float32)
    layer, g, x, want, bound = checks[0]  # layer 0, q/k/v
    slot, token = 3, 3  # rank 24 on every module; its one decode row
    assert_within(group_output(C_OPS, model, pool, tables, planned, x, layer, g), want, bound)
    bad = pool.clone()
    if wrong == "A weight dropped":  # A's row 0 (q's first rank row) against x's largest input
        at = int(tables.a_offset[layer, slot, g]) + int(x[token].abs().argmax())
        reaches = (token, slice(0, model.module_dims()[GROUPS[g][0]][1]))  # every q column of that token
    else:  # B_q's row 5, its first weight
        at = int(tables.b_offset[layer, slot, 0]) + 5 * int(tables.rank[layer, slot, 0])
        reaches = (token, slice(5, 6))
    page, offset = int(tables.page_table[slot, at // pool.shape[-1]]), at % pool.shape[-1]
    bad[layer, page, offset] = 0.0 if wrong == "A weight dropped" else bad[layer, page, offset] * 1.02
    caught = violations(group_output(C_OPS, model, bad, tables, planned, x, layer, g), want, bound)
    assert caught.any(), f"{wrong}: every output stayed within the bound"
    outside = caught.clone()
    outside[reaches] = False
    assert not outside.any(), f"{wrong}: outputs it cannot reach broke the bound too"


@pytest.mark.parametrize(
    ("activations", "pages"),
    [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float16)],
)
def test_other_dtypes_run_the_pytorch_ops(activations, pages):
    pool, tables = build([8, 8], "grid_holes", seed=0)
    idx, t = indices_for([1, 2], [1, 1])
    pool16 = pool.to(pages)
    h = torch.zeros(t, 3 * 16, dtype=activations)
    x = torch.randn(t, MODEL.hidden_size, dtype=activations)
    want = h.clone()
    lora_shrink_ref(want, x, pool16[0], tables.page_table, idx, tables.a_offset[0, :, 0], tables.a_rows[0, :, 0])
    lora_shrink_cpu(h, x, pool16[0], tables.page_table, idx, tables.a_offset[0, :, 0], tables.a_rows[0, :, 0])
    torch.testing.assert_close(h, want)
    assert h.abs().sum() > 0


def test_the_build_is_cached_per_machine(tmp_path, monkeypatch):
    from lorapage.kernels import cpu_build

    monkeypatch.setenv("LORAPAGE_KERNEL_CACHE", str(tmp_path))
    first = cpu_build._load()
    built = sorted(tmp_path.glob("lora_cpu-*.so"))
    assert len(built) == 1 and not list(tmp_path.glob(".build-*"))  # renamed into place, nothing left over
    assert built[0].name.startswith(f"lora_cpu-{cpu_build.kernel_variant()}-")  # keyed by variant (flags, compiler)
    mtime = built[0].stat().st_mtime_ns
    second = cpu_build._load()
    assert built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt
    assert first._name == second._name == str(built[0])


def test_kernels_from_other_sources_build_beside_the_default(tmp_path, monkeypatch):
    """``load_from`` (bench/bench_ab.py's other revision) builds the sources of a directory into
    a library of its own, keyed by their text, and it computes what the default one does."""
    from lorapage.kernels import cpu_build

    monkeypatch.setenv("LORAPAGE_KERNEL_CACHE", str(tmp_path / "cache"))
    default = cpu_build._load()
    other = tmp_path / "rev"
    other.mkdir()
    for source in cpu_build.SOURCES:
        (other / source.name).write_text(source.read_text() + "\n/* another revision */\n")
    lib = cpu_build.load_from(other)
    assert lib._name != default._name and len(list((tmp_path / "cache").glob("lora_cpu-*.so"))) == 2
    assert cpu_build.load_from(other)._name == lib._name  # cached like the default

    ranks, slots, lengths = STEPS["many_stripes"]
    pool, tables = build(ranks, "grid_holes", seed=3)
    idx, t = indices_for(slots, lengths)
    planned = idx.with_cells(
        tables.page_table, (tables.a_offset, tables.a_rows, tables.b_offset, tables.rank, tables.h_start), pool[0]
    )
    x = torch.randn(t, MODEL.hidden_size, generator=torch.Generator().manual_seed(4))
    outputs = []
    for chosen in (default, lib):
        monkeypatch.setattr(lora_cpu_mod, "cpu_kernels", lambda chosen=chosen: chosen)
        outputs.append(group_output(C_OPS, MODEL, pool, tables, planned, x, 0, 0))
    assert torch.equal(outputs[0], outputs[1])  # the same code, built twice
