"""Triton LoRA shrink / expand against the PyTorch references.

On a machine without CUDA the Triton kernels run under Triton's interpreter on CPU tensors (see
``kernels/backend.py``), so these small cases run in the normal suite; with CUDA they run compiled.
Each case draws a fresh random pool, places adapters of mixed ranks in it (some in one run of
pages, some scattered, some at unaligned offsets), poisons the outputs, and compares each op with
the reference computed in float64 from the same inputs, within what the kernel's roundings allow
in any summation order (tests/numeric_bounds.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from numeric_bounds import FLOAT32, U32, U_BF16, Rounding, assert_within

from lorapage.kernels import LoraIndices, lora_expand_ref, lora_shrink_ref
from lorapage.kernels.triton_import import triton_available

if not triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)

from lorapage.kernels.lora_triton import lora_expand, lora_shrink  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RANKS = (1, 8, 16, 64)
SPREADS = ("distinct", "uniform", "zipf", "identical", "skewed", "base_only")
# Where the kernels round, by activation dtype. float32: IEEE float32 dots (input_precision="ieee"),
# outputs float32. bfloat16: products of bfloat16 operands summed in float32 (on tensor cores,
# which may truncate rather than round: twice u), h and y stored as bfloat16, rounded to nearest.
ROUNDING = {torch.float32: FLOAT32, torch.bfloat16: Rounding(acc=2 * U32, h=U_BF16, y=U_BF16)}
# (d_in, widths of the group's modules): a fused q/k/v-like group and a single-module group whose
# rows straddle page boundaries.
GROUPS = {"qkv": (64, (64, 32, 32)), "down": (96, (80,))}


@dataclass
class Case:
    """One layer's pool slab plus the lookup tables of one projection group, as the model passes them."""

    pool: torch.Tensor
    page_table: torch.Tensor
    a_offset: torch.Tensor
    a_rows: torch.Tensor
    b_offset: torch.Tensor
    rank: torch.Tensor
    h_start: torch.Tensor
    scale: torch.Tensor
    out_start: tuple[int, ...]
    d_in: int
    width: int  # columns of h: at least every slot's a_rows


def _place_pages(gen: np.random.Generator, needs: list[int], scattered: list[bool]) -> list[list[int]]:
    """Page ids per adapter: a run of consecutive pages, or ascending pages scattered among others."""
    total = sum(needs)
    free = list(range(1, 2 * total + 2))
    out: list[list[int]] = []
    run_cursor = 1
    scattered_pool = [p for p in free if p > total]  # the upper half, shuffled between adapters
    gen.shuffle(scattered_pool)
    for need, scatter in zip(needs, scattered):
        if scatter:
            pages, scattered_pool = sorted(scattered_pool[:need]), scattered_pool[need:]
        else:
            pages, run_cursor = list(range(run_cursor, run_cursor + need)), run_cursor + need
        out.append(pages)
    return out


