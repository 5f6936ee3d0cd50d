"""The CPU path's C decode attention (kernels/attention_cpu.h) against a float64 reference, within
the bound float32 arithmetic allows in any summation order (numeric_bounds.decode_attention), for
each kernel variant this CPU runs."""

from __future__ import annotations

import pytest
import torch
from numeric_bounds import assert_within, decode_attention, violations
from test_lora_cpu import VARIANTS, _library

from lorapage.kernels.attention_cpu import decode_attention_c, paged_decode_attention_cpu
from lorapage.kernels.attention_ref import paged_decode_attention_ref
from lorapage.kernels.cpu_build import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C kernels did not build here")

SHAPES = {
    # name: (heads, KV heads, head dim, block size)
    "gqa": (8, 4, 64, 16),  # float32 pages: V summed in registers, 64 columns at a time
    "wide_heads": (4, 2, 128, 16),  # two 64-column parts
    "mha": (4, 4, 32, 8),
    "one_kv_head": (8, 1, 64, 16),
    "odd_head_dim": (6, 2, 20, 4),  # every dot product takes the scalar path
}
LENS = [1, 3, 16, 17, 40, 63, 64, 129]  # one position, inside a page, page edges, several pages


def _pool(heads: int, kv_heads: int, dim: int, block_size: int, lens: list[int], seed: int = 0):
    """A KV slab with each row's pages scattered through it, the pages' unused positions and every
    page nobody owns NaN (a kernel that reads past a row's context shows it), and block tables
    whose unused entries point at a NaN page."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_pages = sum(need) + 8
    kv = torch.full((num_pages, 2, block_size, kv_heads, dim), float("nan"))
    order = torch.randperm(num_pages - 1, generator=g)[: sum(need)] + 1  # page 0 stays the dummy
    width = max(need) + 2
    table = torch.full((len(lens), width), 0, dtype=torch.int32)
    at = 0
    for b, (n, pages) in enumerate(zip(lens, need, strict=True)):
        mine = order[at : at + pages]
        at += pages
        table[b, :pages] = mine.to(torch.int32)
        for p in range(n):
            kv[mine[p // block_size], :, p % block_size] = torch.randn(2, kv_heads, dim, generator=g)
    q = torch.randn(len(lens), heads, dim, generator=g)
    return q, kv, table, torch.tensor(lens, dtype=torch.int32)


def _gathered(q, kv, table, lens):
    """Each row's keys and values per query head, [B, L, H, D] (float64; zero past the context)."""
    bsz, heads, dim = q.shape
    block_size, kv_heads = kv.shape[2], kv.shape[3]
    length = int(lens.max())
    k = torch.zeros(bsz, length, heads, dim, dtype=torch.float64)
    v = torch.zeros_like(k)
    for b in range(bsz):
        for p in range(int(lens[b])):
            page = kv[table[b, p // block_size], :, p % block_size].to(torch.float64)  # [2, H_kv, D]
            per_head = page.repeat_interleave(heads // kv_heads, dim=1)
            k[b, p], v[b, p] = per_head[0], per_head[1]
    return k, v


def _reference(q, k, v, lens, scale, first=None, softcap=None):
    """The float64 attention, from the gathered keys and values (positions ``first[b] <= p <
    lens[b]`` with a window; scores soft-capped with a cap)."""
    scores = torch.einsum("bhd,blhd->bhl", q.to(torch.float64), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    at = torch.arange(k.shape[1])[None, :]
    mask = (at < lens[:, None]) & (at >= (0 if first is None else first[:, None]))
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("bhl,blhd->bhd", torch.softmax(scores, -1), v)


@pytest.fixture(params=VARIANTS)
def lib(request):
    lib = _library(request.param)
    if isinstance(lib, str):
        pytest.skip(f"{request.param} kernels: {lib}")
    return lib


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_attention_is_within_the_float32_bound_of_float64(lib, shape):
    heads, kv_heads, dim, block_size = SHAPES[shape]
    q, kv, table, lens = _pool(heads, kv_heads, dim, block_size, LENS)
    scale = dim**-0.5
    out = torch.full_like(q, float("nan"))
    assert decode_attention_c(lib, out, q, kv, table, lens, scale)
    k, v = _gathered(q, kv, table, lens)
    assert_within(out, _reference(q, k, v, lens, scale), decode_attention(q, k, v, lens, scale), shape)


@pytest.mark.parametrize("lens", [LENS[-2:], LENS], ids=["few_rows", "many_rows"])
@pytest.mark.parametrize("threads", [1, 2])
def test_both_task_splits_are_within_the_bound(lib, lens, threads, monkeypatch):
    """Rows fewer than 4 a thread run one task per (row, KV head); more, one task per row reading
    each position's K and V over all its KV heads at once: both within the bound, at 1 and 2 threads."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    heads, kv_heads, dim, block_size = SHAPES["gqa"]
    q, kv, table, lens_t = _pool(heads, kv_heads, dim, block_size, lens, seed=3)
    out = torch.full_like(q, float("nan"))
    assert decode_attention_c(lib, out, q, kv, table, lens_t, dim**-0.5)
    k, v = _gathered(q, kv, table, lens_t)
    want = _reference(q, k, v, lens_t, dim**-0.5)
    assert_within(out, want, decode_attention(q, k, v, lens_t, dim**-0.5), f"{len(lens)} rows, {threads} threads")


@pytest.mark.parametrize("window,softcap", [(5, None), (1, None), (None, 5.0), (16, 50.0)])
def test_windows_and_soft_caps_are_within_the_bound(lib, window, softcap):
    """A sliding window reads only each row's last ``window`` positions: every position before it
    is NaN here (its page freed and reused), and the result is still within the bound of the
    float64 attention over the window; a soft-cap bends the (enlarged) scores before the softmax."""
    heads, kv_heads, dim, block_size = SHAPES["gqa"]
    q, kv, table, lens = _pool(heads, kv_heads, dim, block_size, LENS)
    scale = dim**-0.5 * (8 if softcap else 1)  # scores of ~10: where a cap of 5 or 50 bends them
    first = (lens - window).clamp_min(0) if window else torch.zeros_like(lens)
    k, v = _gathered(q, kv, table, lens)
    for b, start in enumerate(first.tolist()):
        for pos in range(start):
            kv[table[b, pos // block_size], :, pos % block_size] = float("nan")
    out = torch.full_like(q, float("nan"))
    assert decode_attention_c(lib, out, q, kv, table, lens, scale, window, softcap)
    want = _reference(q, k, v, lens, scale, first, softcap)
    assert_within(
        out, want, decode_attention(q, k, v, lens, scale, first=first, softcap=softcap), f"{window} {softcap}"
    )
    ref = torch.empty_like(q)
    paged_decode_attention_ref(ref, q, kv, table, lens, scale, window, softcap)
    assert_within(ref, want, decode_attention(q, k, v, lens, scale, first=first, softcap=softcap), "reference")


def test_rows_of_a_larger_tensor_are_read_and_written_in_place(lib):
    """The model passes ``out[:nd]`` and ``q[:nd]`` of the step's tokens and a block table sliced
    to the step's width: row strides, not shapes, step from row to row."""
    heads, kv_heads, dim, block_size = SHAPES["gqa"]
    q, kv, table, lens = _pool(heads, kv_heads, dim, block_size, LENS)
    wide = torch.cat([table, torch.zeros(len(LENS), 5, dtype=torch.int32)], 1)[:, : table.shape[1]]
    out = torch.full((len(LENS) + 3, heads, dim), 7.0)
    assert decode_attention_c(lib, out[:-3], q, kv, wide, lens, 0.125)
    want = torch.empty_like(q)
    paged_decode_attention_ref(want, q, kv, table, lens, 0.125)
    k, v = _gathered(q, kv, table, lens)
    assert_within(out[:-3], _reference(q, k, v, lens, 0.125), decode_attention(q, k, v, lens, 0.125))
    assert (out[-3:] == 7.0).all()  # rows past the call's are not written


def test_the_bound_catches_a_position_left_out():
    """What the bound is worth: the attention of each row without its last position (a context
    length off by one) is outside it, at every row of more than one position."""
    heads, kv_heads, dim, block_size = SHAPES["gqa"]
    q, kv, table, lens = _pool(heads, kv_heads, dim, block_size, LENS)
    k, v = _gathered(q, kv, table, lens)
    short = torch.empty_like(q)
    assert decode_attention_c(cpu_kernels(), short, q, kv, table, (lens - 1).clamp_min(1), 0.125)
    bad = violations(short, _reference(q, k, v, lens, 0.125), decode_attention(q, k, v, lens, 0.125))
    assert bad[lens > 1].flatten(1).any(1).all()


def test_tensors_the_kernel_cannot_read_run_the_reference():
    """bfloat16 pages, a non-packed q: the PyTorch reference, exactly."""
    heads, kv_heads, dim, block_size = SHAPES["gqa"]
    q, kv, table, lens = _pool(heads, kv_heads, dim, block_size, LENS)
    kv = kv.nan_to_num(0.0)
    for q_in, kv_in in ((q, kv.to(torch.bfloat16)), (q.transpose(0, 1).contiguous().transpose(0, 1), kv)):
        out, want = torch.empty_like(q_in, dtype=kv_in.dtype), torch.empty_like(q_in, dtype=kv_in.dtype)
        q_in = q_in.to(kv_in.dtype)
        assert not decode_attention_c(cpu_kernels(), out, q_in, kv_in, table, lens, 0.125)
        paged_decode_attention_cpu(out, q_in, kv_in, table, lens, 0.125)
        paged_decode_attention_ref(want, q_in, kv_in, table, lens, 0.125)
        assert torch.equal(out, want)
