"""int8 weights and per-token int8 activations (quantization w8a8, kernels/linear_w8a8.py): the C
passes around torch's int8 GEMM against the PyTorch reference in its docstring, in every variant of
the C kernels this CPU runs, within what the arithmetic proves (not this CPU's last bits); the
engine over a w8a8 tiny model; merging an adapter into (the dedicated tier) and the merge check on
a w8a8 base."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.kernels import cpu_isa, linear_w8a8 as w8a8_mod
from lorapage.kernels.cpu_build import cpu_kernels, load_variant
from lorapage.kernels.linear_int8 import QMAX, Int8Rows, dequantize, pack_int8
from lorapage.kernels.linear_w8a8 import (
    TINY,
    linear_w8a8,
    linear_w8a8_ref,
    quantize_activations,
    quantize_activations_ref,
)
from lorapage.kernels.linear_w8a8_fbgemm import fbgemm_available, linear_w8a8_fbgemm

U = 2.0**-24  # float32's unit roundoff
VARIANTS = [v.name for v in cpu_isa.variants()]


def g(n: int) -> float:
    """``n`` roundings' relative bound (Higham's gamma_n, tests/numeric_bounds.py)."""
    return n * U / (1 - n * U)


@functools.cache
def _library(name: str):
    lacks = cpu_isa.missing(next(v for v in cpu_isa.variants() if v.name == name), cpu_isa.cpu_flags())
    if lacks:
        return f"this CPU lacks {', '.join(sorted(lacks))}"
    try:
        return load_variant(name)
    except RuntimeError as e:
        return f"the compiler cannot build it: {e}"


@pytest.fixture(params=VARIANTS)
def variant(request, monkeypatch):
    """Each variant of the C kernels this CPU runs, as linear_w8a8's library."""
    if cpu_kernels() is None:
        pytest.skip("the C kernels did not build here")
    lib = _library(request.param)
    if isinstance(lib, str):
        pytest.skip(f"{request.param} kernels: {lib}")
    monkeypatch.setattr(w8a8_mod, "cpu_kernels", lambda: lib)
    return request.param


def _activations(rows: int, d_in: int) -> torch.Tensor:
    """Rows over six decades, a row of zeros, a row of exact ties (127 / a = 1: x.5 rounds to even), and
    a row too small to scale (quantized to zeros)."""
    torch.manual_seed(rows * 1000 + d_in)
    x = torch.randn(rows, d_in) * torch.logspace(-3, 3, rows)[:, None]
    x[1] = 0.0
    ties = torch.arange(d_in, dtype=torch.float32) % 9 - 4.5
    ties[0] = QMAX
    x[2] = ties
    if rows > 3:
        x[3] *= 2.0**-110
    return x


@pytest.mark.parametrize("d_in", [37, 256])  # 37: every row ends in the scalar tail
def test_the_activations_quantize_as_the_reference_bit_for_bit(variant, d_in):
    wide = _activations(6, 2 * d_in)
    x = wide[:, ::2]  # rows not unit-stride along d_in: copied first
    x2 = wide[:, :d_in]  # a row stride of 2 d_in
    for a in (x, x2):
        q, s = quantize_activations(a)
        q_ref, s_ref = quantize_activations_ref(a)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref[:, 0])
        assert int(q.abs().max()) <= QMAX
        assert float(s[1]) == float(s[3]) == 1.0 and not bool(q[1].any()) and not bool(q[3].any())
        # round(fl(x * fl(127 / a))) against x / s with s = fl(a / 127): three roundings of a value <= 128
        err = (q.double() * s.double()[:, None] - a.double()).abs()
        assert bool((err <= s.double()[:, None] * (0.5 + 128 * g(3))).all())
    assert q[2, :7].tolist() == [127, -4, -2, -2, 0, 0, 2]  # s_x = 1: -3.5, -2.5, -1.5, -0.5, 0.5, 1.5 to even


