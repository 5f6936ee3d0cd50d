/* The CPU LoRA kernels' body, included by lora_cpu.c once per weight type. Not a header of its
 * own: it expects, defined by the includer,
 *   W          the type of a weight in the pool's pages (float; uint16_t for bfloat16 and float16; int8_t)
 *   F(name)    this weight type's name for a function (name_f32, name_bf16, name_f16, name_i8)
 *   LDW(p)     8 weights at p as a v8 of floats
 *   ROW16(p, h0, h1), H16(hv, &h0, &h1)
 *              a rank-16 row of weights at p against h as 8 partial sums (an __m256), with h0
 *              and h1 made from h by H16
 *   TOF(v)     one weight as a float
 *   RANK16     1 where this weight type's rank-16 expand has its AVX path (ROW16 defined)
 *   NARROW     1 for weights narrower than float32: cells of WIDEN_TOKENS or more widen their
 *              blocks into float32 once and run the _f32 loops (defined by the first include)
 *   SCALED     1 for int8 weights: each matrix's float32 scales follow it (SCALES_AT), one per A
 *              row (applied to the shrink's sums) and per B column (folded into h); B is stored
 *              transposed, [r, d_out], and its expand sums r scaled rows (expand_cols)
 * Activations, products and sums are float32 for every W.
 */

static inline float F(dot)(const W *a, const float *x, int64_t d) {
    v8 s = {0};
    int64_t k = 0;
    for (; k + 8 <= d; k += 8) s += LDW(a + k) * ld(x + k);
    float r = hsum(s);
    for (; k < d; k++) r += TOF(a[k]) * x[k];
    return r;
}

/* One slot's flat buffer, read through its page table row. */
typedef struct {
    const W *slab;
    int64_t page_stride; /* elements between pages in the slab */
    int64_t page;        /* elements per page */
    const int32_t *pages;
} F(Buffer);

static int F(is_run)(const F(Buffer) *b, int64_t off, int64_t n) {
    int64_t first = off / b->page, last = (off + n - 1) / b->page;
    return (int64_t)b->pages[last] - b->pages[first] == last - first;
}

/* Elements [off, off + n): in place when their pages are one run, else copied into scratch. */
static const W *F(span)(const F(Buffer) *b, int64_t off, int64_t n, W **scratch, int64_t max_numel) {
    int64_t first = off / b->page;
    if (F(is_run)(b, off, n)) return b->slab + (int64_t)b->pages[first] * b->page_stride + (off - first * b->page);
    if (!*scratch) *scratch = malloc((size_t)max_numel * sizeof(W));
    for (int64_t done = 0, e = off; done < n;) {
        int64_t o = e % b->page, take = b->page - o;
        if (take > n - done) take = n - done;
        memcpy(*scratch + done, b->slab + (int64_t)b->pages[e / b->page] * b->page_stride + o,
               (size_t)take * sizeof(W));
        done += take;
        e += take;
    }
    return *scratch;
}

#if SCALED
/* n float32 scales at element off of the slot's buffer, into out: 4-byte words, each within one
 * page (pages are whole words), the run crossing pages where the buffer does. */
static void F(read_scales)(const F(Buffer) *b, int64_t off, int64_t n, float *out) {
    char *dst = (char *)out;
    for (int64_t done = 0, e = off, bytes = n * (int64_t)sizeof(float); done < bytes;) {
        int64_t o = e % b->page, take = b->page - o;
        if (take > bytes - done) take = bytes - done;
        memcpy(dst + done, b->slab + (int64_t)b->pages[e / b->page] * b->page_stride + o, (size_t)take);
        done += take;
        e += take;
    }
}

/* The shrink's rows [i0, i0 + rows) of a slot's A: their scales, into out. */
static void F(row_scales)(const F(Buffer) *b, int64_t a_off, int64_t a_rows, int64_t d, int64_t i0, int64_t rows,
                          float *out) {
    F(read_scales)(b, SCALES_AT(a_off, a_rows * d) + i0 * (int64_t)sizeof(float), rows, out);
}

static inline void F(scale_rows)(float *h, const float *s, int64_t rows) {
    for (int64_t i = 0; i < rows; i++) h[i] *= s[i];
}
#endif

