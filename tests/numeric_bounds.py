"""How far a float32 LoRA kernel may be from the exact result, whatever order it sums in.

The kernel tests compare against a float64 reference and allow, per output element, what float32
arithmetic can do, rather than an ``atol`` that held for one machine's summation order (a
compiler, an ISA level, a BLAS or a GPU each pick another order: lanes of a vector, partial sums
per thread, FMA or not).

**Model.** Each float operation is exact, then rounded once: ``fl(a op b) = (a op b)(1 + d)``
with ``|d| <= u`` (``u = 2**-24`` for float32 round to nearest; an FMA rounds once for two
operations, which only removes factors). Write ``g(n) = n u / (1 - n u)``: a product of ``n``
factors ``(1 + d_i)`` (or their inverses) lies within ``g(n)`` of 1 (Higham, *Accuracy and
Stability of Numerical Algorithms*, Lemma 3.1). Values here stay far from underflow and overflow.

**A sum in any order.** However ``n`` terms are added (left to right, in vector lanes then a
tree, in blocks, in threads), the additions form a binary tree with ``n`` leaves, so at most
``n - 1`` roundings lie on the path from any one term to the result. A term that itself carries
``m`` roundings is therefore off by at most ``g(m + n - 1)`` of its size, and the computed sum
by at most ``sum_i g(m_i + n - 1) |t_i|``. Adding an exact zero (padding) rounds nothing.

**Shrink**, ``h_k = sum_{i<d} x_i A_ki``: ``d`` terms, one rounding each (the product), so

    |h^_k - h_k| <= g(d) S_k,     S_k = sum_i |x_i A_ki|.

Stored in a narrower type (``u_h``: bfloat16 h), one more rounding of a value at most
``(1 + g(d)) S_k``: ``c_shrink = u_h + (1 + u_h) g(d)``, and ``|h^_k - h_k| <= c_shrink S_k``.

**Expand**, ``y_j = y0_j + sum_{k<r} s h_k B_jk`` for a given h: ``r + 1`` terms (y's old value and
``r`` products); a product carries two roundings (``s * h`` then ``* B``, or ``h * B`` then ``* s``
after the sum: either way two), so every term is within ``g(r + 2)``. Stored narrower (``u_y``),
``c_expand = u_y + (1 + u_y) g(r + 2)`` and

    |y^_j - y_j| <= c_expand (|y0_j| + T_j),     T_j = sum_k |s h_k B_jk|.

**Shrink then expand**, the expand reading the shrink's h^ (what a model step does): by the
triangle inequality through ``y(h^)``, the expand's own error is as above with ``h^`` for ``h``,
and the shrink's error reaches y through ``|s B_jk|``:

    |y^_j - y_j| <= c_expand (|y0_j| + sum_k |s h^_k B_jk|) + sum_k |s B_jk| c_shrink S_k
                 <= c_expand (|y0_j| + T_j) + (1 + c_expand) c_shrink P_j,
    P_j = sum_k |s B_jk| S_k         (using |h^_k| <= |h_k| + c_shrink S_k).

``g`` grows with ``n``, so a group's largest ``d`` and ``r`` serve every element. The float64
reference is itself within the same bound at ``u = 2**-53``, and ``S``, ``T``, ``P`` are sums of
non-negative float64 terms, low by at most ``g64(n)`` of themselves: :meth:`Rounding.shrink` and
friends add the former and scale by the latter, so the check holds against the exact result.

For ``d = 272``, ``r = 24`` in float32: ``c_shrink = 1.62e-5``, ``c_expand = 1.55e-6``. Loose, as a
worst case is (the C kernels' largest error in tests/kernels/test_lora_cpu.py is 4% of it), yet one
shrink term dropped moves an output 340 times past it, and one B weight 2% off 2.5 times
(``test_the_bound_catches_a_wrong_weight`` there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

U32 = 2.0**-24  # float32, round to nearest
U64 = 2.0**-53
U_BF16 = 2.0**-8


def gamma(n: int, u: float) -> float:
    """``n u / (1 - n u)``: the most ``n`` roundings of unit ``u`` can move a product off 1."""
    assert n * u < 1, f"{n} roundings of {u} bound nothing"
    return n * u / (1 - n * u)


@dataclass(frozen=True)
class Rounding:
    """Where a kernel rounds: its sums and products (``acc``), and the stores of h and y where
    they are narrower than ``acc`` (0: stored as computed)."""

    acc: float = U32
    h: float = 0.0
    y: float = 0.0

    def c_shrink(self, d: int) -> float:
        """Bound on ``|h^ - h| / S`` for a shrink over ``d`` inputs (module docstring)."""
        return self.h + (1 + self.h) * gamma(d, self.acc)

    def c_expand(self, r: int) -> float:
        """Bound on ``|y^ - y| / (|y0| + T)`` for an expand of rank ``r``."""
        return self.y + (1 + self.y) * gamma(r + 2, self.acc)

    def shrink(self, s: Tensor, d: int) -> Tensor:
        """The bound on the shrink's error, given ``s`` = the float64 ``sum_i |x_i A_ki|``, d inputs."""
        return _exact(self.c_shrink(d) + Rounding(U64).c_shrink(d), s, d)

    def expand(self, y0_plus_t: Tensor, r: int) -> Tensor:
        """The bound on the expand's error, given ``|y0| + T`` in float64, ranks up to ``r``."""
        return _exact(self.c_expand(r) + Rounding(U64).c_expand(r), y0_plus_t, r + 2)

    def lora(self, y0_plus_t: Tensor, p: Tensor, d: int, r: int) -> Tensor:
        """The bound on shrink then expand, given ``|y0| + T`` and ``P`` in float64."""
        total = torch.zeros_like(p)
        for rounding in (self, Rounding(U64)):
            ce, cs = rounding.c_expand(r), rounding.c_shrink(d)
            total += ce * y0_plus_t + (1 + ce) * cs * p
        return total * (1 + gamma(d + r + 2, U64))


