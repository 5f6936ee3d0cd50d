/* The CPU path's per-layer elementwise work around the GEMMs, one C call each, float32 (included by
 * lora_cpu.c, after its vector types): the residual add and RMS norm, the rotary embedding, the
 * K/V write into the pages and SiLU(gate) * up. References: kernels/step_ref.py.
 *
 * Why C: in PyTorch these are 2-6 small ops each (~20 a layer). A 32-row decode step of the
 * 1,024-wide model spent more CPU on them and their dispatch than on its attention, and at 2
 * intra-op threads every op of 32K+ elements opened an OpenMP region: the second thread woken for
 * ~10 us of work, and on a loaded machine (the worker descheduled) one RMS norm took 0.6-1.5 ms
 * of CPU instead of 45 us (bench/RESULTS.md, issue 40, wt-peer). Here a decode step's rows run on
 * the calling thread alone; only a prefill's thousands of rows are split between threads
 * (PARALLEL_MIN elements and up), which is where a parallel region pays for its wake-up.
 *
 * Arithmetic: the same operations as the references, element by element, so the rotation, the
 * K/V copy and the norm's scaling are bit-identical to them (the rotation is compiled without FMA
 * contraction, as PyTorch rounds each product); the norm's sum of squares is added in another
 * order (float32's any-order bound), and SiLU's exp is a polynomial within 2 ulp of expf.
 */
#include <math.h>

#define PARALLEL_MIN (1 << 18) /* elements: below, one thread */

/* x += res (res may be NULL), then out = w * (x * (1 / sqrt(mean(x^2) + eps))), per row. */
void rms_norm_f32(float *out, int64_t out_stride, float *x, int64_t x_stride, const float *res, int64_t res_stride,
                  const float *w, int64_t rows, int64_t dim, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && rows * dim >= PARALLEL_MIN) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        float *xr = x + t * x_stride, *o = out + t * out_stride;
        if (res) {
            const float *r = res + t * res_stride;
            for (int64_t i = 0; i < dim; i++) xr[i] += r[i];
        }
        v8 acc0 = {0}, acc1 = {0};
        int64_t i = 0;
        for (; i + 16 <= dim; i += 16) {
            const v8 a = ld(xr + i), b = ld(xr + i + 8);
            acc0 += a * a, acc1 += b * b;
        }
        float sum = hsum(acc0 + acc1);
        for (; i < dim; i++) sum += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (i = 0; i < dim; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

/* e^x for 8 floats, x in [-87.3, 88.3] (clamped): Cephes' expf, a degree-5 polynomial on
 * [-ln2/2, ln2/2] times 2^n. */
typedef int32_t i8 __attribute__((vector_size(32)));

static inline v8 clamp8(v8 x, float lo, float hi) {
    const i8 over = (i8)(x > hi), under = (i8)(x < lo); /* elements: -1 where true */
    const v8 l = (v8){0} + lo, h = (v8){0} + hi;
    return (v8)(((i8)x & ~(over | under)) | ((i8)h & over) | ((i8)l & under));
}

static inline v8 exp8(v8 x) {
    x = clamp8(x, -87.3f, 88.3f);
    v8 n = x * 1.44269504088896341f + 0.5f;
    i8 ni = __builtin_convertvector(n, i8);
    ni -= (i8)(__builtin_convertvector(ni, v8) > n) & 1; /* floor */
    n = __builtin_convertvector(ni, v8);
    const v8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return (v8)((i8)p + ((ni) << 23));
}

/* out[t, i] = silu(gu[t, i]) * gu[t, inter + i], silu(g) = g / (1 + e^-g). */
void silu_mul_f32(float *out, int64_t out_stride, const float *gu, int64_t gu_stride, int64_t rows, int64_t inter,
                  int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && rows * inter >= PARALLEL_MIN) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *g = gu + t * gu_stride, *u = g + inter;
        float *o = out + t * out_stride;
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8) {
            const v8 gv = ld(g + i);
            *(v8u *)(o + i) = gv / (1.0f + exp8(-gv)) * ld(u + i);
        }
        for (; i < inter; i++) {
            v8 one = {0};
            one[0] = -g[i];
            o[i] = g[i] / (1.0f + exp8(one)[0]) * u[i];
        }
    }
}

