"""Triton KV write, paged decode attention and paged prefill attention over the pool's KV pages.

Same signatures and semantics as :mod:`lorapage.kernels.attention_ref`. One layer's KV pages are
``kv [num_pages, 2, block_size, H_kv, D]``, a view of the pool slab. The KV write and decode
kernels launch a grid that depends only on tensor shapes and read lengths and pages from device
tensors, so they can be captured in a CUDA graph and replayed after the block tables change.
Prefill runs eagerly (graphs capture decode steps only): its launcher turns the host lists of
query starts and context lengths into a small tile table on the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lorapage.kernels.triton_import import import_triton, triton_interpreted

triton = import_triton()
import triton.language as tl  # noqa: E402  (after import_triton picked compiled or interpreted)

WRITE_BLOCK = 1024  # elements of one token's K (or V) row copied per program
# Prefill tiles: a program multiplies PREFILL_ROWS query rows (query tokens x the query heads of
# one KV head) against PREFILL_BLOCK_N context positions at a time, spanning several pages.
PREFILL_ROWS = 64
PREFILL_BLOCK_N = 64
# The interpreter's tl.dot mishandles bf16 and its float32 -> bf16 cast truncates where the GPU
# rounds to nearest even: when interpreting, prefill multiplies in float32 and rounds its stores.
_INTERPRETED = triton_interpreted()


@triton.jit
def _write_kv_kernel(
    kv,
    k,
    v,
    slot_mapping,
    stride_k,
    stride_v,
    BLOCK_SIZE: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    t = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < ROW
    slot = tl.load(slot_mapping + t).to(tl.int64)
    dst = kv + (slot // BLOCK_SIZE) * (2 * BLOCK_SIZE * ROW) + (slot % BLOCK_SIZE) * ROW + i
    src = t.to(tl.int64)
    # Pages narrower than the activations (kv_cache_dtype) take each value rounded to nearest even.
    kt = _cast(tl.load(k + src * stride_k + i, mask=mask).to(tl.float32), kv.dtype.element_ty, INTERPRETED)
    vt = _cast(tl.load(v + src * stride_v + i, mask=mask).to(tl.float32), kv.dtype.element_ty, INTERPRETED)
    tl.store(dst, kt, mask=mask)
    tl.store(dst + BLOCK_SIZE * ROW, vt, mask=mask)


def write_kv(kv: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """``kv[:, 0].flatten(0, 1)[slot_mapping] = k`` and the same for v at ``kv[:, 1]``.

    Shapes: kv [num_pages, 2, block_size, H_kv, D] contiguous; k and v [T, H_kv, D] with each
    token's heads contiguous (rows may be strided, e.g. slices of a fused qkv output);
    slot_mapping [T] int64 with every entry a valid slot (padded rows point into page 0).
    """
    assert kv.dim() == 5 and kv.shape[1] == 2 and kv.is_contiguous(), "kv must be [num_pages, 2, block_size, H_kv, D]"
    T, heads, dim = k.shape
    assert v.shape == k.shape and (heads, dim) == tuple(kv.shape[3:]), f"k, v {tuple(k.shape)} vs kv {tuple(kv.shape)}"
    for name, t in (("k", k), ("v", v)):
        assert t.dtype.itemsize >= kv.dtype.itemsize and t.stride(2) == 1 and t.stride(1) == dim, (
            f"{name}: no narrower than {kv.dtype}, with contiguous heads"
        )
    assert slot_mapping.shape == (T,) and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
    assert len({kv.device, k.device, v.device, slot_mapping.device}) == 1, "all tensors must be on one device"
    if T == 0:
        return
    row = heads * dim
    block = min(WRITE_BLOCK, triton.next_power_of_2(row))
    _write_kv_kernel[(T, triton.cdiv(row, block))](
        kv,
        k,
        v,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        BLOCK_SIZE=kv.shape[2],
        ROW=row,
        BLOCK=block,
        INTERPRETED=_INTERPRETED,
    )


@triton.jit
def _softcap(scores, softcap, SOFTCAP: tl.constexpr):
    """``softcap * tanh(scores / softcap)`` when SOFTCAP, as ``1 - 2 / (exp(2x) + 1)`` (no tanh in
    the interpreter's tl.math): within a few float32 ulps of 1 in absolute terms, saturating to
    +-1 without NaN."""
    if SOFTCAP:
        scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
    return scores


@triton.jit
def _paged_decode_kernel(
    out,
    q,
    kv,
    block_table,
    context_lens,
    scale,
    window,
    softcap,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One program per (row, KV head): the GROUP query heads sharing that KV head, online softmax
    over the row's pages one page at a time, from the page holding the window's first position
    (``window`` 0: position 0)."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx = tl.load(context_lens + b)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    p = tl.arange(0, BLOCK_P)
    g_mask, d_mask = g < GROUP, d < HEAD_DIM
    heads = kv_head * GROUP + g
    q_ptrs = q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :]
    qv = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32) * scale

    row = KV_HEADS * HEAD_DIM
    page_stride = 2 * BLOCK_SIZE * row
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, dtype=tl.float32)
    num_pages = (ctx + BLOCK_SIZE - 1) // BLOCK_SIZE
    first = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    for j in range(first // BLOCK_SIZE, num_pages):
        page = tl.load(block_table + b.to(tl.int64) * stride_bt + j).to(tl.int64)
        p_mask = (p < BLOCK_SIZE) & (j * BLOCK_SIZE + p < ctx) & (j * BLOCK_SIZE + p >= first)
        offs = page * page_stride + p[:, None] * row + kv_head * HEAD_DIM + d[None, :]
        mask = p_mask[:, None] & d_mask[None, :]
        kt = tl.load(kv + offs, mask=mask, other=0.0).to(tl.float32)  # [P, D]
        scores = _softcap(tl.sum(qv[:, None, :] * kt[None, :, :], axis=2), softcap, SOFTCAP)  # [G, P]
        scores = tl.where(p_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        probs = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(probs, axis=1)
        vt = tl.load(kv + offs + BLOCK_SIZE * row, mask=mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(probs[:, :, None] * vt[None, :, :], axis=1)
        m_i = m_new
    o_ptrs = out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, (acc / l_i[:, None]).to(out.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def paged_decode_attention(
    out: Tensor,
    q: Tensor,
    kv: Tensor,
    block_table: Tensor,
    context_lens: Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """``out[b] = softmax(cap(q[b] @ K_b.T * scale)) @ V_b`` over the first ``context_lens[b]``
    positions, the last ``window`` of them when given.

    As :func:`paged_decode_attention_ref`: one query token per row, K_b and V_b read from the row's
    pages, query head h reading KV head ``h // (H / H_kv)``. Shapes: out and q [B, H, D] (heads
    contiguous; rows may be strided), kv [num_pages, 2, block_size, H_kv, D] contiguous,
    block_table [B, max_blocks] int32 (a row-strided slice is fine), context_lens [B] int32 >= 1.
    """
    assert kv.dim() == 5 and kv.shape[1] == 2 and kv.is_contiguous(), "kv must be [num_pages, 2, block_size, H_kv, D]"
    B, heads, dim = q.shape
    block_size, kv_heads = kv.shape[2], kv.shape[3]
    assert out.shape == q.shape and dim == kv.shape[4] and heads % kv_heads == 0, (
        f"q {tuple(q.shape)} vs kv {tuple(kv.shape)}"
    )
    assert q.stride(2) == 1 and out.stride(2) == 1, "head_dim must be contiguous"
    assert q.dtype == out.dtype and kv.dtype.itemsize <= q.dtype.itemsize, (
        f"q and out must share a dtype, kv no wider; got {q.dtype}, {out.dtype}, {kv.dtype}"
    )
    assert block_table.dim() == 2 and block_table.shape[0] == B and block_table.dtype == torch.int32
    assert block_table.stride(1) == 1, "block_table rows must be contiguous"
    assert context_lens.shape == (B,) and context_lens.dtype == torch.int32 and context_lens.is_contiguous()
    assert len({out.device, q.device, kv.device, block_table.device, context_lens.device}) == 1
    if B == 0:
        return
    group = heads // kv_heads
    _paged_decode_kernel[(B, kv_heads)](
        out,
        q,
        kv,
        block_table,
        context_lens,
        float(scale),
        window or 0,
        float(softcap or 0.0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        GROUP=group,
        KV_HEADS=kv_heads,
        HEAD_DIM=dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=triton.next_power_of_2(group),
        BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_P=triton.next_power_of_2(block_size),
        SOFTCAP=softcap is not None,
    )


@triton.jit
def _dot(a, b, acc, WIDE: tl.constexpr):
    """``acc + a @ b`` in float32; half-precision operands multiply natively on the GPU unless
    ``WIDE`` (interpreted, or a float32 model's queries over half-precision pages)."""
    if WIDE or b.dtype == tl.float32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a.to(b.dtype), b, acc)
    return out


