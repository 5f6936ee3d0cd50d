"""int8 adapter pages (--lora-dtype int8, kernels/lora_int8.py): the C kernels, the batched PyTorch
ops and the reference over int8 pages with per-rank-row scales.

Each adapter's float32 A and B are packed twice by the production layout: quantized into an int8
pool, and, as what those pages hold (each weight times its row's scale, exact in float64), into a
float64 pool laid out without scales. Over the int8 pool every op must equal the float64 ops over
the other within float32's any-order bound (tests/numeric_bounds.py), with the roundings int8
adds: the shrink's scale (one more rounding of each sum: d + 1 terms' worth) and the expand's
(``s * b_scale * h``, then the product: r + 1). Against the unquantized weights, what per-row
rounding proves is added: each weight is within half its row's step of its int8 value.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from numeric_bounds import FLOAT32, assert_within, violations
from test_lora_cpu import MODELS, STEPS
from test_lora_torch import MODEL, REF_OPS, _group_tables, _shrink_expand, group_output, indices_for

from lorapage.adapters.layout import AdapterLayout
from lorapage.adapters.peft_format import AdapterSpec
from lorapage.kernels.cpu_build import cpu_kernels
from lorapage.kernels.lora_cpu import lora_expand_cpu, lora_group_cpu, lora_shrink_cpu
from lorapage.kernels.lora_int8 import quantize_pair
from lorapage.kernels.lora_torch import lora_expand_torch, lora_shrink_torch
from lorapage.model.config import GROUPS, MODULES
from lorapage.model.lora_tables import LoraTables

PAGE = 64  # float32 elements: an int8 page holds 256
OPS = {"cpu": (lora_shrink_cpu, lora_expand_cpu), "torch": (lora_shrink_torch, lora_expand_torch)}


@dataclasses.dataclass(frozen=True)
class Pools:
    int8: torch.Tensor  # [layers, pages, 4 * PAGE] int8
    tables8: LoraTables
    exact: torch.Tensor  # [layers, pages, PAGE] float64: the dequantized weights, no scales
    tables: LoraTables
    original: torch.Tensor  # the same layout as ``exact``, the unquantized float32 weights
    steps: dict  # (layer, module) -> (a_scale, b_scale) of each slot, for the rounding bound


def _place(n: int, slot: int, placement: str, rng: np.random.Generator, free: set[int], cell: int) -> list[int]:
    if placement == "grid_holes":
        first = 1 + (2 * slot + 1) * cell
        return list(range(first, first + n))
    return sorted(rng.choice(sorted(free), size=n, replace=False).tolist())


@functools.cache
def pools(model_name: str, ranks: tuple[int, ...], placement: str, seed: int) -> Pools:
    """One adapter per rank, all modules, its weights drawn at random, in both pools."""
    model = MODELS.get(model_name, MODEL)
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    dims = model.module_dims()
    adapters = []
    for slot, r in enumerate(ranks, start=1):
        ranks_of = {(layer, m): r for layer in range(model.num_layers) for m in MODULES}
        spec = AdapterSpec(
            path=None, weights_file=None, size_bytes=0, target_modules=MODULES, max_rank=r, ranks=ranks_of,
            scales={k: 0.5 + slot for k in ranks_of},
        )  # fmt: skip
        # Rows of very different sizes: each row's scale is its own.
        tensors = {
            k: (
                torch.randn(r, dims[k[1]][0], generator=gen) * torch.rand(r, 1, generator=gen) * 2,
                torch.randn(dims[k[1]][1], r, generator=gen) * torch.rand(1, r, generator=gen) * 2,
            )
            for k in ranks_of
        }
        adapters.append((spec, tensors))
    plain = [AdapterLayout.plan(spec, model, PAGE) for spec, _ in adapters]
    quant = [AdapterLayout.plan(spec, model, 4 * PAGE, quantized=True) for spec, _ in adapters]
    cell = max(lay.num_pages for lay in plain)
    num_pages = 2 + 3 * len(ranks) * cell
    # Free pages: NaN in the float pools; in the int8 one, bytes that read as huge scales.
    exact = torch.full((model.num_layers, num_pages, PAGE), float("nan"), dtype=torch.float64)
    original = exact.clone()
    int8 = torch.full((model.num_layers, num_pages, 4 * PAGE), 0x7F, dtype=torch.int8)
    tables, tables8 = (LoraTables(model, len(ranks), cell, torch.device("cpu")) for _ in range(2))
    free = set(range(1, num_pages))
    steps = {}
    for slot, ((_, tensors), lay, q) in enumerate(zip(adapters, plain, quant), start=1):
        pages = _place(lay.num_pages, slot, placement, rng, free, cell)
        pages8 = _place(q.num_pages, slot, placement, rng, free - set(pages), cell)
        free -= set(pages) | set(pages8)
        rounded = {k: _exactly_dequantized(a, b) for k, (a, b) in tensors.items()}
        exact[:, pages] = lay.pack(rounded, PAGE).view(model.num_layers, -1, PAGE)
        original[:, pages] = lay.pack({k: (a.double(), b.double()) for k, (a, b) in tensors.items()}, PAGE).view(
            model.num_layers, -1, PAGE
        )
        int8[:, pages8] = q.pack(tensors, 4 * PAGE).view(model.num_layers, -1, 4 * PAGE)
        tables.write_slot(slot, lay, pages)
        tables8.write_slot(slot, q, pages8)
        steps[slot] = {k: quantize_pair(a, b)[1::2] for k, (a, b) in tensors.items()}
    return Pools(int8, tables8, exact, tables, original, steps)


def _exactly_dequantized(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What int8 pages hold of A and B, in float64: each value times its scale, exactly."""
    qa, sa, qbt, sb = quantize_pair(a, b)
    return qa.double() * sa.double()[:, None], qbt.double().t() * sb.double()[None, :]