FLOAT32 = Rounding()  # float32 sums and products, outputs float32


def _exact(c: float, sums: Tensor, n: int) -> Tensor:
    """``c`` times float64 ``sums`` of non-negative terms, raised by what float64 may have lost in them."""
    return c * sums * (1 + gamma(n, U64))


def violations(got: Tensor, want: Tensor, bound: Tensor) -> Tensor:
    """Where ``got`` is farther from the float64 ``want`` than ``bound`` allows, or NaN where
    ``want`` is not (a bool tensor; NaN where ``want`` is NaN too is agreement: unwritten rows)."""
    got, want, bound = (t.detach().to("cpu", torch.float64) for t in (got, want, bound))
    nan = torch.isnan(want)
    over = (got - want).abs() > bound
    return torch.where(nan, ~torch.isnan(got), over | torch.isnan(got))


def assert_within(got: Tensor, want: Tensor, bound: Tensor, what: str = "output") -> None:
    """Every element of ``got`` within ``bound`` of the float64 ``want`` (and NaN exactly where it is)."""
    bad = violations(got, want, bound)
    if bad.any():
        got64, want64, bound64 = (t.detach().to("cpu", torch.float64) for t in (got, want, bound))
        excess = torch.where(bad, (got64 - want64).abs() / bound64.clamp_min(1e-300), torch.zeros_like(want64))
        excess = torch.where(torch.isnan(excess), torch.full_like(excess, float("inf")), excess)
        at = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements outside the float32 bound; worst at {at}: "
            f"got {float(got64[at])!r}, float64 reference {float(want64[at])!r}, "
            f"|diff| {abs(float(got64[at] - want64[at])):.3g} > bound {float(bound64[at]):.3g}"
        )


def decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lens: Tensor,
    scale: float,
    u: float = U32,
    first: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    """The bound on a float32 decode attention's error per output element, from float64 copies of
    its inputs: ``q`` [B, H, D], ``k`` and ``v`` [B, L, H, D] (each query head's keys and values,
    GQA already resolved), ``lens`` [B] the positions each row attends to.

    **Scores.** ``s_p = scale * sum_d q_d k_pd``: D products and the scale, so ``|s^_p - s_p| <=
    e_p = g(D + 1) |scale| sum_d |q_d k_pd|``. Softmax is unchanged by subtracting a constant;
    the kernel subtracts its largest score m^ (one rounding, at most ``u |s^_p - m^|``) and calls
    ``expf``, taken to be within ``4u`` of exact (glibc's is within one ulp, ``2u``; the margin is
    for other C libraries). Each weight is then ``exp(s_p - C) exp(eta_p)`` for one constant C with
    ``|eta_p| <= E_p = e_p + u (|s_p - m| + 2 max e) - log(1 - 4u)``; with ``E = max_p E_p`` the
    normalized weights are within ``exp(2E) - 1`` of the exact ones, relatively.

    **Sums.** The denominator adds L positive weights (``g(L - 1)``); each output element adds L
    products to 0 (``g(L + 1)`` of ``sum_p w^_p |v_pd|``); a reciprocal and a product follow (two
    more roundings). So, with ``A_d = sum_p a_p |v_pd|`` (a: the exact softmax),

        |o^_d - o_d| <= [exp(2E) - 1 + exp(2E) g(L + 1) (2 + g(L + 1))] A_d.

    The float64 reference is within the same at ``u = 2**-53`` (added in).

    **Windows and soft-caps.** ``first`` [B]: each row attends to positions ``first[b] <= p <
    lens[b]`` only (a sliding window); L above is then the window's count. With ``softcap`` c the
    kernel's score is ``c * tanhf(s^ / c)``: tanh is 1-Lipschitz, so ``e_p`` passes through, plus a
    rounding of ``s^ / c`` (``u |s|``, and ``u e_p``), tanhf's (taken within ``4u`` of exact, as
    expf) and the product's, ``u`` each of ``|s'|``: ``e'_p = (1 + u) e_p + u |s_p| + 6u |s'_p|``.
    """
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    _, length, _, dim = k.shape
    at = torch.arange(length)[None, :]
    mask = at < lens[:, None]  # [B, L]
    if first is not None:
        mask &= at >= first[:, None]
    scores = torch.einsum("bhd,blhd->bhl", q, k) * scale
    spread = torch.einsum("bhd,blhd->bhl", q.abs(), k.abs()) * abs(scale)  # sum_d |q_d k_pd scale|
    raw = scores.abs()
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # [B, H, L]
    a = torch.einsum("bhl,blhd->bhd", weights, v.abs())
    total = torch.zeros_like(a)
    for unit in (u, U64):
        e = gamma(dim + 1, unit) * spread
        if softcap is not None:
            e = (1 + unit) * e + unit * raw + 6 * unit * scores.abs().nan_to_num(0.0, posinf=0.0)
        e = e.masked_fill(~mask[:, None, :], 0.0)
        e_max = e.amax(-1, keepdim=True)
        top = scores.amax(-1, keepdim=True)
        gap = (top - scores).masked_fill(~mask[:, None, :], 0.0)
        big_e = (e + unit * (gap + 2 * e_max) - math.log1p(-4 * unit)).amax(-1)  # [B, H]
        counts = mask.sum(-1)
        g = torch.tensor([gamma(int(n) + 1, unit) for n in counts], dtype=torch.float64)[:, None]
        grow = torch.exp(2 * big_e)
        total += ((grow - 1) + grow * g * (2 + g))[..., None] * a
    return total * (1 + gamma(dim + int(lens.max()) + 2, U64))
