/* The w8a8 projection's two passes around torch's int8 GEMM (kernels/linear_w8a8.py):
 *   w8a8_quantize_rows: each row of x (float32) as int8 q = round_half_even(x * (127 / a)) with a = max|x_row|,
 *     and its scale s = a / 127 (a row with a < 2^-100, zeros included: q = 0, s = 1);
 *   w8a8_rescale: y = (float(acc) * s_x[row]) * s_w[col] (+ bias[col]) written in place over the GEMM's
 *     int32 result acc [m, n] (a float32 has the int32's size: the tensor is viewed as float32 after);
 *   w8a8_unit_rows / w8a8_scale_rows, FBGEMM's path (kernels/linear_w8a8_fbgemm.py): each row of x
 *     divided by a = max|x_row| (1 for a row under 2^-100) into out, a kept; then y[i] = y[i] * a[i]
 *     (+ bias) in place over the GEMM's float32 output.
 * Same results as the PyTorch expression in linear_w8a8.py: the quantization bit for bit (one IEEE
 * product, and the round-to-nearest-even of 1.5 * 2^23 added and taken away, exact for |v| < 2^22);
 * the rescale within the rounding of its two products (an FMA may fuse the bias's add).
 * Why C: the same passes as torch ops cost as much as the GEMM at 32 rows (abs, amax, div, round,
 * to int8; then float, two products, each a new [m, n] tensor). Rows split over OpenMP threads. */
#include <math.h>

typedef int32_t i32x8 __attribute__((vector_size(32), aligned(4)));
typedef float f32x8a __attribute__((vector_size(32), aligned(4), may_alias));
typedef uint32_t u32a __attribute__((may_alias));

#define W8A8_MAGIC 12582912.0f /* 1.5 * 2^23: v + it - it rounds v to an integer, ties to even */
#define W8A8_TINY 7.888609052210118e-31f /* 2^-100: a row whose max |x| is below it quantizes to 0 */

/* max |x| as the largest of the bit patterns with the sign cleared: for floats >= 0 they order as
 * the values do, and an integer max is a reduction every compiler vectorizes */
static float w8a8_row_max(const float *x, int64_t k) {
    const u32a *bits = (const u32a *)x;
    uint32_t top = 0;
    for (int64_t j = 0; j < k; j++) {
        uint32_t b = bits[j] & 0x7fffffffu;
        top = b > top ? b : top;
    }
    float amax;
    memcpy(&amax, &top, sizeof amax);
    return amax;
}

static void w8a8_quantize_row(const float *x, int64_t k, int8_t *q, float *s_out) {
    float amax = w8a8_row_max(x, k);
    if (!(amax >= W8A8_TINY)) { /* zeros, or a row too small to scale: q = 0 */
        memset(q, 0, (size_t)k);
        *s_out = 1.0f;
        return;
    }
    float inv = 127.0f / amax; /* a product per element: a division's throughput is a sixth of it */
    *s_out = amax / 127.0f;
    for (int64_t j = 0; j < k; j++) {
        float v = (x[j] * inv + W8A8_MAGIC) - W8A8_MAGIC;
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        q[j] = (int8_t)(int32_t)v;
    }
}

void w8a8_quantize_rows(const float *x, int64_t ldx, int64_t m, int64_t k, int8_t *q, float *s, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && m * k >= 65536)
    for (int64_t i = 0; i < m; i++) w8a8_quantize_row(x + i * ldx, k, q + i * k, s + i);
}

void w8a8_rescale(int32_t *acc, int64_t m, int64_t n, const float *s_x, const float *s_w, const float *bias,
                  int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && m * n >= 65536)
    for (int64_t i = 0; i < m; i++) {
        int32_t *row = acc + i * n;
        float a = s_x[i];
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            v8 f = __builtin_convertvector(*(const i32x8 *)(row + j), v8) * a * ld(s_w + j);
            if (bias) f += ld(bias + j);
            *(f32x8a *)(row + j) = f;
        }
        for (; j < n; j++) {
            float f = (float)row[j] * a * s_w[j];
            if (bias) f += bias[j];
            memcpy(row + j, &f, sizeof f);
        }
    }
}

/* Division, not a product by 1 / a: the same IEEE quotient torch's ``rows / a`` gives, bit for bit. */
void w8a8_unit_rows(const float *x, int64_t ldx, int64_t m, int64_t k, float *out, float *a, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && m * k >= 65536)
    for (int64_t i = 0; i < m; i++) {
        const float *row = x + i * ldx;
        float amax = w8a8_row_max(row, k);
        amax = amax >= W8A8_TINY ? amax : 1.0f;
        a[i] = amax;
        for (int64_t j = 0; j < k; j++) out[i * k + j] = row[j] / amax;
    }
}

void w8a8_scale_rows(float *y, int64_t m, int64_t n, const float *a, const float *bias, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && m * n >= 65536)
    for (int64_t i = 0; i < m; i++) {
        float *row = y + i * n;
        for (int64_t j = 0; j < n; j++) {
            float v = row[j] * a[i];
            row[j] = bias ? v + bias[j] : v;
        }
    }
}
