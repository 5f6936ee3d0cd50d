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
 * Weights: the kernels (lora_cpu_body.h) are compiled twice, for float32 pages (the _f32 entry
 * points) and for bfloat16 pages (_bf16, --lora-dtype bfloat16), with W (the weight type) and its
 * loaders defined. A bfloat16 weight is the top half of a float32: it is widened exactly (a
 * shift), and every product and sum is float32, as in the float32 kernels.
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

/* 8 bfloat16 values as 8 floats: each is the high 16 bits of its float (the compiler makes the
 * loop one widening load and a shift). */
static inline v8 ld_bf16(const uint16_t *p) {
    u32x8 wide;
    for (int i = 0; i < 8; i++) wide[i] = (uint32_t)p[i] << 16;
    return (v8)wide;
}

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
#include <immintrin.h>

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
static inline __m256 ld256_bf16(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#else
#define RANK16_BF16 0
#endif

/* Work is split into (cell, block of rows) tasks, so one long cell still spreads over threads. */
#define SHRINK_ROWS 16
#define EXPAND_ROWS 256

#define W float
#define F(name) name##_f32
#define LDW(p) ld(p)
#define LDW256(p) _mm256_loadu_ps(p)
#define TOF(v) (v)
#define RANK16 RANK16_F32
#include "lora_cpu_body.h"
#undef W
#undef F
#undef LDW
#undef LDW256
#undef TOF
#undef RANK16

#define W uint16_t
#define F(name) name##_bf16
#define LDW(p) ld_bf16(p)
#define LDW256(p) ld256_bf16(p)
#define TOF(v) bf16_to_f32(v)
#define RANK16 RANK16_BF16
#include "lora_cpu_body.h"
