/* The CPU path's LoRA shrink and expand for short segments (decode rows), reading adapters
 * straight from pool pages; and (attention_cpu.h, included at the end) its decode attention, and
 * (step_cpu.h) the layer's norms, rotation, K/V write and SiLU.
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
 * Weights: the kernels (lora_cpu_body.h) are compiled four times, for float32 pages (the _f32
 * entry points), bfloat16 pages (_bf16, --lora-dtype bfloat16), float16 pages (_f16, --lora-dtype
 * float16: llama.cpp's f16 adapters) and int8 pages with per-row scales (_i8, --lora-dtype int8),
 * with W (the weight type) and its loaders defined. A bfloat16 weight is the top half of a float32:
 * it is widened exactly (a shift); a float16 one too (F16C's conversion, or f16_to_f32); an int8 one
 * converts exactly, and its
 * row's float32 scale (kernels/lora_int8.py) multiplies the shrink's sum of the row once, and h
 * before the expand, once per B column. Every product and sum is float32, as in the float32 kernels.
 *
 * ISA: built once per variant (kernels/cpu_isa.py: baseline x86-64, AVX, AVX2, AVX-512, portable),
 * never -march=native; the __AVX__ / __AVX2__ paths below are compiled in where the variant has
 * them, and every variant's results are within float32's any-order bound of the exact ones.
 *
 * Threads: OpenMP, linked against the libgomp that torch loads, so these loops share torch's
 * thread pool instead of a second one competing for the same cores.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

static inline v8 ld(const float *p) { return *(const v8u *)p; }

#if defined(__AVX__)
#include <immintrin.h>
#endif

/* 8 bfloat16 values as 8 floats: each is the high 16 bits of its float. */
#if defined(__AVX__) && !defined(__AVX2__)
/* AVX without AVX2 has no 256-bit integer shift, and GCC 12 made the portable loop below 8 scalar
 * loads and inserts (bfloat16 pages ran 4.8x slower than under AVX2, slower than SSE2's). Two
 * 128-bit unpacks against zero put each weight in the high half of its word; one insert joins them. */
static inline v8 ld_bf16(const uint16_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p), z = _mm_setzero_si128();
    __m256i lo = _mm256_castsi128_si256(_mm_unpacklo_epi16(z, v));
    __m256i w = _mm256_insertf128_si256(lo, _mm_unpackhi_epi16(z, v), 1);
    return (v8)_mm256_castsi256_ps(w);
}
#else
/* The compiler makes the loop one widening load and a shift. */
static inline v8 ld_bf16(const uint16_t *p) {
    u32x8 wide;
    for (int i = 0; i < 8; i++) wide[i] = (uint32_t)p[i] << 16;
    return (v8)wide;
}
#endif