/* 4 rows of a (row stride d) against one token: 4 independent sums, so loads overlap. */
static inline void F(rows4_tok1)(const W *a, int64_t d, const float *x, float *out) {
    v8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    for (int64_t k = 0; k < d; k += 8) {
        if (k % (64 / sizeof(W)) == 0) /* the 4 rows' next 2 KB, into L2 (see rows2_tok4) */
            for (int j = 0; j < 4; j++) __builtin_prefetch((const char *)(a + j * d + k) + 2048, 0, 1);
        v8 xv = ld(x + k);
        s0 += LDW(a + k) * xv;
        s1 += LDW(a + d + k) * xv;
        s2 += LDW(a + 2 * d + k) * xv;
        s3 += LDW(a + 3 * d + k) * xv;
    }
    out[0] = hsum(s0), out[1] = hsum(s1), out[2] = hsum(s2), out[3] = hsum(s3);
}

/* 2 rows of a against 4 tokens: each row is loaded once for the 4. */
static inline void F(rows2_tok4)(const W *a, int64_t d, const float *const x[4], float out[2][4]) {
    v8 s[2][4] = {{{0}}};
    for (int64_t k = 0; k < d; k += 8) {
        /* The rows 4 ahead, asked for now (past the matrix's end too: a prefetch never faults),
         * into L2 (locality 1) as every prefetch here: asked into L1, the lines' requests likely
         * took the few L1 miss buffers the loads wait on (a step's expand over 24 adapters'
         * float32 pages ran 11.2 ms that way, 7.6-8.1 into L2: bench/RESULTS.md, round 4 session 10). */
        if (k % (64 / sizeof(W)) == 0) __builtin_prefetch(a + 4 * d + k, 0, 1), __builtin_prefetch(a + 5 * d + k, 0, 1);
        v8 a0 = LDW(a + k), a1 = LDW(a + d + k);
        for (int j = 0; j < 4; j++) {
            v8 xv = ld(x[j] + k);
            s[0][j] += a0 * xv;
            s[1][j] += a1 * xv;
        }
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) out[i][j] = hsum(s[i][j]);
}

static void F(shrink_cell)(float *h, int64_t hs, const float *x, int64_t xs, int64_t d, const W *a, int64_t rows,
                           const int64_t *tok, int64_t nt) {
    int64_t i = 0;
    if (d % 8) {
        for (int64_t t = 0; t < nt; t++)
            for (i = 0; i < rows; i++) h[tok[t] * hs + i] = F(dot)(a + i * d, x + tok[t] * xs, d);
        return;
    }
    if (nt == 1) {
        const float *xt = x + tok[0] * xs;
        float *ht = h + tok[0] * hs;
        for (; i + 4 <= rows; i += 4) F(rows4_tok1)(a + i * d, d, xt, ht + i);
        for (; i < rows; i++) ht[i] = F(dot)(a + i * d, xt, d);
        return;
    }
    for (int64_t t = 0; t < nt; t += 4) {
        int64_t n = nt - t < 4 ? nt - t : 4;
        const float *xp[4];
        for (int j = 0; j < 4; j++) xp[j] = x + tok[t + (j < n ? j : 0)] * xs; /* padding repeats a token */
        float o[2][4];
        for (i = 0; i + 2 <= rows; i += 2) {
            F(rows2_tok4)(a + i * d, d, xp, o);
            for (int j = 0; j < n; j++) h[tok[t + j] * hs + i] = o[0][j], h[tok[t + j] * hs + i + 1] = o[1][j];
        }
        for (; i < rows; i++)
            for (int j = 0; j < n; j++) h[tok[t + j] * hs + i] = F(dot)(a + i * d, xp[j], d);
    }
}

#if NARROW
/* n weights at a, widened into float32 at out. */
static void F(widen)(const W *a, int64_t n, float *out) {
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) *(v8u *)(out + k) = LDW(a + k);
    for (; k < n; k++) out[k] = TOF(a[k]);
}

/* Per-thread float32 room for one block of widened weights, made on first use. */
static const float *F(widened)(const W *a, int64_t n, float **room, int64_t max_numel) {
    if (!*room) *room = malloc((size_t)max_numel * sizeof(float));
    if (!*room) return NULL;
    F(widen)(a, n, *room);
    return *room;
}
#endif

/* Stripes in lockstep (see STRIPES): row i of each stripe's A against the stripe's token, for
 * i < rows. Every stripe is filled (padding repeats stripe 0 and writes elsewhere). d % 8 == 0. */