def _int8_bound(model, p: Pools, idx, x, layer, g):
    """The float64 output over the dequantized weights, and the bound of a float32 kernel over int8
    pages: :func:`group_reference`'s, with a rounding more per shrink sum and per expand term."""
    absolute = p.exact.abs()
    xd = x.double()
    want, h = _shrink_expand(REF_OPS, model, p.exact, p.tables, idx, xd, layer, g, 1.0)
    pp, _ = _shrink_expand(REF_OPS, model, absolute, p.tables, idx, xd.abs(), layer, g, 0.0, torch.abs)
    t, _ = _shrink_expand(REF_OPS, model, absolute, p.tables, idx, xd, layer, g, 1.0, torch.abs, h.abs())
    rank = int(_group_tables(model, p.tables, layer, g)[1][1].max())
    return want, h, FLOAT32.lora(t, pp, x.shape[1] + 1, rank + 1)


def _case(model_name: str, step: str, placement: str):
    ranks, slots, lengths = STEPS[step]
    p = pools(model_name, tuple(ranks), placement, seed=len(slots))
    idx, t = indices_for(slots, lengths)
    return MODELS[model_name], p, idx, t


@functools.cache
def _checks(model_name: str, step: str, placement: str) -> tuple:
    """Per layer and group: x, the float64 output over the dequantized weights and the bound
    (made once, shared by the ops); and the reference over the int8 pages in float64 matches it."""
    model, p, idx, t = _case(model_name, step, placement)
    gen = torch.Generator().manual_seed(7)
    out = []
    for layer in range(model.num_layers):
        for g, group in enumerate(GROUPS):
            x = torch.randn(t, model.module_dims()[group[0]][0], generator=gen)
            want, _, bound = _int8_bound(model, p, idx, x, layer, g)
            ref = group_output(REF_OPS, model, p.int8, p.tables8, idx, x.double(), layer, g)
            assert_within(ref, want, bound * 1e-6, f"reference, layer {layer}, group {g}")  # float64 throughout
            out.append((layer, g, x, want, bound))
    return tuple(out)


