"""The CPU path's LoRA update of one decode step, over float32 and bfloat16 pages (`--lora-dtype`).

The replay bench model's shape (12 layers, hidden 768, intermediate 2048), rank-16 all-module
adapters resident back to back in a unified pool, one decode row per sequence. Every figure is
the C kernels' shrink and expand for every group of every layer, one thread, best of a few
trials, side by side in one run:

* 32 rows on 5 distinct adapters (the S-LoRA headline's 5-adapter case) and on 24 (its 2,000
  case: ~24 distinct adapters a step);
* each over float32 pages and over bfloat16 pages, with the bytes the step's adapters hold and
  what that is per second.

    .venv/bin/python bench/bench_lora_cpu_pages.py

Prints a table, then, as its last line, one JSON object with the figures.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch
from harness import machine_info, machine_line, print_json, table
from workloads import SHAPE

from lorapage.adapters.layout import AdapterLayout
from lorapage.adapters.peft_format import AdapterSpec
from lorapage.kernels.cpu_build import cpu_kernels
from lorapage.kernels.lora_cpu import lora_expand_cpu, lora_shrink_cpu
from lorapage.kernels.lora_ref import LoraIndices
from lorapage.memory.pool import adapter_page_size
from lorapage.model.config import GROUPS, MODULES, ModelConfig
from lorapage.model.llama import GROUP_MODULES
from lorapage.model.lora_tables import LoraTables
from lorapage.tiny import TINY_BASE_DIR

ROWS, RANK, TRIALS = 32, 16, 15
# The replay bench's model (bench_replay.SHAPE), which the S-LoRA headline serves.
MODEL = dataclasses.replace(
    ModelConfig.from_dir(TINY_BASE_DIR),
    hidden_size=SHAPE["hidden"],
    intermediate_size=SHAPE["intermediate"],
    num_layers=SHAPE["layers"],
    num_heads=SHAPE["heads"],
    num_kv_heads=SHAPE["kv_heads"],
    head_dim=SHAPE["hidden"] // SHAPE["heads"],
)
PAGE = 2 * 16 * MODEL.kv_size  # the engine's page at block size 16, in float32 elements


def step_ms(pages: torch.dtype, distinct: int) -> tuple[float, int]:
    """Best milliseconds of one step's LoRA update, and the bytes its adapters hold."""
    per_page = adapter_page_size(PAGE, torch.float32, pages)
    spec = AdapterSpec(
        path=None,
        weights_file=None,
        size_bytes=0,
        target_modules=MODULES,
        max_rank=RANK,
        ranks={(layer, m): RANK for layer in range(MODEL.num_layers) for m in MODULES},
        scales={(layer, m): 2.0 for layer in range(MODEL.num_layers) for m in MODULES},
    )
    layout = AdapterLayout.plan(spec, MODEL, per_page)
    n = layout.num_pages
    pool = torch.randn(MODEL.num_layers, 1 + distinct * n, per_page).to(pages) * 0.02
    tables = LoraTables(MODEL, distinct, n, torch.device("cpu"))
    for slot in range(1, distinct + 1):
        tables.write_slot(slot, layout, list(range(1 + (slot - 1) * n, 1 + slot * n)))
    slots = sorted(1 + i % distinct for i in range(ROWS))
    segments = tuple((i, i + slots.count(s), s) for s, i in {s: slots.index(s) for s in slots}.items())
    indices = LoraIndices(torch.tensor(slots, dtype=torch.int32), segments)
    planned = indices.with_cells(
        tables.page_table, (tables.a_offset, tables.a_rows, tables.b_offset, tables.rank, tables.h_start), pool[0]
    )
    dims = MODEL.module_dims()
    h = torch.zeros(ROWS, 3 * RANK)
    xs = [torch.randn(ROWS, dims[group[0]][0]) for group in GROUPS]
    ys = [torch.zeros(ROWS, sum(dims[m][1] for m in group)) for group in GROUPS]
    starts = [tuple([0, *[sum(dims[m][1] for m in group[: i + 1]) for i in range(len(group) - 1)]]) for group in GROUPS]

    def step() -> None:
        for layer in range(MODEL.num_layers):
            slab, t = pool[layer], tables
            for g, (m0, m1) in enumerate(GROUP_MODULES):
                lora_shrink_cpu(h, xs[g], slab, t.page_table, planned, t.a_offset[layer, :, g], t.a_rows[layer, :, g])
                lora_expand_cpu(
                    ys[g],
                    h,
                    slab,
                    t.page_table,
                    planned,
                    t.b_offset[layer, :, m0:m1],
                    t.rank[layer, :, m0:m1],
                    t.h_start[layer, :, m0:m1],
                    t.scale[layer, :, m0:m1],
                    starts[g],
                )

    for _ in range(3):
        step()
    best = float("inf")
    for _ in range(TRIALS):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best * 1e3, distinct * MODEL.num_layers * layout.numel * pages.itemsize


def main() -> dict:
    if cpu_kernels() is None:
        sys.exit("the C kernels did not build here")
    torch.set_num_threads(1)
    rows = []
    for distinct in (5, 24, 32):
        for pages in (torch.float32, torch.bfloat16):
            ms, nbytes = step_ms(pages, distinct)
            rows.append({"distinct": distinct, "pages": str(pages).removeprefix("torch."), "ms": ms, "bytes": nbytes})
    print(machine_line())
    print(f"LoRA update of one decode step, {ROWS} rows, rank {RANK} on all modules, C kernels, 1 thread")
    cells = [
        [r["distinct"], r["pages"], f"{r['ms']:.1f}", f"{r['bytes'] / 1e6:.0f}", f"{r['bytes'] / r['ms'] / 1e6:.1f}"]
        for r in rows
    ]
    print(table(["distinct adapters", "pages", "ms", "MB held", "GB/s"], cells, "rlrrr"))
    by = {(r["distinct"], r["pages"]): r["ms"] for r in rows}
    figures = {
        "bench": "lora_cpu_pages",
        "rows": rows,
        "bf16_over_f32_5": by[(5, "bfloat16")] / by[(5, "float32")],
        "bf16_over_f32_24": by[(24, "bfloat16")] / by[(24, "float32")],
        "extra_ms_24_over_5_f32": by[(24, "float32")] - by[(5, "float32")],
        "extra_ms_24_over_5_bf16": by[(24, "bfloat16")] - by[(5, "bfloat16")],
        **machine_info(),
    }
    print(
        f"bfloat16 / float32 pages: {figures['bf16_over_f32_5']:.2f} at 5 adapters, "
        f"{figures['bf16_over_f32_24']:.2f} at 24; the 19 more adapters cost "
        f"+{figures['extra_ms_24_over_5_f32']:.1f} ms (float32) and +{figures['extra_ms_24_over_5_bf16']:.1f} ms (bfloat16)"
    )
    return figures


if __name__ == "__main__":
    print_json(main())