def make_case(
    group: str, dtype: torch.dtype, num_adapters: int, gen: np.random.Generator, page_size: int = 128
) -> Case:
    d_in, widths = GROUPS[group]
    M = len(widths)
    S = num_adapters + 1
    ranks = gen.choice(RANKS, size=(S, M))
    ranks[0] = 0
    ranks[gen.random((S, M)) < 0.1] = 0  # some modules untargeted
    lead = gen.choice([0, 0, 3], size=S)  # an unaligned start sends reads down the paged path
    a_off, a_rows = np.zeros(S, np.int64), ranks.sum(1).astype(np.int32)
    b_off, h_start = np.zeros((S, M), np.int64), np.zeros((S, M), np.int32)
    numel = np.zeros(S, np.int64)
    for s in range(1, S):
        cursor = a_off[s] = lead[s]
        h_start[s] = np.concatenate(([0], np.cumsum(ranks[s])[:-1]))
        cursor += a_rows[s] * d_in
        for m in range(M):
            b_off[s, m] = cursor
            cursor += widths[m] * ranks[s, m]
        numel[s] = cursor
    needs = [max(1, -(-int(n) // page_size)) for n in numel[1:]]
    pages = _place_pages(gen, needs, list(gen.random(num_adapters) < 0.5))
    num_pages = 2 * sum(needs) + 2
    page_table = torch.zeros(S, max(needs) + 3, dtype=torch.int32)
    for s, p in enumerate(pages, start=1):
        page_table[s, : len(p)] = torch.tensor(p, dtype=torch.int32)
    # Tables are strided slices of [layers, slots, groups|modules] tensors, as the model passes them.
    full_a = torch.zeros(2, S, 4, dtype=torch.int64)
    full_rows = torch.zeros(2, S, 4, dtype=torch.int32)
    full_a[1, :, 2], full_rows[1, :, 2] = torch.from_numpy(a_off), torch.from_numpy(a_rows)
    full_b = torch.zeros(2, S, 7, dtype=torch.int64)
    full_rank, full_hs = torch.zeros(2, S, 7, dtype=torch.int32), torch.zeros(2, S, 7, dtype=torch.int32)
    full_scale = torch.zeros(2, S, 7, dtype=torch.float32)
    m0 = 4
    full_b[1, :, m0 : m0 + M] = torch.from_numpy(b_off)
    full_rank[1, :, m0 : m0 + M] = torch.from_numpy(ranks.astype(np.int32))
    full_hs[1, :, m0 : m0 + M] = torch.from_numpy(h_start)
    full_scale[1, :, m0 : m0 + M] = torch.from_numpy(gen.uniform(0.25, 2.0, (S, M)).astype(np.float32))
    torch.manual_seed(int(gen.integers(1 << 31)))
    pool = (torch.randn(num_pages, page_size) * 0.5).to(dtype)
    on = lambda t: t.to(DEVICE)  # noqa: E731
    return Case(
        pool=on(pool),
        page_table=on(page_table),
        a_offset=on(full_a)[1, :, 2],
        a_rows=on(full_rows)[1, :, 2],
        b_offset=on(full_b)[1, :, m0 : m0 + M],
        rank=on(full_rank)[1, :, m0 : m0 + M],
        h_start=on(full_hs)[1, :, m0 : m0 + M],
        scale=on(full_scale)[1, :, m0 : m0 + M],
        out_start=tuple(int(v) for v in np.concatenate(([0], np.cumsum(widths)[:-1]))),
        d_in=d_in,
        width=int(a_rows.max()) + 5,
    )


def sequence_slots(spread: str, num_seqs: int, num_adapters: int, gen: np.random.Generator) -> list[int]:
    """The adapter slot of each sequence for a named spread; about a quarter are base-only (slot 0)."""
    if spread == "base_only":
        return [0] * num_seqs
    n = num_seqs - num_seqs // 4
    if spread == "distinct":
        slots = list(gen.permutation(np.arange(1, num_adapters + 1))[:n])
    elif spread == "uniform":
        slots = list(gen.integers(1, num_adapters + 1, n))
    elif spread == "zipf":
        weights = 1.0 / np.arange(1, num_adapters + 1) ** 1.5
        slots = list(gen.choice(np.arange(1, num_adapters + 1), n, p=weights / weights.sum()))
    elif spread == "identical":
        slots = [int(gen.integers(1, num_adapters + 1))] * n
    elif spread == "skewed":
        hot = int(gen.integers(1, num_adapters + 1))
        slots = [hot if gen.random() < 0.75 else int(gen.integers(1, num_adapters + 1)) for _ in range(n)]
    else:
        raise ValueError(spread)
    return [int(s) for s in slots] + [0] * (num_seqs - n)


def make_indices(seq_slots: list[int], lengths: list[int], sgmv: bool) -> LoraIndices:
    """Tokens ordered as the engine orders them: sequences sorted by slot, each one's tokens together."""
    order = sorted(range(len(seq_slots)), key=lambda i: seq_slots[i])
    token_slot = [seq_slots[i] for i in order for _ in range(lengths[i])]
    segments, start = [], 0
    for t in range(1, len(token_slot) + 1):
        if t == len(token_slot) or token_slot[t] != token_slot[start]:
            if token_slot[start]:
                segments.append((start, t, token_slot[start]))
            start = t
    indices = LoraIndices(torch.tensor(token_slot, dtype=torch.int32, device=DEVICE), tuple(segments))
    return indices.with_segment_table() if sgmv else indices


def _host64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64)


def run_case(
    group: str, spread: str, sgmv: bool, dtype: torch.dtype, seed: int, pages: torch.dtype | None = None
) -> None:
    """Activations in ``dtype``, over pages in ``pages`` (default: ``dtype``)."""
    gen = np.random.default_rng(seed)
    num_adapters, num_seqs = 8, 8
    case = make_case(group, pages or dtype, num_adapters, gen)
    seq_slots = sequence_slots(spread, num_seqs, num_adapters, gen)
    lengths = list(gen.integers(1, 7, num_seqs)) if sgmv else [1] * num_seqs
    indices = make_indices(seq_slots, lengths, sgmv)
    T = indices.token_slot.shape[0]
    N = sum(GROUPS[group][1])
    x_wide = torch.randn(T, case.d_in + 8).to(dtype).to(DEVICE)
    x = x_wide[:, : case.d_in]  # strided rows, as a slice of a wider activation
    rounding = ROUNDING[dtype]
    # The references read the same (float32 or bfloat16) values, widened exactly, on the CPU;
    # over absolute values they give the sums the bounds are made of.
    exact, absolute = _host64(case.pool), _host64(case.pool).abs()
    a_tables = (case.page_table, indices, case.a_offset, case.a_rows)

    h_out = torch.full((T, case.width), float("nan"), dtype=dtype, device=DEVICE)
    lora_shrink(h_out, x, case.pool, *a_tables)
    h_want, sums = (torch.full((T, case.width), float("nan"), dtype=torch.float64) for _ in range(2))
    lora_shrink_ref(h_want, _host64(x), exact, *a_tables)
    lora_shrink_ref(sums, _host64(x).abs(), absolute, *a_tables)
    assert_within(h_out, h_want, rounding.shrink(sums, case.d_in), "h")

    y_wide = torch.randn(T, N + 5).to(dtype).to(DEVICE)  # expand adds into whatever y holds
    y_out = y_wide.clone()[:, :N]
    y_want, y0_plus_t = _host64(y_wide[:, :N]), _host64(y_wide[:, :N]).abs()
    b_tables = (case.page_table, indices, case.b_offset, case.rank, case.h_start)
    lora_expand(y_out, h_out, case.pool, *b_tables, case.scale, case.out_start)
    lora_expand_ref(y_want, _host64(h_out), exact, *b_tables, case.scale, case.out_start)
    lora_expand_ref(y0_plus_t, _host64(h_out).abs(), absolute, *b_tables, case.scale.abs(), case.out_start)
    assert_within(y_out, y_want, rounding.expand(y0_plus_t, int(case.rank.max())), "y")
    untouched = indices.token_slot == 0
    assert torch.equal(y_out[untouched], y_wide[:, :N][untouched]), "base-only rows must be left as they are"


@pytest.mark.parametrize("sgmv", [False, True], ids=["bgmv", "sgmv"])
@pytest.mark.parametrize("spread", SPREADS)
def test_spreads_float32(spread: str, sgmv: bool) -> None:
    run_case("qkv", spread, sgmv, torch.float32, seed=SPREADS.index(spread) * 2 + sgmv)


@pytest.mark.parametrize("sgmv", [False, True], ids=["bgmv", "sgmv"])
@pytest.mark.parametrize("group", ["qkv", "down"])
def test_bfloat16(group: str, sgmv: bool) -> None:
    run_case(group, "uniform", sgmv, torch.bfloat16, seed=100 + sgmv)


@pytest.mark.parametrize("sgmv", [False, True], ids=["bgmv", "sgmv"])
@pytest.mark.parametrize("group", ["qkv", "down"])
def test_float32_activations_over_bfloat16_pages(group: str, sgmv: bool) -> None:
    """--lora-dtype bfloat16 under a float32 model: the reference widens the same bfloat16
    weights, and both compute in float32."""
    run_case(group, "skewed", sgmv, torch.float32, seed=300 + sgmv, pages=torch.bfloat16)


@pytest.mark.parametrize("sgmv", [False, True], ids=["bgmv", "sgmv"])
def test_single_module_group_float32(sgmv: bool) -> None:
    run_case("down", "zipf", sgmv, torch.float32, seed=200 + sgmv)


def test_rejects_mismatched_dtypes() -> None:
    gen = np.random.default_rng(0)
    case = make_case("down", torch.float32, 2, gen)
    indices = make_indices([1, 2], [1, 1], sgmv=False)
    x = torch.randn(2, case.d_in, dtype=torch.bfloat16, device=DEVICE)
    h = torch.zeros(2, case.width, device=DEVICE)
    with pytest.raises(AssertionError):
        lora_shrink(h, x, case.pool, case.page_table, indices, case.a_offset, case.a_rows)