static void F(shrink_stripes)(const W *const a[STRIPES], const float *const x[STRIPES], float *const h[STRIPES], int64_t d,
                            int64_t rows) {
    for (int64_t i = 0; i < rows; i++) {
        v8 s[STRIPES] = {{0}};
        for (int64_t k = 0; k < d; k += 8) {
            if (k % (64 / sizeof(W)) == 0) /* each stripe's next 2 KB, into L2 (as expand_rank16) */
#pragma GCC unroll 8
                for (int e = 0; e < STRIPES; e++) __builtin_prefetch((const char *)(a[e] + i * d + k) + 2048, 0, 1);
#pragma GCC unroll 8 /* STRIPES: the sums stay in registers */
            for (int e = 0; e < STRIPES; e++) s[e] += LDW(a[e] + i * d + k) * ld(x[e] + k);
        }
        for (int e = 0; e < STRIPES; e++) h[e][i] = hsum(s[e]);
    }
}

void F(lora_shrink)(float *h, int64_t h_stride, const float *x, int64_t x_stride, int64_t d_in, const W *slab,
                     int64_t page_stride, int64_t page, const int32_t *page_table, int64_t pt_stride, int64_t n_cells,
                     const int64_t *cell_slot, const int64_t *cell_begin, const int64_t *tokens,
                     const int64_t *a_offset, int64_t ao_stride, const int32_t *a_rows, int64_t ar_stride,
                     int64_t max_rows, int nthreads) {
    int64_t blocks = (max_rows + SHRINK_ROWS - 1) / SHRINK_ROWS;
    /* A pack's stripes share their A's row count, so they run the same rows in lockstep. */
    Plan plan = plan_stripes(d_in % 8 == 0, n_cells, cell_slot, cell_begin, tokens, a_rows, ar_stride);
    int64_t tasks = plan.n_big + plan.n_packs;
#pragma omp parallel num_threads(nthreads)
    {
        W *scratch = NULL;
        float *room = NULL; /* widened weights (NARROW) */
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            for (int64_t blk = 0; blk < blocks; blk++) {
                int64_t i0 = blk * SHRINK_ROWS;
                if (task < plan.n_big) { /* a cell alone */
                    int64_t c = plan.big ? plan.big[task] : task;
                    int64_t s = cell_slot[c], rows = a_rows[s * ar_stride] - i0;
                    if (rows <= 0) continue;
                    if (rows > SHRINK_ROWS) rows = SHRINK_ROWS;
                    F(Buffer) b = {slab, page_stride, page, page_table + s * pt_stride};
                    const W *a = F(span)(&b, a_offset[s * ao_stride] + i0 * d_in, rows * d_in, &scratch,
                                         SHRINK_ROWS * d_in);
                    int64_t nt = cell_begin[c + 1] - cell_begin[c];
                    const float *wide = NULL;
#if NARROW
                    if (nt >= WIDEN_TOKENS) wide = F(widened)(a, rows * d_in, &room, SHRINK_ROWS * d_in);
#endif
                    if (wide)
                        shrink_cell_f32(h + i0, h_stride, x, x_stride, d_in, wide, rows, tokens + cell_begin[c], nt);
                    else
                        F(shrink_cell)(h + i0, h_stride, x, x_stride, d_in, a, rows, tokens + cell_begin[c], nt);
#if SCALED
                    float sa[SHRINK_ROWS];
                    F(row_scales)(&b, a_offset[s * ao_stride], a_rows[s * ar_stride], d_in, i0, rows, sa);
                    for (int64_t t = cell_begin[c]; t < cell_begin[c + 1]; t++)
                        F(scale_rows)(h + tokens[t] * h_stride + i0, sa, rows);
#endif
                    continue;
                }
                const Stripe *stripes = plan.stripes + plan.pack_begin[task - plan.n_big];
                int64_t n_stripes = plan.pack_begin[task - plan.n_big + 1] - plan.pack_begin[task - plan.n_big];
                int64_t rows = a_rows[stripes[0].slot * ar_stride] - i0;
                if (rows <= 0) continue;
                if (rows > SHRINK_ROWS) rows = SHRINK_ROWS;
                const W *a[STRIPES];
                const float *xl[STRIPES];
                float *hl[STRIPES], dummy[SHRINK_ROWS];
                int64_t tl[STRIPES]; /* each stripe's token row */
#if SCALED
                float sa[STRIPES][SHRINK_ROWS]; /* each stripe's row scales */
#endif
                int n = 0;
                for (int64_t l = 0; l < n_stripes; l++) {
                    int64_t s = stripes[l].slot, off = a_offset[s * ao_stride] + i0 * d_in;
                    F(Buffer) b = {slab, page_stride, page, page_table + s * pt_stride};
                    const W *al = F(span)(&b, off, rows * d_in, &scratch, SHRINK_ROWS * d_in);
#if SCALED
                    F(row_scales)(&b, a_offset[s * ao_stride], a_rows[s * ar_stride], d_in, i0, rows, sa[n]);
#endif
                    if (al == scratch) { /* its pages are not one run: it runs alone, from the copy */
                        F(shrink_cell)(h + i0, h_stride, x, x_stride, d_in, al, rows, &stripes[l].token, 1);
#if SCALED
                        F(scale_rows)(h + stripes[l].token * h_stride + i0, sa[n], rows);
#endif
                        continue;
                    }
                    a[n] = al, tl[n] = stripes[l].token;
                    xl[n] = x + tl[n] * x_stride, hl[n] = h + tl[n] * h_stride + i0;
                    n++;
                }
                if (n <= 2) { /* too few to be worth the padding: one by one */
                    for (int e = 0; e < n; e++) F(shrink_cell)(h + i0, h_stride, x, x_stride, d_in, a[e], rows, &tl[e], 1);
                } else {
                    for (int e = n; e < STRIPES; e++) a[e] = a[0], xl[e] = xl[0], hl[e] = dummy;
                    F(shrink_stripes)(a, xl, hl, d_in, rows);
                }
#if SCALED
                for (int e = 0; e < n; e++) F(scale_rows)(hl[e], sa[e], rows);
#endif
            }
        }
        free(scratch);
        free(room);
    }
    free_plan(&plan);
}