@pytest.mark.parametrize("rows", [0, 1, 5, 33])
def test_linear_w8a8_is_within_the_arithmetic_bound_of_the_exact_product(variant, rows):
    """Against ``x @ (q s_w).T + b`` in float64: each activation's rounding (<= s_x (1/2 + 128 g(3)), or
    all of x on a row too small to scale) through |q s_w|, and the float32 conversion of the exact int32
    sum, two products and the bias's add (g(4) of |x^| |q s_w| + |b|); the reference (torch ops) is held
    to the same bound."""
    d_in, d_out = 70, 44  # neither a multiple of 8: the rescale's scalar tail
    torch.manual_seed(rows)
    x = _activations(max(rows, 3), d_in)[:rows]
    w, bias = torch.randn(d_out, d_in) * 0.1, torch.randn(d_out)
    packed = pack_int8(w)
    dense = dequantize(packed).double()
    a = x.abs().amax(1, keepdim=True).double()
    s_x = a / QMAX
    exact = x.double() @ dense.T + bias.double()
    per = torch.where(a >= TINY, s_x * (0.5 + 128 * g(3)), a)  # a row too small to scale: each |x| <= a
    act = per * (dense.abs().sum(1)[None, :])
    mag = (x.double().abs() + s_x) @ dense.abs().T + bias.double().abs()
    bound = act + g(4) * mag
    for b in (bias, None):
        want = exact if b is not None else exact - bias.double()
        for fn in (linear_w8a8, linear_w8a8_ref):
            y = fn(x, packed, b)
            assert y.shape == (rows, d_out) and y.dtype == torch.float32
            assert bool(((y.double() - want).abs() <= bound).all()), fn.__name__
    # not vacuous: on the Gaussian rows the bound is a few percent of the output's magnitude
    normal = [r for r in range(rows) if r not in (1, 2, 3)]
    assert all(float((bound / mag)[r].max()) < 0.05 for r in normal)


def test_without_the_c_kernels_the_reference_runs(monkeypatch):
    monkeypatch.setattr(w8a8_mod, "cpu_kernels", lambda: None)
    x, w = torch.randn(4, 24), pack_int8(torch.randn(16, 24))
    assert torch.equal(linear_w8a8(x, w), linear_w8a8_ref(x, w))
    plain = torch.randn(16, 24)  # lm_head: not quantized
    assert torch.allclose(linear_w8a8(x, plain), x @ plain.T, rtol=1e-5, atol=1e-5)


def test_float32_scales_are_read_as_given():
    """A loaded checkpoint's Int8Rows may carry float32 scales (compressed-tensors): used as they are."""
    w = torch.randint(-QMAX, QMAX + 1, (12, 40), dtype=torch.int8).as_subclass(Int8Rows)
    w.scales = torch.rand(12) * 0.01 + 1e-3
    x = torch.randn(3, 40)
    got = linear_w8a8(x, w).double()
    q_x, s_x = quantize_activations_ref(x)
    want = (q_x.double() @ w.as_subclass(torch.Tensor).double().T) * s_x.double() * w.scales.double()
    assert bool(((got - want).abs() <= g(4) * want.abs() + 1e-30).all())
    w.scales.mul_(2.0)  # scales edited in place: read again
    assert torch.allclose(linear_w8a8(x, w).double(), 2 * got, rtol=1e-6, atol=1e-30)


@pytest.fixture(scope="module")
def engines():
    """The tiny model in float32 and w8a8 (one thread)."""
    return Engine(EngineConfig(num_threads=1)), Engine(EngineConfig(quantization="w8a8", num_threads=1))


def test_the_w8a8_tiny_model_runs_its_kernel_and_keeps_its_greedy_tokens(engines):
    """This CPU's w8a8 kernel: torch's int8 GEMM, or FBGEMM's where the CPU has no int8 dot products."""
    wide, quant = engines
    ctx = quant.debug.runner.ctx
    slow = cpu_isa.int8_dot_product(cpu_isa.cpu_flags()) is False and fbgemm_available()
    assert isinstance(ctx.model.layers[0]["qkv"], Int8Rows)
    assert ctx.ops.linear is (linear_w8a8_fbgemm if slow else linear_w8a8)
    prompts = [([5, 9, 17, 33, 60, 2, 8], None), ([100, 3, 41], None)]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    got = quant.generate_batch(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in wide.generate_batch(prompts, params)]