/* 8 int8 values as 8 floats (exactly). */
#if defined(__AVX2__)
static inline v8 ld_i8(const int8_t *p) {
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#elif defined(__AVX__)
/* SSE4.1's widening of 4 bytes twice, joined: the portable loop below is 8 scalar converts here. */
static inline v8 ld_i8(const int8_t *p) {
    __m128i v = _mm_loadl_epi64((const __m128i *)p);
    __m256i w = _mm256_insertf128_si256(_mm256_castsi128_si256(_mm_cvtepi8_epi32(v)),
                                        _mm_cvtepi8_epi32(_mm_srli_si128(v, 4)), 1);
    return (v8)_mm256_cvtepi32_ps(w);
}
#else
static inline v8 ld_i8(const int8_t *p) {
    v8 f;
    for (int i = 0; i < 8; i++) f[i] = (float)p[i];
    return f;
}
#endif

/* An IEEE half's value as a float32 (exact: normals, subnormals, infinities and NaNs). */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = h & 0x7c00u, man = h & 0x03ffu;
    uint32_t bits;
    float f;
    if (exp == 0x7c00u)
        bits = sign | 0x7f800000u | (man << 13);
    else if (exp)
        bits = sign | (((exp >> 10) + 112) << 23) | (man << 13);
    else {
        f = (float)man * 5.9604644775390625e-8f; /* man * 2^-24: a subnormal half, exact in float32 */
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    memcpy(&f, &bits, 4);
    return f;
}

/* 8 float16 values as 8 floats (exactly): one conversion where the variant has F16C (x86-64-v3 and
 * up), else the exact scalar widening above, value by value. */
#if defined(__F16C__)
static inline v8 ld_f16(const uint16_t *p) { return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#else
static inline v8 ld_f16(const uint16_t *p) {
    v8 f;
    for (int i = 0; i < 8; i++) f[i] = f16_to_f32(p[i]);
    return f;
}
#endif

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float hsum(v8 v) {
    v8 s = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    s += __builtin_shufflevector(s, s, 2, 3, 0, 1, 6, 7, 4, 5);
    s += __builtin_shufflevector(s, s, 1, 0, 3, 2, 5, 4, 7, 6);
    return s[0];
}

/* The rank-16 expand's vector path: AVX and FMA for float32 pages, AVX2 too for bfloat16 ones
 * (the widening load). Without them a B row is read by the portable dot product. */
#if defined(__AVX__) && defined(__FMA__)
#define RANK16_F32 1

static inline __m256 row16_f32(const float *p, __m256 h0, __m256 h1) {
    return _mm256_fmadd_ps(_mm256_loadu_ps(p + 8), h1, _mm256_mul_ps(_mm256_loadu_ps(p), h0));
}
static inline void h_f32(const float *hv, __m256 *h0, __m256 *h1) {
    *h0 = _mm256_loadu_ps(hv), *h1 = _mm256_loadu_ps(hv + 8);
}

/* The 8 sums of 8 vectors, as one vector: a horizontal-add tree instead of 8 separate reductions. */
static inline __m256 sums8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

#else
#define RANK16_F32 0
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define RANK16_BF16 1
/* A rank-16 row of bfloat16 weights (32 bytes) against h, as 8 partial sums, with no shuffle: the
 * row's 32-bit words hold weights (2i, 2i + 1), so a shift gives the even weights as floats and a
 * mask the odd ones; h0 and h1 are h's even and odd elements (h_bf16). Widening the row by
 * shuffles instead (vpmovzxwd) took as many shuffle-port slots as the sums below, on the port the
 * sums' shuffles need. */
static inline __m256 row16_bf16(const uint16_t *p, __m256 h0, __m256 h1) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
    return _mm256_fmadd_ps(odd, h1, _mm256_mul_ps(even, h0));
}
static inline void h_bf16(const float *hv, __m256 *h0, __m256 *h1) {
    *h0 = _mm256_setr_ps(hv[0], hv[2], hv[4], hv[6], hv[8], hv[10], hv[12], hv[14]);
    *h1 = _mm256_setr_ps(hv[1], hv[3], hv[5], hv[7], hv[9], hv[11], hv[13], hv[15]);
}
#else
#define RANK16_BF16 0
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RANK16_F16 1
/* A rank-16 row of float16 weights (32 bytes) against h, as 8 partial sums: two conversions of 8
 * halves each; h0 and h1 are h's first and last 8 elements (h_f32). */
static inline __m256 row16_f16(const uint16_t *p, __m256 h0, __m256 h1) {
    __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    return _mm256_fmadd_ps(hi, h1, _mm256_mul_ps(lo, h0));
}
#else
#define RANK16_F16 0
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define RANK16_I8 1
/* A rank-16 row of int8 weights (16 bytes) against h, as 8 partial sums; h0 and h1 are h's first
 * and last 8 elements (h_f32). The B column scales are in h already. */
static inline __m256 row16_i8(const int8_t *p, __m256 h0, __m256 h1) {
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v)));
    return _mm256_fmadd_ps(hi, h1, _mm256_mul_ps(lo, h0));
}
#else
#define RANK16_I8 0
#endif

/* Where the float32 scales of an int8 matrix of n values at element off start (kernels/lora_int8.py). */
#define SCALES_AT(off, n) ((off) + ((n) + 3) / 4 * 4)

/* Work is split into (cell, block of rows) tasks, so one long cell still spreads over threads. */
#define SHRINK_ROWS 16
#define EXPAND_ROWS 256

/* Stripes: the tokens of cells of at most STRIPE_TOKENS tokens (decode rows, ~1 per adapter in a step
 * over many adapters) run STRIPES at a time in lockstep, each stripe reading its own adapter's
 * matrix. One core reads memory faster from several far-apart places at once than from one
 * place after another (the hardware prefetchers follow one stream each): 24 adapters' stacked
 * q/k/v A matrices, read 8 at a time in lockstep, went at 14.5 GB/s on one thread of the
 * 2-vCPU Xeon of bench/RESULTS.md (session 9), against 9.3-10.2 GB/s one adapter after another.
 * A cell of more tokens runs alone instead: its matrices are read once for all its tokens,
 * where stripes of one cell would load them once per token (from L1, but the loads add up). */
#define STRIPES 8
#define STRIPE_TOKENS 2

typedef struct {
    int64_t slot, token;
} Stripe;

/* A call's cells split into those that run alone (big) and stripes, grouped in packs of up to STRIPES:
 * pack p is stripes[pack_begin[p] : pack_begin[p + 1]]. */
typedef struct {
    Stripe *stripes;
    int64_t *pack_begin, *big;
    int64_t n_packs, n_big;
} Plan;

/* With ``stripes`` set and the memory to plan them, the tokens of short cells become stripes; a pack
 * holds stripes of one ``key`` (key[slot * key_stride]: the shrink's A rows, which stripes in
 * lockstep share), in cell order otherwise. Else every cell runs alone (big == NULL: cell i). */