#if RANK16
/* Rank 16, 8 rows of b at a time: each row is two vectors against h. */
static inline int64_t F(expand_rank16)(float *yt, const W *b, int64_t w, const float *hv) {
    __m256 h0, h1;
    H16(hv, &h0, &h1);
    int64_t j = 0;
    for (; j + 8 <= w; j += 8) {
        const W *bj = b + j * 16;
        for (int64_t ahead = 0; ahead < 8 * 16 * (int64_t)sizeof(W); ahead += 64) /* 8 blocks on (unfaulting) */
            __builtin_prefetch((const char *)(bj + 8 * 8 * 16) + ahead, 0, 1);
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = ROW16(bj + 16 * i, h0, h1);
        __m256 sum = sums8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
        _mm256_storeu_ps(yt + j, _mm256_add_ps(_mm256_loadu_ps(yt + j), sum));
    }
    return j;
}
#else
static inline int64_t F(expand_rank16)(float *yt, const W *b, int64_t w, const float *hv) {
    (void)yt, (void)b, (void)w, (void)hv;
    return 0;
}
#endif

/* yt[j] += b[j, :] . hv for j < w, b [w, r] row-major. */
static inline void F(expand_rows)(float *yt, const W *b, int64_t w, int64_t r, const float *hv) {
    int64_t j = r == 16 ? F(expand_rank16)(yt, b, w, hv) : 0; /* the common rank */
    for (; j < w; j++) yt[j] += F(dot)(b + j * r, hv, r);
}

#if SCALED
/* yt[j] += sum_k bt[k * stride + j] * hv[k] for j < w: B transposed ([r, W] with row stride
 * ``stride``), so its outputs are r int8 rows times a broadcast value each: vertical FMAs, no
 * horizontal sums (the [w, r] layout's rank-16 path spends most of its shuffles on those). Row by
 * row, so B^T is read front to back (the prefetchers' one stream; across rows at once, the r
 * streams a row apart ran 1.4x slower) while the w outputs stay in L1. Each output adds its r
 * products in order onto y, as expand_rows does. */
static void F(expand_cols)(float *yt, const W *bt, int64_t stride, int64_t w, int64_t r, const float *hv) {
    for (int64_t k = 0; k < r; k++) {
        const W *row = bt + k * stride;
        v8 hk = (v8){0} + hv[k];
        int64_t j = 0;
        for (; j + 16 <= w; j += 16) {
            *(v8u *)(yt + j) = ld(yt + j) + LDW(row + j) * hk;
            *(v8u *)(yt + j + 8) = ld(yt + j + 8) + LDW(row + j + 8) * hk;
        }
        for (; j + 8 <= w; j += 8) *(v8u *)(yt + j) = ld(yt + j) + LDW(row + j) * hk;
        for (; j < w; j++) yt[j] += TOF(row[j]) * hv[k];
    }
}
/* A block of w outputs from j0 of B^T [r, wm] at off: elements [off + j0, off + j0 + (r - 1) wm + w). */
#define B_SPAN(off, j0, w, r, wm) (off) + (j0), ((r) - 1) * (wm) + (w)
#define B_ROOM(max_rank, widest) ((max_rank) * (widest))
#define EXPAND_BLOCK(yt, b, w, r, hv, wm) F(expand_cols)(yt, b, wm, w, r, hv)
#else
/* A block of w outputs from j0 of B [wm, r] at off: its rows [j0, j0 + w). */
#define B_SPAN(off, j0, w, r, wm) (off) + (j0) * (r), (w) * (r)
#define B_ROOM(max_rank, widest) (EXPAND_ROWS * (max_rank))
#define EXPAND_BLOCK(yt, b, w, r, hv, wm) ((void)(wm), F(expand_rows)(yt, b, w, r, hv))