@pytest.mark.parametrize("ops", sorted(OPS))
@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize(
    ("model_name", "placement"), [("wide", "grid_holes"), ("wide", "scattered"), ("odd_widths", "scattered")]
)
def test_ops_over_int8_pages_match_the_dequantized_weights(ops, model_name, step, placement):
    """Decode stripes, cells widened once, long segments on the PyTorch ops, scattered pages,
    rows of odd widths (the scalar tails): every op within the bound, planned per step as the
    runner plans it, and the fused group op bit for bit the pair."""
    if ops == "cpu" and cpu_kernels() is None:
        pytest.skip("the C kernels did not build here")
    model, p, idx, t = _case(model_name, step, placement)
    layout = (p.tables8.a_offset, p.tables8.a_rows, p.tables8.b_offset, p.tables8.rank, p.tables8.h_start)
    plan = idx.with_cells if ops == "cpu" else idx.with_batches
    planned = plan(p.tables8.page_table, layout, p.int8[0])
    for layer, g, x, want, bound in _checks(model_name, step, placement):
        got = group_output(OPS[ops], model, p.int8, p.tables8, planned, x, layer, g)
        assert_within(got, want, bound, f"{ops}, layer {layer}, group {g}")
        if ops == "cpu":
            (ao, ar), (bo, rk, hs, sc), starts = _group_tables(model, p.tables8, layer, g)
            h = torch.zeros(t, 3 * 24)
            y = torch.ones(t, got.shape[1])
            lora_group_cpu(y, h, x, p.int8[layer], p.tables8.page_table, planned, ao, ar, bo, rk, hs, sc, starts)
            assert torch.equal(y, got)


def test_per_row_rounding_bounds_the_distance_to_the_float32_weights():
    """Against the unquantized weights: the float32 bound over the dequantized ones, plus what
    per-row rounding proves. With A' = A + dA, B' = B + dB, |dA_ki| <= a_k / 2, |dB_jk| <= b_k / 2
    (a_k, b_k the rows' scales, their int8 steps: max |row| / 127):
        |s B' A' x - s B A x|_j <= |s| sum_k (b_k / 2) |A' x|_k + |s| sum_k |B_jk| (a_k / 2) sum_i |x_i|.
    A worst case (every rounding the same sign), so loose; needed: int8 moves outputs past the
    float32 bound alone."""
    if cpu_kernels() is None:
        pytest.skip("the C kernels did not build here")
    model, p, idx, t = _case("wide", "decode", "grid_holes")
    planned = idx.with_cells(p.tables8.page_table, (p.tables8.a_offset, p.tables8.a_rows), p.int8[0])
    gen = torch.Generator().manual_seed(11)
    past_float32 = False
    for layer in range(model.num_layers):
        for g, group in enumerate(GROUPS):
            x = torch.randn(t, model.module_dims()[group[0]][0], generator=gen)
            _, h, bound = _int8_bound(model, p, idx, x, layer, g)
            original = group_output(REF_OPS, model, p.original, p.tables, idx, x.double(), layer, g)
            rounding = torch.zeros_like(original)
            for row, slot in enumerate(idx.token_slot.tolist()):
                col = 0
                for m in group:
                    width, i = model.module_dims()[m][1], MODULES.index(m)
                    if slot:
                        a_step, b_step = (s.double() for s in p.steps[slot][(layer, m)])  # the scales are the steps
                        hs, r = int(p.tables.h_start[layer, slot, i]), a_step.shape[0]
                        scale = abs(float(p.tables.scale[layer, slot, i]))
                        b = _b_of(p, model, layer, slot, m)
                        rounding[row, col : col + width] = scale * (
                            (b_step / 2 * h[row, hs : hs + r].abs()).sum()
                            + (b.abs() * (a_step / 2)).sum(1) * x[row].double().abs().sum()
                        )
                    col += width
            got = group_output(OPS["cpu"], model, p.int8, p.tables8, planned, x, layer, g)
            assert_within(got, original, bound + rounding, f"layer {layer}, group {g}")
            past_float32 |= bool(violations(got, original, bound).any())
    assert past_float32


def _b_of(p: Pools, model, layer: int, slot: int, m: str) -> torch.Tensor:
    """Slot ``slot``'s unquantized B of module ``m`` (float64), read back from ``original``."""
    i = MODULES.index(m)
    r, d_out = int(p.tables.rank[layer, slot, i]), model.module_dims()[m][1]
    n = int((p.tables.page_table[slot] > 0).sum())
    flat = p.original[layer, p.tables.page_table[slot, :n].long()].reshape(-1)
    b_off = int(p.tables.b_offset[layer, slot, i])
    return flat[b_off : b_off + d_out * r].view(d_out, r)