static Plan plan_stripes(int stripes, int64_t n_cells, const int64_t *cell_slot, const int64_t *cell_begin,
                       const int64_t *tokens, const int32_t *key, int64_t key_stride) {
    Plan p = {NULL, NULL, NULL, 0, n_cells};
    int64_t n = 0;
    for (int64_t c = 0; c < n_cells; c++)
        if (cell_begin[c + 1] - cell_begin[c] <= STRIPE_TOKENS) n += cell_begin[c + 1] - cell_begin[c];
    if (!stripes || n == 0) return p;
    p.stripes = malloc((size_t)n * sizeof(Stripe));
    p.pack_begin = malloc((size_t)(n + 1) * sizeof(int64_t));
    p.big = malloc((size_t)n_cells * sizeof(int64_t));
    if (!p.stripes || !p.pack_begin || !p.big) {
        free(p.stripes), free(p.pack_begin), free(p.big);
        return (Plan){NULL, NULL, NULL, 0, n_cells};
    }
    int64_t k = 0;
    p.n_big = 0;
    for (int64_t c = 0; c < n_cells; c++) {
        int64_t nt = cell_begin[c + 1] - cell_begin[c];
        if (nt > STRIPE_TOKENS) {
            p.big[p.n_big++] = c;
            continue;
        }
        for (int64_t t = cell_begin[c]; t < cell_begin[c + 1]; t++) {
            Stripe l = {cell_slot[c], tokens[t]};
            int64_t at = k++;
            if (key) /* insertion sort, stable: stripes of one key stay in cell order */
                for (; at > 0 && key[p.stripes[at - 1].slot * key_stride] > key[l.slot * key_stride]; at--)
                    p.stripes[at] = p.stripes[at - 1];
            p.stripes[at] = l;
        }
    }
    for (int64_t i = 0; i < n; i++)
        if (i == 0 || i - p.pack_begin[p.n_packs - 1] == STRIPES ||
            (key && key[p.stripes[i].slot * key_stride] != key[p.stripes[i - 1].slot * key_stride]))
            p.pack_begin[p.n_packs++] = i;
    p.pack_begin[p.n_packs] = n;
    return p;
}

static void free_plan(Plan *p) { free(p->stripes), free(p->pack_begin), free(p->big); }

/* Cells of at least this many tokens over 16-bit pages widen each block of weights into float32
 * once, and run the float32 loops over it, rather than widening every weight once per token. A
 * 4-token cell (32 decode rows on 8 adapters, 16 on 4) reads its A rows once for its 4 tokens
 * already (rows2_tok4): widening them first cost it a pass, 0.87 -> 0.75 ms of LoRA a decode step
 * over float16 pages at 16 rows on 4 adapters when it stopped (3 -> 5; bench/RESULTS.md). */
#define WIDEN_TOKENS 5

#define W float
#define F(name) name##_f32
#define LDW(p) ld(p)
#define ROW16(p, h0, h1) row16_f32(p, h0, h1)
#define H16(hv, h0, h1) h_f32(hv, h0, h1)
#define TOF(v) (v)
#define RANK16 RANK16_F32
#define NARROW 0
#define SCALED 0
#include "lora_cpu_body.h" /* which #undefs these for the next */

#define W uint16_t
#define F(name) name##_bf16
#define LDW(p) ld_bf16(p)
#define ROW16(p, h0, h1) row16_bf16(p, h0, h1)
#define H16(hv, h0, h1) h_bf16(hv, h0, h1)
#define TOF(v) bf16_to_f32(v)
#define RANK16 RANK16_BF16
#define NARROW 1
#define SCALED 0
#include "lora_cpu_body.h" /* which #undefs these for the next */

#define W uint16_t
#define F(name) name##_f16
#define LDW(p) ld_f16(p)
#define ROW16(p, h0, h1) row16_f16(p, h0, h1)
#define H16(hv, h0, h1) h_f32(hv, h0, h1)
#define TOF(v) f16_to_f32(v)
#define RANK16 RANK16_F16
#define NARROW 1
#define SCALED 0
#include "lora_cpu_body.h" /* which #undefs these for the next */

#define W int8_t
#define F(name) name##_i8
#define LDW(p) ld_i8(p)
#define ROW16(p, h0, h1) row16_i8(p, h0, h1)
#define H16(hv, h0, h1) h_f32(hv, h0, h1)
#define TOF(v) ((float)(v))
#define RANK16 RANK16_I8
#define NARROW 1
#define SCALED 1
#include "lora_cpu_body.h" /* which #undefs these for the next */

#include "attention_cpu.h"

#include "linear_w8a8.h"
#include "step_cpu.h"