/* Stripes in lockstep (see STRIPES): yl[e][j] += bl[e][j, :] . hl[e] for j < w, 8 rows of each stripe in turn. */
static void F(expand_stripes)(float *const yl[STRIPES], const W *const bl[STRIPES], const float *const hl[STRIPES],
                            const int64_t r[STRIPES], int n, int64_t w) {
    for (int64_t j = 0; j < w; j += 8) {
        int64_t m = w - j < 8 ? w - j : 8;
        for (int e = 0; e < n; e++) F(expand_rows)(yl[e] + j, bl[e] + j * r[e], m, r[e], hl[e]);
    }
}
#endif

void F(lora_expand)(float *y, int64_t y_stride, const float *h, int64_t h_stride, const W *slab,
                     int64_t page_stride, int64_t page, const int32_t *page_table, int64_t pt_stride, int64_t n_cells,
                     const int64_t *cell_slot, const int64_t *cell_begin, const int64_t *tokens, int64_t n_modules,
                     const int64_t *bounds, const int64_t *b_offset, const int32_t *rank, const int32_t *h_start,
                     const float *scale, int64_t tab_stride, int64_t max_rank, int nthreads) {
    int64_t widest = 0;
    for (int64_t m = 0; m < n_modules; m++)
        if (bounds[m + 1] - bounds[m] > widest) widest = bounds[m + 1] - bounds[m];
    /* Blocks of outputs a task takes; int8's B^T: whole rows, read front to back (expand_cols). */
    int64_t block = SCALED && widest > 0 ? widest : EXPAND_ROWS, blocks = (widest + block - 1) / block;
    Plan plan = plan_stripes(1, n_cells, cell_slot, cell_begin, tokens, NULL, 0);
    int64_t tasks = plan.n_big + plan.n_packs;
#pragma omp parallel num_threads(nthreads)
    {
        W *scratch = NULL;
        float *room = NULL; /* widened weights (NARROW) */
#pragma omp for collapse(3) schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            for (int64_t m = 0; m < n_modules; m++) {
                for (int64_t blk = 0; blk < blocks; blk++) {
                    int64_t j0 = blk * block, w = bounds[m + 1] - bounds[m] - j0;
                    if (w <= 0) continue;
                    if (w > block) w = block;
                    if (task < plan.n_big) { /* a cell alone */
                        int64_t c = plan.big ? plan.big[task] : task;
                        int64_t s = cell_slot[c], at = s * tab_stride + m, r = rank[at];
                        if (r == 0) continue;
                        F(Buffer) buf = {slab, page_stride, page, page_table + s * pt_stride};
                        int64_t wm = bounds[m + 1] - bounds[m];
                        const W *bm = F(span)(&buf, B_SPAN(b_offset[at], j0, w, r, wm), &scratch, B_ROOM(max_rank, widest));
                        float hv[r], sb[r]; /* sb: B's column scales (SCALED), else ones */
#if SCALED
                        F(read_scales)(&buf, SCALES_AT(b_offset[at], (bounds[m + 1] - bounds[m]) * r), r, sb);
#else
                        for (int64_t k = 0; k < r; k++) sb[k] = 1.0f;
#endif
#if NARROW && !SCALED
                        const float *wide = cell_begin[c + 1] - cell_begin[c] >= WIDEN_TOKENS
                                                ? F(widened)(bm, w * r, &room, EXPAND_ROWS * max_rank)
                                                : NULL;
#endif
                        for (int64_t t = cell_begin[c]; t < cell_begin[c + 1]; t++) {
                            const float *ht = h + tokens[t] * h_stride + h_start[at];
                            for (int64_t k = 0; k < r; k++) hv[k] = scale[at] * ht[k] * sb[k];
                            float *yt = y + tokens[t] * y_stride + bounds[m] + j0;
#if NARROW && !SCALED
                            if (wide) {
                                expand_rows_f32(yt, wide, w, r, hv);
                                continue;
                            }
#endif
                            EXPAND_BLOCK(yt, bm, w, r, hv, wm);
                        }
                        continue;
                    }
                    const Stripe *stripes = plan.stripes + plan.pack_begin[task - plan.n_big];
                    int64_t n_stripes = plan.pack_begin[task - plan.n_big + 1] - plan.pack_begin[task - plan.n_big];
                    float hvs[STRIPES * max_rank];
                    float *yl[STRIPES];
                    const W *bl[STRIPES];
                    const float *hl[STRIPES];
                    int64_t rl[STRIPES];
                    int n = 0;
                    for (int64_t l = 0; l < n_stripes; l++) {
                        int64_t s = stripes[l].slot, at = s * tab_stride + m, r = rank[at];
                        if (r == 0) continue;
                        float *hv = hvs + n * max_rank, *yt = y + stripes[l].token * y_stride + bounds[m] + j0;
                        const float *ht = h + stripes[l].token * h_stride + h_start[at];
                        F(Buffer) buf = {slab, page_stride, page, page_table + s * pt_stride};
#if SCALED
                        F(read_scales)(&buf, SCALES_AT(b_offset[at], (bounds[m + 1] - bounds[m]) * r), r, hv);
                        for (int64_t k = 0; k < r; k++) hv[k] = scale[at] * ht[k] * hv[k];
#else
                        for (int64_t k = 0; k < r; k++) hv[k] = scale[at] * ht[k];
#endif
                        int64_t wm = bounds[m + 1] - bounds[m];
                        const W *bm = F(span)(&buf, B_SPAN(b_offset[at], j0, w, r, wm), &scratch, B_ROOM(max_rank, widest));
                        if (bm == scratch) { /* its pages are not one run: it runs alone, from the copy */
                            EXPAND_BLOCK(yt, bm, w, r, hv, wm);
                            continue;
                        }
                        yl[n] = yt, bl[n] = bm, hl[n] = hv, rl[n] = r;
                        n++;
                    }
#if SCALED /* one stripe after another: each reads r rows of B^T at once already */
                    for (int e = 0; e < n; e++) F(expand_cols)(yl[e], bl[e], bounds[m + 1] - bounds[m], w, rl[e], hl[e]);
#else
                    F(expand_stripes)(yl, bl, hl, rl, n, w);
#endif
                }
            }
        }
        free(scratch);
        free(room);
    }
    free_plan(&plan);
}

