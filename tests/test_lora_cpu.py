"""The C kernels of the CPU path (kernels/lora_cpu.c) equal the per-segment reference.

test_lora_torch.py runs them over every placement and step shape on its model; here the shapes
reach the kernels' other branches: rows whose length is not a multiple of 8 (the scalar tail),
rank 16 beside odd ranks, more A rows than one task's block, B wider than one task's block,
cells of 1 to 64 tokens beside a long segment, decode rows run as lanes in lockstep (full,
padded and too few to pad), cells of 3 or more tokens whose bfloat16 weights are widened once,
and adapters whose pages are not one run (copied into scratch). Free pages hold NaN, so a read
outside an adapter's pages would show.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_lora_torch import MODEL, REF_OPS, build, group_output, indices_for

from lorapage.kernels import lora_cpu as lora_cpu_mod
from lorapage.kernels.cpu_build import cpu_kernels
from lorapage.kernels.lora_cpu import lora_expand_cpu, lora_shrink_cpu
from lorapage.kernels.lora_plan import CELL_TOKENS
from lorapage.kernels.lora_ref import lora_shrink_ref
from lorapage.model.config import GROUPS

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C kernels did not build here")

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
    # Decode rows on 15 adapters, as lanes in lockstep: 13 rank-16 lanes (a full pack of 8, then
    # 5 padded), two lanes each of ranks 3 and 24 (packs too small to pad), three 2-token cells,
    # and a 5-token cell beside them that runs alone.
    "many_lanes": (
        [16, 3, 16, 24, 16, 16, 3, 16, 16, 16, 24, 16, 16, 16, 16],
        [*range(1, 16), 1, 5, 9, 0, 3],
        [1] * 19 + [4],
    ),
}


@pytest.mark.parametrize("pages", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("placement", ["grid_holes", "scattered"])
@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_c_kernels_match_reference(model_name, step, placement, pages):
    """float32 activations over float32 pages, and over bfloat16 pages (--lora-dtype bfloat16):
    the reference reads the same bfloat16 values and computes in float32, so the two differ only
    by the order of float32 sums."""
    model = MODELS[model_name]
    ranks, slots, lengths = STEPS[step]
    pool, tables = build(ranks, placement, seed=len(slots), model=model)
    pool = pool.to(pages)
    idx, t = indices_for(slots, lengths)
    layout = (tables.a_offset, tables.a_rows, tables.b_offset, tables.rank, tables.h_start)
    planned = idx.with_cells(tables.page_table, layout, pool[0])
    assert planned.cells is not None  # the C kernels run
    long = [s for s in idx.segments if s[1] - s[0] > CELL_TOKENS]
    assert len(planned.batches) == len(long)  # and only the long segments go to the PyTorch ops
    dims = model.module_dims()
    gen = torch.Generator().manual_seed(2)
    for layer in range(model.num_layers):
        for g, group in enumerate(GROUPS):
            x = torch.randn(t, dims[group[0]][0], generator=gen)
            want = group_output(REF_OPS, model, pool, tables, idx, x, layer, g)
            got = group_output((lora_shrink_cpu, lora_expand_cpu), model, pool, tables, planned, x, layer, g)
            # Outputs reach ~1000: a sum's order moves its last float32 bits by ~1e-4. Under
            # bfloat16 pages one 0.06 cell of "wide" lands 1.6e-4 apart (the C result the nearer
            # to the float64 one), so those get twice the room.
            atol = 1e-4 if pages is torch.float32 else 2e-4
            torch.testing.assert_close(got, want, rtol=1e-4, atol=atol)


@pytest.mark.parametrize(
    ("activations", "pages"),
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float16)],
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

    ranks, slots, lengths = STEPS["many_lanes"]
    pool, tables = build(ranks, "grid_holes", seed=3)
    idx, t = indices_for(slots, lengths)
    planned = idx.with_cells(
        tables.page_table, (tables.a_offset, tables.a_rows, tables.b_offset, tables.rank, tables.h_start), pool[0]
    )
    x = torch.randn(t, MODEL.hidden_size, generator=torch.Generator().manual_seed(4))
    outputs = []
    for chosen in (default, lib):
        monkeypatch.setattr(lora_cpu_mod, "cpu_kernels", lambda chosen=chosen: chosen)
        outputs.append(group_output((lora_shrink_cpu, lora_expand_cpu), MODEL, pool, tables, planned, x, 0, 0))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