@triton.jit
def _cast(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 ``v`` as ``dtype``, rounded to nearest even as the GPU's cast does."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        v = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _paged_prefill_kernel(
    out,
    q,
    kv,
    block_table,
    tiles,
    scale,
    window,
    softcap,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRETED: tl.constexpr,
    WIDE: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One program per (tile, KV head): BLOCK_M query tokens of one sequence times the GROUP query
    heads sharing that KV head, as BLOCK_M * BLOCK_G rows, online softmax over BLOCK_N context
    positions at a time. ``tiles[i] = (sequence, first query row, end of its rows, context length)``.
    With ``window`` > 0 a query sees only the last ``window`` positions up to its own, and the
    loop starts at the tile's first query's window."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tiles + tile * 4).to(tl.int64)
    q0 = tl.load(tiles + tile * 4 + 1)
    q_end = tl.load(tiles + tile * 4 + 2)
    ctx = tl.load(tiles + tile * 4 + 3)
    r = tl.arange(0, BLOCK_M * BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    t = q0 + r // BLOCK_G  # query row of each tile row
    heads = kv_head * GROUP + r % BLOCK_G
    r_mask = (t < q_end) & (r % BLOCK_G < GROUP)
    d_mask = d < HEAD_DIM
    io_mask = r_mask[:, None] & d_mask[None, :]
    qv = tl.load(
        q + t[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0
    )
    # The sequence's rows, ending at q_end, are the last positions of its context: query row t sits
    # at position ctx - q_end + t and sees every position up to its own.
    last = ctx - q_end + t
    row = KV_HEADS * HEAD_DIM
    page_stride = 2 * BLOCK_SIZE * row
    log2e = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2(e))
    m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M * BLOCK_G], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M * BLOCK_G, BLOCK_D], 0.0, dtype=tl.float32)
    # Without a window every row sees position 0, so after the first block no row's maximum is
    # -inf; with one, a later row may see nothing of the first blocks: m_safe keeps exp2 off -inf - -inf.
    kv_end = ctx - q_end + tl.minimum(q0 + BLOCK_M, q_end)
    kv_start = tl.where(window > 0, tl.maximum(ctx - q_end + q0 - window + 1, 0), 0)
    for start in range(kv_start, kv_end, BLOCK_N):
        pos = start + n
        p_mask = pos < ctx
        page = tl.load(block_table + seq * stride_bt + pos // BLOCK_SIZE, mask=p_mask, other=0).to(tl.int64)
        offs = page[:, None] * page_stride + (pos % BLOCK_SIZE)[:, None] * row + kv_head * HEAD_DIM + d[None, :]
        # other=0: positions past the context may hold another sequence's stale K/V, even NaN.
        mask = p_mask[:, None] & d_mask[None, :]
        kt = tl.load(kv + offs, mask=mask, other=0.0)  # [N, D]
        scores = _dot(qv, tl.trans(kt), tl.zeros([BLOCK_M * BLOCK_G, BLOCK_N], dtype=tl.float32), WIDE)
        visible = p_mask[None, :] & (pos[None, :] <= last[:, None])
        visible &= (window <= 0) | (pos[None, :] > last[:, None] - window)
        scores = tl.where(visible, _softcap(scores * scale, softcap, SOFTCAP) * log2e, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        probs = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(probs, axis=1)
        vt = tl.load(kv + offs + BLOCK_SIZE * row, mask=mask, other=0.0)
        acc = _dot(probs, vt, acc * alpha[:, None], WIDE)
        m_i = m_new
    o_ptrs = out + t[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :]
    # Padding rows past q_end may see no position inside a window (l_i = 0): they are not stored.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    tl.store(o_ptrs, _cast(acc / l_safe[:, None], out.dtype.element_ty, INTERPRETED), mask=io_mask)


def prefill_attention(
    out: Tensor,
    q: Tensor,
    kv: Tensor,
    block_table: Tensor,
    query_starts: list[int],
    context_lens: list[int],
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """``out[rows_i] = softmax(cap(q[rows_i] @ K_i.T * scale) + causal_i) @ V_i`` for each sequence i.

    As :func:`prefill_attention_ref`: sequence i owns query rows ``rows_i = query_starts[i] :
    query_starts[i + 1]``, the last ``n_i`` of its ``context_lens[i]`` positions (their K and V
    already written), and reads K_i, V_i from pages ``block_table[i]``; query j of the chunk sees
    positions ``<= context_lens[i] - n_i + j`` (and ``> context_lens[i] - n_i + j - window`` with a
    window); query head h reads KV head ``h // (H / H_kv)``.
    Shapes: out and q [T, H, D] (heads contiguous; rows may be strided), kv [num_pages, 2,
    block_size, H_kv, D] contiguous, block_table [B, max_blocks] int32 (a row-strided slice is
    fine), query_starts B + 1 ascending host ints, context_lens B host ints with
    ``n_i <= context_lens[i] <= max_blocks * block_size``. Rows no sequence owns are left as they are.
    """
    assert kv.dim() == 5 and kv.shape[1] == 2 and kv.is_contiguous(), "kv must be [num_pages, 2, block_size, H_kv, D]"
    T, heads, dim = q.shape
    block_size, kv_heads = kv.shape[2], kv.shape[3]
    assert out.shape == q.shape and dim == kv.shape[4] and heads % kv_heads == 0, (
        f"q {tuple(q.shape)} vs kv {tuple(kv.shape)}"
    )
    assert q.stride(2) == 1 and out.stride(2) == 1, "head_dim must be contiguous"
    assert q.dtype == out.dtype and kv.dtype.itemsize <= q.dtype.itemsize, (
        f"q and out must share a dtype, kv no wider; got {q.dtype}, {out.dtype}, {kv.dtype}"
    )
    B = len(context_lens)
    assert block_table.dim() == 2 and block_table.shape[0] == B and block_table.dtype == torch.int32, (
        f"block_table must be [{B}, max_blocks] int32; got {tuple(block_table.shape)} {block_table.dtype}"
    )
    assert block_table.stride(1) == 1, "block_table rows must be contiguous"
    assert len({out.device, q.device, kv.device, block_table.device}) == 1, "all tensors must be on one device"
    assert len(query_starts) == B + 1 and 0 <= query_starts[0] and query_starts[-1] <= T, (
        f"query_starts must be {B + 1} offsets into q's {T} rows; got {query_starts}"
    )
    group = heads // kv_heads
    block_g = triton.next_power_of_2(group)
    block_m = max(PREFILL_ROWS // block_g, 1)
    tiles = []
    for i, ctx in enumerate(context_lens):
        start, end = query_starts[i], query_starts[i + 1]
        assert 0 <= end - start <= ctx <= block_table.shape[1] * block_size, (
            f"sequence {i}: {end - start} queries, context {ctx}, {block_table.shape[1]} pages of {block_size}"
        )
        tiles += [(i, t, end, ctx) for t in range(start, end, block_m)]
    if not tiles:
        return
    tile_table = torch.tensor(tiles, dtype=torch.int32, device=q.device)
    _paged_prefill_kernel[(len(tiles), kv_heads)](
        out,
        q,
        kv,
        block_table,
        tile_table,
        float(scale),
        window or 0,
        float(softcap or 0.0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        GROUP=group,
        KV_HEADS=kv_heads,
        HEAD_DIM=dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=block_g,
        BLOCK_M=block_m,
        BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_N=PREFILL_BLOCK_N,
        INTERPRETED=_INTERPRETED,
        WIDE=_INTERPRETED or q.dtype == torch.float32,
        SOFTCAP=softcap is not None,
    )