/* One group of one layer, shrink then expand, in one call: one crossing from Python a group instead
 * of two, and h never leaves this call between the two (issue 40, item 4). Same arguments as the
 * two, in their order, the cells and pages once; the A tables, then the B tables; the highest
 * rank bounds both h's width and the rows an A has. */
void F(lora_group)(float *y, int64_t y_stride, float *h, int64_t h_stride, const float *x, int64_t x_stride,
                   int64_t d_in, const W *slab, int64_t page_stride, int64_t page, const int32_t *page_table,
                   int64_t pt_stride, int64_t n_cells, const int64_t *cell_slot, const int64_t *cell_begin,
                   const int64_t *tokens, const int64_t *a_offset, int64_t ao_stride, const int32_t *a_rows,
                   int64_t ar_stride, int64_t n_modules, const int64_t *bounds, const int64_t *b_offset,
                   const int32_t *rank, const int32_t *h_start, const float *scale, int64_t tab_stride,
                   int64_t max_rank, int nthreads) {
    F(lora_shrink)(h, h_stride, x, x_stride, d_in, slab, page_stride, page, page_table, pt_stride, n_cells, cell_slot,
                   cell_begin, tokens, a_offset, ao_stride, a_rows, ar_stride, max_rank, nthreads);
    F(lora_expand)(y, y_stride, h, h_stride, slab, page_stride, page, page_table, pt_stride, n_cells, cell_slot,
                   cell_begin, tokens, n_modules, bounds, b_offset, rank, h_start, scale, tab_stride, max_rank,
                   nthreads);
}

#undef B_SPAN
#undef B_ROOM
#undef EXPAND_BLOCK
/* The includer's parameters, so the next include defines them afresh. */
#undef W
#undef F
#undef LDW
#undef ROW16
#undef H16
#undef TOF
#undef RANK16
#undef NARROW
#undef SCALED
