/* The CPU path's LoRA shrink and expand for short segments (decode rows), reading adapters
 * straight from pool pages.
 *
 * Same results as kernels/lora_ref.py, cell by cell (a cell: one adapter slot and its tokens):
 *   shrink: h[t, :a_rows[s]] = x[t] @ A_s.T
 *   expand: y[t, o_m : o_m + w_m] += (scale[s, m] * h[t, hs : hs + r]) @ B_{s,m}.T
 * A matrix whose covering pages are one run (the usual case) is read in place; otherwise its
 * pages are copied into a per-thread scratch buffer first.
 *
 * Why C: decode rows are bound by reading each adapter's weights once per step. The PyTorch ops
 * reach that only for adapters back to back in the pool; scattered ones cost gathered rows, holes
 * read for nothing and ~130 dispatches a step. Here the tokens are addressed through an index,
 * so nothing is gathered, and each adapter's matrices are read once per op.
 *
 * Threads: OpenMP, linked against the libgomp that torch loads, so these loops share torch's
 * thread pool instead of a second one competing for the same cores.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));

static inline v8 ld(const float *p) { return *(const v8u *)p; }

static inline float hsum(v8 v) {
    v8 s = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    s += __builtin_shufflevector(s, s, 2, 3, 0, 1, 6, 7, 4, 5);
    s += __builtin_shufflevector(s, s, 1, 0, 3, 2, 5, 4, 7, 6);
    return s[0];
}

static inline float dot(const float *a, const float *x, int64_t d) {
    v8 s = {0};
    int64_t k = 0;
    for (; k + 8 <= d; k += 8) s += ld(a + k) * ld(x + k);
    float r = hsum(s);
    for (; k < d; k++) r += a[k] * x[k];
    return r;
}

/* One slot's flat buffer, read through its page table row. */
typedef struct {
    const float *slab;
    int64_t page_stride; /* elements between pages in the slab */
    int64_t page;        /* elements per page */
    const int32_t *pages;
} Buffer;

static int is_run(const Buffer *b, int64_t off, int64_t n) {
    int64_t first = off / b->page, last = (off + n - 1) / b->page;
    return (int64_t)b->pages[last] - b->pages[first] == last - first;
}

/* Elements [off, off + n): in place when their pages are one run, else copied into scratch. */
static const float *span(const Buffer *b, int64_t off, int64_t n, float **scratch, int64_t max_numel) {
    int64_t first = off / b->page;
    if (is_run(b, off, n)) return b->slab + (int64_t)b->pages[first] * b->page_stride + (off - first * b->page);
    if (!*scratch) *scratch = malloc((size_t)max_numel * sizeof(float));
    for (int64_t done = 0, e = off; done < n;) {
        int64_t o = e % b->page, take = b->page - o;
        if (take > n - done) take = n - done;
        memcpy(*scratch + done, b->slab + (int64_t)b->pages[e / b->page] * b->page_stride + o,
               (size_t)take * sizeof(float));
        done += take;
        e += take;
    }
    return *scratch;
}

/* 4 rows of a (row stride d) against one token: 4 independent sums, so loads overlap. */
static inline void rows4_tok1(const float *a, int64_t d, const float *x, float *out) {
    v8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    for (int64_t k = 0; k < d; k += 8) {
        v8 xv = ld(x + k);
        s0 += ld(a + k) * xv;
        s1 += ld(a + d + k) * xv;
        s2 += ld(a + 2 * d + k) * xv;
        s3 += ld(a + 3 * d + k) * xv;
    }
    out[0] = hsum(s0), out[1] = hsum(s1), out[2] = hsum(s2), out[3] = hsum(s3);
}

/* 2 rows of a against 4 tokens: each row is loaded once for the 4. */
static inline void rows2_tok4(const float *a, int64_t d, const float *const x[4], float out[2][4]) {
    v8 s[2][4] = {{{0}}};
    for (int64_t k = 0; k < d; k += 8) {
        v8 a0 = ld(a + k), a1 = ld(a + d + k);
        for (int j = 0; j < 4; j++) {
            v8 xv = ld(x[j] + k);
            s[0][j] += a0 * xv;
            s[1][j] += a1 * xv;
        }
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) out[i][j] = hsum(s[i][j]);
}

static void shrink_cell(float *h, int64_t hs, const float *x, int64_t xs, int64_t d, const float *a, int64_t rows,
                        const int64_t *tok, int64_t nt) {
    int64_t i = 0;
    if (d % 8) {
        for (int64_t t = 0; t < nt; t++)
            for (i = 0; i < rows; i++) h[tok[t] * hs + i] = dot(a + i * d, x + tok[t] * xs, d);
        return;
    }
    if (nt == 1) {
        const float *xt = x + tok[0] * xs;
        float *ht = h + tok[0] * hs;
        for (; i + 4 <= rows; i += 4) rows4_tok1(a + i * d, d, xt, ht + i);
        for (; i < rows; i++) ht[i] = dot(a + i * d, xt, d);
        return;
    }
    for (int64_t t = 0; t < nt; t += 4) {
        int64_t n = nt - t < 4 ? nt - t : 4;
        const float *xp[4];
        for (int j = 0; j < 4; j++) xp[j] = x + tok[t + (j < n ? j : 0)] * xs; /* padding repeats a token */
        float o[2][4];
        for (i = 0; i + 2 <= rows; i += 2) {
            rows2_tok4(a + i * d, d, xp, o);
            for (int j = 0; j < n; j++) h[tok[t + j] * hs + i] = o[0][j], h[tok[t + j] * hs + i + 1] = o[1][j];
        }
        for (; i < rows; i++)
            for (int j = 0; j < n; j++) h[tok[t + j] * hs + i] = dot(a + i * d, xp[j], d);
    }
}

