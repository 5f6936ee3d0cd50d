/* The CPU path's paged decode attention over float32, float16 or bfloat16 KV pages (included by
 * lora_cpu.c, built with it once per ISA variant); queries and outputs float32.
 *
 * Same result as kernels/attention_ref.py's paged_decode_attention_ref, for one query token per row:
 *   out[b, h] = softmax(q[b, h] @ K_b[:, h / G].T * scale) @ V_b[:, h / G],   G = heads / kv_heads,
 * over the first context_lens[b] positions, K_b and V_b read through the row's block table from
 * pages laid out [2, block_size, kv_heads, head_dim] (K, then V). With window > 0 (a sliding-window
 * layer) only the last `window` of those positions are read; with softcap > 0 each scaled score s
 * becomes softcap * tanhf(s / softcap) before the softmax (Gemma 2's attention soft-capping).
 *
 * Why C: a decode step's attention is small (32 rows of ~40 positions is ~3 MFLOP), and the
 * PyTorch reference spends its time in the ops around it: gathering every row's pages into
 * fresh K and V tensors, zeroing stale positions, building a mask, and scaled_dot_product_attention's
 * dispatch. It took ~9% of the 512-wide bench model's decode step at one thread (bench/RESULTS.md,
 * round 3); here the pages are read in place, each (row, KV head) once for its G query heads.
 *
 * Half-precision pages (kv_cache_dtype float16 / bfloat16): each K or V row is widened into a
 * per-thread float32 row once per position (exactly: every half value is a float32 value), then
 * read as float32 pages are.
 *
 * Numerics: every score, exponential and sum in float32, the scores of a (row, KV head) kept in a
 * per-thread buffer; softmax subtracts the row's largest score before expf. tests/test_attention_cpu.py
 * checks it against a float64 reference with a bound that holds for any summation order.
 *
 * Threads: one task per (row, KV head), spread over torch's OpenMP threads.
 */
#include <math.h>

/* dot_f32 (lora_cpu_body.h's float32 dot product) is defined by the time this is included. */

/* Returns 0, or 1 when a thread could not allocate its buffer (its rows are then left unwritten:
 * the caller runs the reference instead). */
enum kv_format { KV_F32, KV_F16, KV_BF16 };

/* f16_to_f32 (an IEEE half's value as a float32) is lora_cpu.c's. */

/* Row `index` (in elements) of the pages as float32: in place for float32 pages, else widened into `buf`. */
static inline const float *kv_row(const void *kv, int format, int64_t index, int64_t n, float *buf) {
    if (format == KV_F32) return (const float *)kv + index;
    const uint16_t *h = (const uint16_t *)kv + index;
    int64_t d = 0;
    if (format == KV_F16) {
#if defined(__F16C__)
        for (; d + 8 <= n; d += 8) /* x86-64-v3 and up: 8 halves per conversion */
            _mm256_storeu_ps(buf + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + d))));
#endif
        for (; d < n; d++) buf[d] = f16_to_f32(h[d]);
    } else {
        for (; d + 8 <= n; d += 8) *(v8u *)(buf + d) = ld_bf16(h + d);
        for (; d < n; d++) {
            const uint32_t bits = (uint32_t)h[d] << 16;
            memcpy(buf + d, &bits, 4);
        }
    }
    return buf;
}

/* q . k over head_dim (a multiple of 32): four independent sums, so successive products do not wait on
 * one another's FMA (a single chain's latency bounded the score loop). Any order is within the bound. */
static inline float dot_heads(const float *q, const float *k, int64_t d) {
    v8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    for (int64_t i = 0; i < d; i += 32) {
        s0 += ld(q + i) * ld(k + i);
        s1 += ld(q + i + 8) * ld(k + i + 8);
        s2 += ld(q + i + 16) * ld(k + i + 16);
        s3 += ld(q + i + 24) * ld(k + i + 24);
    }
    return hsum((s0 + s1) + (s2 + s3));
}

/* o[0:64] = inv * sum over positions p in [first, n) of w[p] * V_p[0:64] (float32 pages; V_p at vbase through
 * the row's block table): the 64 sums kept in 8 vector registers across the positions, where the loop
 * below them (any width, any page dtype) loads and stores its accumulators once per position. Each
 * output adds its terms in position order, as that loop does. */
static void weighted_rows_64(float *o, const float *w, const float *vbase, const int32_t *table, int64_t first,
                             int64_t n, int64_t block_size, int64_t page_stride, int64_t token_stride, float inv) {
    v8 a[8] = {{0}};
    for (int64_t p = first; p < n; p++) {
        const float *v = vbase + table[p / block_size] * page_stride + (p % block_size) * token_stride;
        const v8 wp = (v8){0} + w[p];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) a[i] += wp * ld(v + 8 * i);
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) *(v8u *)(o + 8 * i) = a[i] * inv;
}

