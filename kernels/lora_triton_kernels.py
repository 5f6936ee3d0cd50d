"""The Triton programs of :mod:`lorapage.kernels.lora_triton` (its launchers choose the grid and
check shapes): BGMV and SGMV shrink and expand, each reading A and B tiles through a slot's page
table, as one strided run when the pages are consecutive and aligned, else element by element."""

from __future__ import annotations

from lorapage.kernels.triton_import import import_triton

triton = import_triton()
import triton.language as tl  # noqa: E402  (after import_triton picked compiled or interpreted)


@triton.jit
def _span_base(pages, f_lo, f_hi, PAGE: tl.constexpr):
    """Pool element index of flat offset ``f_lo`` if flat ``[f_lo, f_hi)`` lies in consecutive
    pages (page tables are ascending, so first and last page tell), else -1."""
    i0 = f_lo // PAGE
    i1 = (f_hi - 1) // PAGE
    p0 = tl.load(pages + i0).to(tl.int64)
    p1 = tl.load(pages + i1).to(tl.int64)
    return tl.where(p1 - p0 == i1 - i0, p0 * PAGE + f_lo % PAGE, -1)


@triton.jit
def _load_flat(pool, pages, base, f0, rel, mask, DENSE: tl.constexpr, PAGE: tl.constexpr):
    """Elements ``f0 + rel`` of a slot's flat buffer: from ``base + rel`` when DENSE, else page by page."""
    if DENSE:
        values = tl.load(pool + base + rel, mask=mask, other=0.0)
    else:
        f = f0 + rel
        page = tl.load(pages + f // PAGE, mask=mask, other=0).to(tl.int64)
        values = tl.load(pool + page * PAGE + f % PAGE, mask=mask, other=0.0)
    return values


@triton.jit
def _dot(a, b, acc, INTERPRETED: tl.constexpr):
    # a is the activations: float32 ones (over pages of any dtype, --lora-dtype) multiply in float32.
    if INTERPRETED or a.dtype == tl.float32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
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
def _module_bounds(m, o0, o1, o2, w0, w1, w2):
    """(first column in y, width) of module ``m`` of the group."""
    o = tl.where(m == 0, o0, tl.where(m == 1, o1, o2))
    w = tl.where(m == 0, w0, tl.where(m == 1, w1, w2))
    return o, w


@triton.jit
def _gemv_rows(
    x_row,
    pool,
    pages,
    base,
    f0,
    n_rows,
    d_in,
    DENSE: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``A[:n_rows] @ x`` in float32, A being ``n_rows x d_in`` at flat offset f0."""
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, d_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < d_in
        xv = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)
        mask = (r[:, None] < n_rows) & k_mask[None, :]
        a = _load_flat(pool, pages, base, f0, r[:, None] * d_in + k[None, :], mask, DENSE, PAGE)
        acc += tl.sum(a.to(tl.float32) * xv[None, :], axis=1)
    return acc


@triton.jit
def _bgmv_shrink_kernel(
    h,
    x,
    pool,
    page_table,
    token_slot,
    a_offset,
    a_rows,
    d_in,
    stride_h,
    stride_x,
    stride_pt,
    stride_tab,
    PAGE: tl.constexpr,
    ALIGN: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(token_slot + t)
    if slot == 0:
        return
    rows = tl.load(a_rows + slot * stride_tab)
    a_start = tl.load(a_offset + slot * stride_tab)
    pages = page_table + slot.to(tl.int64) * stride_pt
    x_row = x + t.to(tl.int64) * stride_x
    r = tl.arange(0, BLOCK_R)
    # The grid's second axis is fixed (graph-safe); its programs take turns over the row blocks,
    # so the grid does not grow with the largest rank h can hold.
    for r0 in range(tl.program_id(1) * BLOCK_R, rows, tl.num_programs(1) * BLOCK_R):
        n_rows = tl.minimum(rows - r0, BLOCK_R)
        f0 = a_start + r0 * d_in
        base = _span_base(pages, f0, f0 + n_rows * d_in, PAGE)
        if (base >= 0) & (base % ALIGN == 0) & (d_in % ALIGN == 0):
            base = (base // ALIGN) * ALIGN  # == base here; says so to the compiler (vector loads)
            acc = _gemv_rows(x_row, pool, pages, base, f0, n_rows, d_in, True, PAGE, BLOCK_R, BLOCK_K)
        else:
            acc = _gemv_rows(x_row, pool, pages, base, f0, n_rows, d_in, False, PAGE, BLOCK_R, BLOCK_K)
        tl.store(h + t.to(tl.int64) * stride_h + r0 + r, _cast(acc, h.dtype.element_ty, INTERPRETED), mask=r < n_rows)


@triton.jit
def _gemm_rows(
    x,
    t,
    t_mask,
    stride_x,
    pool,
    pages,
    base,
    f0,
    n_rows,
    d_in,
    DENSE: tl.constexpr,
    PAGE: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``x[t] @ A[:n_rows].T`` in float32 for a block of tokens t."""
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, d_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < d_in
        xt = tl.load(
            x + t[:, None].to(tl.int64) * stride_x + k[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0
        )
        mask = k_mask[:, None] & (r[None, :] < n_rows)
        a_t = _load_flat(pool, pages, base, f0, r[None, :] * d_in + k[:, None], mask, DENSE, PAGE)  # [K, R]
        acc = _dot(xt, a_t, acc, INTERPRETED)
    return acc


@triton.jit
def _sgmv_shrink_kernel(
    h,
    x,
    pool,
    page_table,
    segment_table,
    a_offset,
    a_rows,
    d_in,
    stride_h,
    stride_x,
    stride_pt,
    stride_tab,
    PAGE: tl.constexpr,
    ALIGN: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    seg = segment_table + tl.program_id(0) * 3
    start, end, slot = tl.load(seg), tl.load(seg + 1), tl.load(seg + 2)
    t0 = start + tl.program_id(1) * BLOCK_T
    r0 = tl.program_id(2) * BLOCK_R
    rows = tl.load(a_rows + slot * stride_tab)
    if (t0 >= end) | (r0 >= rows):
        return
    n_rows = tl.minimum(rows - r0, BLOCK_R)
    f0 = tl.load(a_offset + slot * stride_tab) + r0 * d_in
    pages = page_table + slot.to(tl.int64) * stride_pt
    base = _span_base(pages, f0, f0 + n_rows * d_in, PAGE)
    t = t0 + tl.arange(0, BLOCK_T)
    t_mask = t < end
    if (base >= 0) & (base % ALIGN == 0) & (d_in % ALIGN == 0):
        base = (base // ALIGN) * ALIGN  # == base here; says so to the compiler (vector loads)
        acc = _gemm_rows(
            x,
            t,
            t_mask,
            stride_x,
            pool,
            pages,
            base,
            f0,
            n_rows,
            d_in,
            True,
            PAGE,
            INTERPRETED,
            BLOCK_T,
            BLOCK_R,
            BLOCK_K,
        )
    else:
        acc = _gemm_rows(
            x,
            t,
            t_mask,
            stride_x,
            pool,
            pages,
            base,
            f0,
            n_rows,
            d_in,
            False,
            PAGE,
            INTERPRETED,
            BLOCK_T,
            BLOCK_R,
            BLOCK_K,
        )
    r = tl.arange(0, BLOCK_R)
    ptrs = h + t[:, None].to(tl.int64) * stride_h + r0 + r[None, :]
    tl.store(ptrs, _cast(acc, h.dtype.element_ty, INTERPRETED), mask=t_mask[:, None] & (r[None, :] < n_rows))


@triton.jit
def _gemv_cols(
    h_row,
    pool,
    pages,
    base,
    f0,
    n_cols,
    r,
    DENSE: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
):
    """``B[:n_cols] @ h_row[:r]`` in float32, B being ``n_cols x r`` at flat offset f0."""
    n = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j0 in range(0, r, BLOCK_RANK):
        j = j0 + tl.arange(0, BLOCK_RANK)
        j_mask = j < r
        hv = tl.load(h_row + j, mask=j_mask, other=0.0).to(tl.float32)
        mask = (n[:, None] < n_cols) & j_mask[None, :]
        b = _load_flat(pool, pages, base, f0, n[:, None] * r + j[None, :], mask, DENSE, PAGE)
        acc += tl.sum(b.to(tl.float32) * hv[None, :], axis=1)
    return acc


@triton.jit
def _bgmv_expand_kernel(
    y,
    h,
    pool,
    page_table,
    token_slot,
    b_offset,
    rank,
    h_start,
    scale,
    o0,
    o1,
    o2,
    w0,
    w1,
    w2,
    n_blocks,
    stride_y,
    stride_h,
    stride_pt,
    stride_tab,
    stride_mod,
    PAGE: tl.constexpr,
    ALIGN: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
):
    t = tl.program_id(0)
    m = tl.program_id(1) // n_blocks
    n0 = (tl.program_id(1) % n_blocks) * BLOCK_N
    slot = tl.load(token_slot + t)
    if slot == 0:
        return
    o, w = _module_bounds(m, o0, o1, o2, w0, w1, w2)
    tab = slot * stride_tab + m * stride_mod
    r = tl.load(rank + tab)
    if (r == 0) | (n0 >= w):
        return
    n_cols = tl.minimum(w - n0, BLOCK_N)
    f0 = tl.load(b_offset + tab) + n0 * r
    pages = page_table + slot.to(tl.int64) * stride_pt
    base = _span_base(pages, f0, f0 + n_cols * r, PAGE)
    h_row = h + t.to(tl.int64) * stride_h + tl.load(h_start + tab)
    if (base >= 0) & (base % ALIGN == 0) & (r % ALIGN == 0):
        base = (base // ALIGN) * ALIGN  # == base and r here; says so to the compiler (vector loads)
        acc = _gemv_cols(h_row, pool, pages, base, f0, n_cols, (r // ALIGN) * ALIGN, True, PAGE, BLOCK_N, BLOCK_RANK)
    else:
        acc = _gemv_cols(h_row, pool, pages, base, f0, n_cols, r, False, PAGE, BLOCK_N, BLOCK_RANK)
    n = tl.arange(0, BLOCK_N)
    ptrs = y + t.to(tl.int64) * stride_y + o + n0 + n
    old = tl.load(ptrs, mask=n < n_cols, other=0.0).to(tl.float32)
    new = old + tl.load(scale + tab) * acc
    tl.store(ptrs, _cast(new, y.dtype.element_ty, INTERPRETED), mask=n < n_cols)


@triton.jit
def _gemm_cols(
    h,
    t,
    t_mask,
    stride_h,
    hs,
    pool,
    pages,
    base,
    f0,
    n_cols,
    r,
    DENSE: tl.constexpr,
    PAGE: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
):
    """``h[t, hs:hs+r] @ B[:n_cols].T`` in float32 for a block of tokens t."""
    n = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for j0 in range(0, r, BLOCK_RANK):
        j = j0 + tl.arange(0, BLOCK_RANK)
        j_mask = j < r
        ht = tl.load(
            h + t[:, None].to(tl.int64) * stride_h + hs + j[None, :], mask=t_mask[:, None] & j_mask[None, :], other=0.0
        )
        mask = j_mask[:, None] & (n[None, :] < n_cols)
        b_t = _load_flat(pool, pages, base, f0, n[None, :] * r + j[:, None], mask, DENSE, PAGE)  # [RANK, N]
        acc = _dot(ht, b_t, acc, INTERPRETED)
    return acc


@triton.jit
def _sgmv_expand_kernel(
    y,
    h,
    pool,
    page_table,
    segment_table,
    b_offset,
    rank,
    h_start,
    scale,
    o0,
    o1,
    o2,
    w0,
    w1,
    w2,
    n_blocks,
    stride_y,
    stride_h,
    stride_pt,
    stride_tab,
    stride_mod,
    PAGE: tl.constexpr,
    ALIGN: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
):
    seg = segment_table + tl.program_id(0) * 3
    start, end, slot = tl.load(seg), tl.load(seg + 1), tl.load(seg + 2)
    t0 = start + tl.program_id(1) * BLOCK_T
    m = tl.program_id(2) // n_blocks
    n0 = (tl.program_id(2) % n_blocks) * BLOCK_N
    o, w = _module_bounds(m, o0, o1, o2, w0, w1, w2)
    tab = slot * stride_tab + m * stride_mod
    r = tl.load(rank + tab)
    if (t0 >= end) | (r == 0) | (n0 >= w):
        return
    n_cols = tl.minimum(w - n0, BLOCK_N)
    f0 = tl.load(b_offset + tab) + n0 * r
    pages = page_table + slot.to(tl.int64) * stride_pt
    base = _span_base(pages, f0, f0 + n_cols * r, PAGE)
    hs = tl.load(h_start + tab)
    t = t0 + tl.arange(0, BLOCK_T)
    t_mask = t < end
    if (base >= 0) & (base % ALIGN == 0) & (r % ALIGN == 0):
        base = (base // ALIGN) * ALIGN  # == base and r here; says so to the compiler (vector loads)
        acc = _gemm_cols(
            h,
            t,
            t_mask,
            stride_h,
            hs,
            pool,
            pages,
            base,
            f0,
            n_cols,
            (r // ALIGN) * ALIGN,
            True,
            PAGE,
            INTERPRETED,
            BLOCK_T,
            BLOCK_N,
            BLOCK_RANK,
        )
    else:
        acc = _gemm_cols(
            h,
            t,
            t_mask,
            stride_h,
            hs,
            pool,
            pages,
            base,
            f0,
            n_cols,
            r,
            False,
            PAGE,
            INTERPRETED,
            BLOCK_T,
            BLOCK_N,
            BLOCK_RANK,
        )
    n = tl.arange(0, BLOCK_N)
    ptrs = y + t[:, None].to(tl.int64) * stride_y + o + n0 + n[None, :]
    mask = t_mask[:, None] & (n[None, :] < n_cols)
    old = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    new = old + tl.load(scale + tab) * acc
    tl.store(ptrs, _cast(new, y.dtype.element_ty, INTERPRETED), mask=mask)
