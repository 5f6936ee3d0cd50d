"""The CPU path's per-layer C ops (kernels/step_cpu.h) and its C prefill attention against their
references: the rotation and the K/V write bit for bit, the norm, SiLU and the prefill within the
float32 bounds of float64 (any summation order), and the PyTorch ops wherever a kernel cannot read
the tensors."""

from __future__ import annotations

import pytest
import torch
from numeric_bounds import U32, assert_within, decode_attention, gamma
from test_attention_cpu import _gathered, _pool, _reference

import lorapage.kernels.attention_cpu as attention_cpu
from lorapage.kernels.attention_ref import prefill_attention_ref, write_kv_ref
from lorapage.kernels.cpu_build import cpu_kernels
from lorapage.kernels.step_cpu import greedy_rows_cpu, rms_norm_cpu, rope_cpu, silu_mul_cpu, write_kv_cpu
from lorapage.kernels.step_ref import rms_norm_ref, rope_ref, silu_mul_ref

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C kernels did not build here")

# rows: a decode step's (one thread), an odd count, and a prefill's past the parallel threshold
ROWS = [32, 5, 300]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", [1024, 100])
def test_rms_norm_adds_the_residual_and_is_within_the_bound(rows, dim):
    """``x + r`` exactly (one rounding, as the reference's add), then the norm: the sum of squares in
    any order (``g(dim)``), the mean, ``+ eps``, the square root, the reciprocal and the two products
    (six roundings), half of the sum's error through the square root."""
    g = torch.Generator().manual_seed(rows + dim)
    x, r, w = torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g), torch.randn(dim, generator=g)
    for residual in (r, None):
        want_x = rms_norm_ref(x, residual, w, 1e-5)[0]
        got_x, got = rms_norm_cpu(x.clone(), residual, w, 1e-5)
        assert torch.equal(got_x, want_x)
        s = want_x.double()
        exact = w.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
        assert_within(got, exact, (gamma(dim, U32) / 2 + gamma(6, U32)) * exact.abs(), "rms_norm")


@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_is_within_the_bound(rows):
    """``silu(g) * u``: the exponential within 3 ulp (Cephes' polynomial), then ``1 +``, the division
    and the product: 8 ulp of the result; far tails (|g| of 100, 200) go to 0 and to g."""
    g = torch.Generator().manual_seed(rows)
    gate = torch.randn(rows, 1408, generator=g) * 6
    gate[0, :6] = torch.tensor([-200.0, -100.0, -87.0, 0.0, 88.0, 200.0])
    gu = torch.cat([gate, torch.randn(rows, 1408, generator=g)], 1)
    got = silu_mul_cpu(gu, 1408)
    exact = silu_mul_ref(gu.double(), 1408)
    assert_within(got, exact, gamma(8, U32) * exact.abs() + 1e-30, "silu_mul")
    assert torch.allclose(silu_mul_ref(gu, 1408), got, rtol=gamma(16, U32), atol=1e-30)


@pytest.mark.parametrize("rotary", [64, 32])
def test_rope_is_the_reference_bit_for_bit(rotary):
    """In place on a view of a fused qkv (rows strided), whole and partial rotation: every element
    as the reference's two products and sum (no FMA)."""
    g = torch.Generator().manual_seed(rotary)
    qkv = torch.randn(33, 40 * 64, generator=g)
    qk = qkv[:, : 24 * 64].view(33, 24, 64)
    cos, sin = torch.randn(33, rotary, generator=g), torch.randn(33, rotary, generator=g)
    want = rope_ref(qk.clone(), cos, sin)
    rest = qkv[:, 24 * 64 :].clone()
    got = rope_cpu(qk, cos, sin)
    assert got.data_ptr() == qk.data_ptr()
    assert torch.equal(got, want)
    assert torch.equal(qkv[:, 24 * 64 :], rest)


def test_write_kv_is_the_reference_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(10, 2, 16, 4, 64, generator=g)
    qkv = torch.randn(20, 16 * 64, generator=g)
    k, v = qkv[:, 8 * 64 : 12 * 64].view(20, 4, 64), qkv[:, 12 * 64 :].view(20, 4, 64)
    slots = torch.randperm(160, generator=g)[:20]
    want = kv.clone()
    write_kv_ref(want, k, v, slots)
    write_kv_cpu(kv, k, v, slots)
    assert torch.equal(kv, want)