static int decode_attention(float *out, int64_t out_stride, const float *q, int64_t q_stride, const void *kv, int format,
                            int64_t page_stride, int64_t block_size, int64_t kv_heads, int64_t head_dim,
                            int64_t heads, const int32_t *block_table, int64_t table_stride,
                            const int32_t *context_lens, int64_t rows, float scale, int64_t window, float softcap,
                            int nthreads) {
    const int64_t group = heads / kv_heads, token_stride = kv_heads * head_dim;
    const int64_t v_offset = block_size * token_stride; /* V's half of a page */
    int64_t longest = 0;
    int failed = 0;
    for (int64_t b = 0; b < rows; b++)
        if (context_lens[b] > longest) longest = context_lens[b];
#pragma omp parallel num_threads(nthreads)
    {
        /* Per thread: the G query heads' scores over the longest context, and their outputs. */
        float *scores = malloc((size_t)(group * longest + group * head_dim + head_dim) * sizeof(float));
        float *acc = scores + group * longest, *row = acc + group * head_dim; /* row: a widened K or V */
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < rows; b++)
            for (int64_t j = 0; j < kv_heads; j++) {
                if (!scores) continue;
                const int64_t n = context_lens[b], first = window > 0 && n > window ? n - window : 0;
                const int32_t *table = block_table + b * table_stride;
                const float *qb = q + b * q_stride + j * group * head_dim;
                for (int64_t p = first; p < n; p++) {
                    const float *k = kv_row(kv, format,
                                            table[p / block_size] * page_stride + (p % block_size) * token_stride +
                                                j * head_dim,
                                            head_dim, row);
                    for (int64_t g = 0; g < group; g++) {
                        const float *qg = qb + g * head_dim;
                        const float s = (head_dim % 32 ? dot_f32(qg, k, head_dim) : dot_heads(qg, k, head_dim)) * scale;
                        scores[g * longest + p] = softcap > 0.0f ? softcap * tanhf(s / softcap) : s;
                    }
                }
                float total[group];
                for (int64_t g = 0; g < group; g++) {
                    float *s = scores + g * longest, top = -INFINITY, sum = 0.0f;
                    for (int64_t p = first; p < n; p++) top = s[p] > top ? s[p] : top;
                    for (int64_t p = first; p < n; p++) sum += (s[p] = expf(s[p] - top));
                    total[g] = sum;
                }
                if (format == KV_F32 && head_dim % 64 == 0) { /* the usual heads (64, 128, 256 wide) */
                    const float *vbase = (const float *)kv + v_offset + j * head_dim;
                    for (int64_t g = 0; g < group; g++)
                        for (int64_t c = 0; c < head_dim; c += 64)
                            weighted_rows_64(out + b * out_stride + (j * group + g) * head_dim + c, scores + g * longest,
                                             vbase + c, table, first, n, block_size, page_stride, token_stride,
                                             1.0f / total[g]);
                    continue;
                }
                memset(acc, 0, (size_t)(group * head_dim) * sizeof(float));
                for (int64_t p = first; p < n; p++) {
                    const float *v = kv_row(kv, format,
                                            table[p / block_size] * page_stride + v_offset +
                                                (p % block_size) * token_stride + j * head_dim,
                                            head_dim, row);
                    for (int64_t g = 0; g < group; g++) {
                        const float w = scores[g * longest + p];
                        float *a = acc + g * head_dim;
                        for (int64_t d = 0; d < head_dim; d++) a[d] += w * v[d];
                    }
                }
                for (int64_t g = 0; g < group; g++) {
                    float *o = out + b * out_stride + (j * group + g) * head_dim;
                    const float inv = 1.0f / total[g];
                    for (int64_t d = 0; d < head_dim; d++) o[d] = acc[g * head_dim + d] * inv;
                }
            }
        free(scores);
    }
    return failed;
}

/* The exported entry points, one per page dtype (the same arguments, kv's elements of that type). */
#define DECODE_ATTENTION(name, format)                                                                        \
    int name(float *out, int64_t out_stride, const float *q, int64_t q_stride, const void *kv, int64_t page_stride, \
             int64_t block_size, int64_t kv_heads, int64_t head_dim, int64_t heads, const int32_t *block_table,     \
             int64_t table_stride, const int32_t *context_lens, int64_t rows, float scale, int64_t window,         \
             float softcap, int nthreads) {                                                                     \
        return decode_attention(out, out_stride, q, q_stride, kv, format, page_stride, block_size, kv_heads,       \
                                head_dim, heads, block_table, table_stride, context_lens, rows, scale, window,    \
                                softcap, nthreads);                                                            \
    }
DECODE_ATTENTION(decode_attention_f32, KV_F32)
DECODE_ATTENTION(decode_attention_f16, KV_F16)
DECODE_ATTENTION(decode_attention_bf16, KV_BF16)