/* Work is split into (cell, block of rows) tasks, so one long cell still spreads over threads. */
#define SHRINK_ROWS 16
#define EXPAND_ROWS 256

void lora_shrink_f32(float *h, int64_t h_stride, const float *x, int64_t x_stride, int64_t d_in, const float *slab,
                     int64_t page_stride, int64_t page, const int32_t *page_table, int64_t pt_stride, int64_t n_cells,
                     const int64_t *cell_slot, const int64_t *cell_begin, const int64_t *tokens,
                     const int64_t *a_offset, int64_t ao_stride, const int32_t *a_rows, int64_t ar_stride,
                     int64_t max_rows, int nthreads) {
    int64_t blocks = (max_rows + SHRINK_ROWS - 1) / SHRINK_ROWS;
#pragma omp parallel num_threads(nthreads)
    {
        float *scratch = NULL;
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t c = 0; c < n_cells; c++) {
            for (int64_t blk = 0; blk < blocks; blk++) {
                int64_t s = cell_slot[c], i0 = blk * SHRINK_ROWS, rows = a_rows[s * ar_stride] - i0;
                if (rows <= 0) continue;
                if (rows > SHRINK_ROWS) rows = SHRINK_ROWS;
                Buffer b = {slab, page_stride, page, page_table + s * pt_stride};
                const float *a = span(&b, a_offset[s * ao_stride] + i0 * d_in, rows * d_in, &scratch, SHRINK_ROWS * d_in);
                shrink_cell(h + i0, h_stride, x, x_stride, d_in, a, rows, tokens + cell_begin[c],
                            cell_begin[c + 1] - cell_begin[c]);
            }
        }
        free(scratch);
    }
}

#if defined(__AVX__) && defined(__FMA__)
#include <immintrin.h>

/* The 8 sums of 8 vectors, as one vector: a horizontal-add tree instead of 8 separate reductions. */
static inline __m256 sums8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* Rank 16, 8 rows of b at a time: each row is two vectors against h. */
static int64_t expand_rank16(float *yt, const float *b, int64_t w, const float *hv) {
    __m256 h0 = _mm256_loadu_ps(hv), h1 = _mm256_loadu_ps(hv + 8);
    int64_t j = 0;
    for (; j + 8 <= w; j += 8) {
        const float *bj = b + j * 16;
        __m256 a[8];
        for (int i = 0; i < 8; i++)
            a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(bj + 16 * i + 8), h1, _mm256_mul_ps(_mm256_loadu_ps(bj + 16 * i), h0));
        __m256 sum = sums8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
        _mm256_storeu_ps(yt + j, _mm256_add_ps(_mm256_loadu_ps(yt + j), sum));
    }
    return j;
}
#else
static int64_t expand_rank16(float *yt, const float *b, int64_t w, const float *hv) {
    (void)yt, (void)b, (void)w, (void)hv;
    return 0;
}
#endif

/* yt[j] += b[j, :] . hv for j < w, b [w, r] row-major. */
static void expand_rows(float *yt, const float *b, int64_t w, int64_t r, const float *hv) {
    int64_t j = r == 16 ? expand_rank16(yt, b, w, hv) : 0; /* the common rank */
    for (; j < w; j++) yt[j] += dot(b + j * r, hv, r);
}

void lora_expand_f32(float *y, int64_t y_stride, const float *h, int64_t h_stride, const float *slab,
                     int64_t page_stride, int64_t page, const int32_t *page_table, int64_t pt_stride, int64_t n_cells,
                     const int64_t *cell_slot, const int64_t *cell_begin, const int64_t *tokens, int64_t n_modules,
                     const int64_t *bounds, const int64_t *b_offset, const int32_t *rank, const int32_t *h_start,
                     const float *scale, int64_t tab_stride, int64_t max_rank, int nthreads) {
    int64_t widest = 0;
    for (int64_t m = 0; m < n_modules; m++)
        if (bounds[m + 1] - bounds[m] > widest) widest = bounds[m + 1] - bounds[m];
    int64_t blocks = (widest + EXPAND_ROWS - 1) / EXPAND_ROWS;
#pragma omp parallel num_threads(nthreads)
    {
        float *scratch = NULL;
#pragma omp for collapse(3) schedule(dynamic, 1)
        for (int64_t c = 0; c < n_cells; c++) {
            for (int64_t m = 0; m < n_modules; m++) {
                for (int64_t blk = 0; blk < blocks; blk++) {
                    int64_t s = cell_slot[c], at = s * tab_stride + m, r = rank[at];
                    int64_t j0 = blk * EXPAND_ROWS, w = bounds[m + 1] - bounds[m] - j0;
                    if (r == 0 || w <= 0) continue;
                    if (w > EXPAND_ROWS) w = EXPAND_ROWS;
                    Buffer buf = {slab, page_stride, page, page_table + s * pt_stride};
                    const float *bm = span(&buf, b_offset[at] + j0 * r, w * r, &scratch, EXPAND_ROWS * max_rank);
                    float hv[r];
                    for (int64_t t = cell_begin[c]; t < cell_begin[c + 1]; t++) {
                        const float *ht = h + tokens[t] * h_stride + h_start[at];
                        for (int64_t k = 0; k < r; k++) hv[k] = scale[at] * ht[k];
                        expand_rows(y + tokens[t] * y_stride + bounds[m] + j0, bm, w, r, hv);
                    }
                }
            }
        }
        free(scratch);
    }
}