/* In place, each of a row's heads: the first rot columns rotated as transformers' apply_rotary_pos_emb,
 * x * cos + rotate_half(x) * sin, row t's cos / sin at cos_rows + t * cs_stride; the rest untouched. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif
void rope_f32(float *x, int64_t row_stride, int64_t heads, int64_t head_dim, const float *cos_rows,
              const float *sin_rows, int64_t cs_stride, int64_t rot, int64_t rows, int nthreads) {
    const int64_t half = rot / 2;
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && rows * heads * rot >= PARALLEL_MIN) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos_rows + t * cs_stride, *s = sin_rows + t * cs_stride;
        for (int64_t h = 0; h < heads; h++) {
            float *p = x + t * row_stride + h * head_dim;
            for (int64_t j = 0; j < half; j++) {
                const float a = p[j], b = p[j + half];
                const float ac = a * c[j], bs = -b * s[j];
                const float bc = b * c[j + half], as = a * s[j + half];
                p[j] = ac + bs;
                p[j + half] = bc + as;
            }
        }
    }
}
#pragma GCC pop_options

/* kv[s / bs, 0, s % bs] = k[t] and kv[s / bs, 1, s % bs] = v[t] for s = slots[t] >= 0: ``width``
 * (KV heads x head dim) floats a token, a page [2, bs, width] at page_stride floats. */
void write_kv_f32(float *kv, int64_t page_stride, int64_t block_size, int64_t width, const float *k, int64_t k_stride,
                  const float *v, int64_t v_stride, const int64_t *slots, int64_t rows) {
    for (int64_t t = 0; t < rows; t++) {
        if (slots[t] < 0) continue;
        float *page = kv + (slots[t] / block_size) * page_stride + (slots[t] % block_size) * width;
        memcpy(page, k + t * k_stride, (size_t)width * sizeof(float));
        memcpy(page + block_size * width, v + t * v_stride, (size_t)width * sizeof(float));
    }
}

/* out[t] = the index of row t's first largest value, or -1 where the row holds a NaN or an
 * infinity (torch.argmax's index, and the sampler's test for a row it cannot sample). One pass for
 * the largest value and the row's finiteness (x - x is 0 exactly for a finite x), then the first
 * position holding it (a value equal to the largest under ==, as argmax's comparisons find it). */
void greedy_rows_f32(const float *x, int64_t stride, int64_t rows, int64_t vocab, int64_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && rows * vocab >= PARALLEL_MIN) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *r = x + t * stride;
        const v8 zero = {0};
        v8 top8[4] = {zero - INFINITY, zero - INFINITY, zero - INFINITY, zero - INFINITY}; /* 4 chains */
        u32x8 bad8 = {0};
        int64_t i = 0;
        for (; i + 32 <= vocab; i += 32)
            for (int c = 0; c < 4; c++) {
                const v8 v = ld(r + i + 8 * c);
                const u32x8 above = (u32x8)(v > top8[c]);
                top8[c] = (v8)(((u32x8)v & above) | ((u32x8)top8[c] & ~above));
                bad8 |= (u32x8)((v - v) != zero);
            }
        float top = -INFINITY;
        int bad = 0;
        for (int k = 0; k < 8; k++) {
            for (int c = 0; c < 4; c++) top = top8[c][k] > top ? top8[c][k] : top;
            bad |= bad8[k] != 0;
        }
        for (; i < vocab; i++) {
            top = r[i] > top ? r[i] : top;
            bad |= (r[i] - r[i]) != 0.0f;
        }
        int64_t at = -1;
        if (!bad) {
            const v8 top_v = zero + top;
            for (i = 0; i + 8 <= vocab; i += 8) { /* the block holding it, then its place there */
                const u32x8 hit = (u32x8)(ld(r + i) == top_v);
                if (hit[0] | hit[1] | hit[2] | hit[3] | hit[4] | hit[5] | hit[6] | hit[7]) break;
            }
            for (; i < vocab; i++)
                if (r[i] == top) {
                    at = i;
                    break;
                }
        }
        out[t] = at;
    }
}