@pytest.mark.parametrize("quantization", ["w8a8", "int8"])
def test_quantize_lm_head_puts_the_logits_weight_in_int8_and_keeps_the_greedy_tokens(engines, quantization):
    """``quantize_lm_head``: lm_head in int8 rows beside the projections (llama.cpp's Q8_0 output
    matrix); the embedding lookup keeps its float32 table, and the tiny model's greedy tokens stay."""
    wide, _ = engines
    quant = Engine(EngineConfig(quantization=quantization, quantize_lm_head=True, num_threads=1))
    model = quant.debug.runner.ctx.model
    assert isinstance(model.lm_head, Int8Rows) and not isinstance(model.embed, Int8Rows)
    assert not isinstance(wide.debug.runner.ctx.model.lm_head, Int8Rows)
    prompts = [([5, 9, 17, 33, 60, 2, 8], None), ([100, 3, 41], None)]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
    got, want = quant.generate_batch(prompts, params), wide.generate_batch(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):  # the logits moved, within int8's rounding, not onto other tokens
        assert all(abs(a.logprob - b.logprob) < 0.5 for a, b in zip(g.logprobs or [], w.logprobs or []))


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_quantize_lm_head_is_refused_without_an_int8_base(quantization):
    """Checked against the scheme the engine serves (named, or a pre-quantized checkpoint's)."""
    with pytest.raises(ValueError, match="quantize_lm_head needs an int8 or w8a8 base"):
        Engine(EngineConfig(quantization=quantization, quantize_lm_head=True, num_threads=1))


def test_the_merge_check_passes_on_the_w8a8_tiny_model():
    """The dedicated tier on a w8a8 base: an adapter merged into the int8 weights (re-quantized, as for
    int8) and the equivalence check against the LoRA path, both with per-token int8 activations."""
    from lorapage.engine.merge_check import merge_and_check
    from lorapage.tiny import demo_adapter_dirs

    engine = Engine(EngineConfig(quantization="w8a8", num_threads=1, max_lora_rank=64))
    name, path = sorted(demo_adapter_dirs().items())[0]
    engine.add_adapter(name, str(path))
    check = asyncio.run(merge_and_check(engine, name, max_tokens=8))
    assert check.passed and check.mismatched_prompts == 0, check
    assert isinstance(engine.debug.runner.ctx.model.layers[0]["qkv"], Int8Rows)


def test_w8a8_without_int8_dot_products_runs_fbgemm_or_warns(monkeypatch, caplog):
    """torch's int8 GEMM needs VNNI / AMX (x86) or SDOT / I8MM (arm) to beat float32; without them
    the engine runs FBGEMM's int8 GEMM, and where this torch has none it still serves w8a8 through
    torch's and says at start that this CPU runs it slowly."""
    from lorapage.model import quantized_ops

    assert cpu_isa.int8_dot_product(frozenset({"avx2", "fma"})) is False
    assert cpu_isa.int8_dot_product(frozenset({"avx512f", "avx512_vnni"})) is True
    assert cpu_isa.int8_dot_product(frozenset({"asimd", "asimddp"})) is True
    assert cpu_isa.int8_dot_product(None) is None
    avx2, vnni = frozenset({"avx", "avx2", "fma"}), frozenset({"avx2", "avx_vnni"})
    cases = [(avx2, False, linear_w8a8, True), (vnni, True, linear_w8a8, False)]
    if fbgemm_available():
        cases.append((avx2, True, linear_w8a8_fbgemm, False))
    for flags, fbgemm, linear, warned in cases:
        monkeypatch.setattr(quantized_ops, "cpu_flags", lambda flags=flags: flags)
        monkeypatch.setattr(quantized_ops, "fbgemm_available", lambda fbgemm=fbgemm: fbgemm)
        caplog.clear()
        with caplog.at_level("WARNING", logger="lorapage.engine"):
            engine = Engine(EngineConfig(quantization="w8a8", num_threads=1))
        assert engine.debug.runner.ctx.ops.linear is linear
        assert ("without int8 dot-product instructions" in caplog.text) is warned, caplog.text
        asyncio.run(engine.close())