@pytest.mark.parametrize("vocab", [4096, 1001, 7])
def test_greedy_rows_are_argmax_and_flag_rows_not_finite(vocab):
    """Each row's ``argmax`` (the first of tied largest values, a -0.0 before 0.0 included, the
    largest in the tail past the last 8), -1 for a row with a NaN, +inf or -inf anywhere; rows read
    through their stride (a slice of wider logits)."""
    g = torch.Generator().manual_seed(vocab)
    wide = torch.randn(12, vocab + 5, generator=g)
    x = wide[:, :vocab]
    x[1, [vocab // 3, vocab - 1]] = 50.0  # a tie: the first
    x[2, vocab - 1] = 60.0  # the largest in the tail
    x[3] = -x[3].abs()
    x[3, [0, vocab // 2]] = torch.tensor([-0.0, 0.0])  # equal under ==: the first
    x[4, vocab // 2] = float("nan")
    x[5, 0] = float("inf")
    x[6, vocab - 1] = float("-inf")
    x[7] = float("-inf")
    got = greedy_rows_cpu(x)
    finite = torch.isfinite(x).all(-1)
    assert got == torch.where(finite, x.argmax(-1), -1).tolist()
    assert got[1] == vocab // 3 and got[2] == vocab - 1 and got[3] == 0 and got[4:8] == [-1] * 4
    assert greedy_rows_cpu(x.double()) is None  # not float32: the caller's torch ops


def test_tensors_the_kernels_cannot_read_run_the_reference():
    """bfloat16 activations and pages: the PyTorch ops, exactly."""
    x, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(rms_norm_cpu(x, x, w, 1e-6)[1], rms_norm_ref(x, x, w, 1e-6)[1])
    assert torch.equal(silu_mul_cpu(torch.cat([x, x], 1), 64), silu_mul_ref(torch.cat([x, x], 1), 64))
    q, c = torch.randn(4, 2, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
    assert torch.equal(rope_cpu(q.clone(), c, c), rope_ref(q, c, c))
    kv, want = torch.zeros(3, 2, 4, 2, 8, dtype=torch.bfloat16), torch.zeros(3, 2, 4, 2, 8, dtype=torch.bfloat16)
    slots = torch.tensor([0, 5, 9, 11])
    write_kv_cpu(kv, q, q, slots)
    write_kv_ref(want, q, q, slots)
    assert torch.equal(kv, want)


@pytest.mark.parametrize("window,softcap", [(None, None), (3, None), (None, 5.0)])
def test_prefill_attention_is_within_the_bound_of_float64(monkeypatch, window, softcap):
    """Three prompts (one whole, two chunks after a prefix in the pages): each token attends to its
    sequence's positions up to its own (the last ``window``), within the decode attention's bound
    for that token's context; the PyTorch reference never runs."""
    heads, kv_heads, dim, block_size = 8, 4, 64, 16
    chunks, ctx = [5, 1, 12], [5, 40, 29]
    q_seq, kv, table, lens = _pool(heads, kv_heads, dim, block_size, ctx)
    per_token = torch.tensor([c - n + 1 + j for n, c in zip(chunks, ctx) for j in range(n)], dtype=torch.int32)
    seq = torch.tensor([i for i, n in enumerate(chunks) for _ in range(n)])
    q = torch.randn(len(seq), heads, dim, generator=torch.Generator().manual_seed(1))
    starts = [0, 5, 6, 18]

    def no_reference(*args, **kwargs):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(attention_cpu, "prefill_attention_ref", no_reference)
    out = torch.full_like(q, float("nan"))
    attention_cpu.prefill_attention_cpu(out, q, kv, table, starts, ctx, 0.125, window, softcap)
    rows = table[seq]
    k, v = _gathered(q, kv, rows, per_token)
    first = (per_token - window).clamp_min(0) if window else None
    want = _reference(q, k, v, per_token, 0.125, first, softcap)
    assert_within(out, want, decode_attention(q, k, v, per_token, 0.125, first=first, softcap=softcap))
    ref = torch.empty_like(q)
    prefill_attention_ref(ref, q, kv, table, starts, ctx, 0.125, window, softcap)
    assert_within(ref, want, decode_attention(q, k, v, per_token, 0.125, first=first, softcap=softcap), "ref")
