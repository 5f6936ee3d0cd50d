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
 * Threads: one task per row (each position's K and V read as one run over its KV heads), or per
 * (row, KV head) where there are few rows, spread over torch's OpenMP threads.
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

#define PREFETCH_AHEAD 2 /* positions */
/* Ask for position p's K and V (elements [off, off + n) of its token row) ahead of their reads. */
static inline void prefetch_position(const void *kv, int format, const int32_t *table, int64_t p, int64_t block_size,
                                     int64_t page_stride, int64_t token_stride, int64_t off, int64_t n) {
    const int64_t elem = format == KV_F32 ? 4 : 2;
    const char *k =
        (const char *)kv + (table[p / block_size] * page_stride + (p % block_size) * token_stride + off) * elem;
    const char *v = k + block_size * token_stride * elem;
    for (int64_t b = 0; b < n * elem; b += 64) __builtin_prefetch(k + b), __builtin_prefetch(v + b);
}

/* acc[0:n] += w * v[0:n]. */
static inline void axpy(float *acc, float w, const float *v, int64_t n) {
    const v8 wv = (v8){0} + w;
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) *(v8u *)(acc + d) = ld(acc + d) + wv * ld(v + d);
    for (; d < n; d++) acc[d] += w * v[d];
}

static int decode_attention(float *out, int64_t out_stride, const float *q, int64_t q_stride, const void *kv, int format,
                            int64_t page_stride, int64_t block_size, int64_t kv_heads, int64_t head_dim,
                            int64_t heads, const int32_t *block_table, int64_t table_stride,
                            const int32_t *context_lens, int64_t rows, float scale, int64_t window, float softcap,
                            int nthreads) {
    const int64_t group = heads / kv_heads, token_stride = kv_heads * head_dim;
    const int64_t v_offset = block_size * token_stride; /* V's half of a page */
    /* A task: KV heads [j0, j0 + span) of one row. A whole row where there are rows enough to share
     * out, so each position's K and V are read as one run over the heads (a page's positions one
     * stretch of memory); else one KV head a task, so a few long rows still use every thread. */
    const int64_t span = rows >= 4 * (int64_t)nthreads ? kv_heads : 1, parts = kv_heads / span;
    int64_t longest = 0;
    int failed = 0;
    for (int64_t b = 0; b < rows; b++)
        if (context_lens[b] > longest) longest = context_lens[b];
#pragma omp parallel num_threads(nthreads)
    {
        /* Per thread: its task's query heads' scores over the longest context, their outputs, and
         * one position's K or V over the task's heads (widened half pages). */
        const int64_t task_heads = span * group, width = span * head_dim;
        float *scores = malloc((size_t)(task_heads * longest + task_heads * head_dim + width) * sizeof(float));
        float *acc = scores + task_heads * longest, *row = acc + task_heads * head_dim;
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < rows; b++)
            for (int64_t part = 0; part < parts; part++) {
                if (!scores) continue;
                const int64_t n = context_lens[b], first = window > 0 && n > window ? n - window : 0;
                const int64_t j0 = part * span;
                const int32_t *table = block_table + b * table_stride;
                const float *qb = q + b * q_stride + j0 * group * head_dim;
                for (int64_t p = first; p < n; p++) {
                    const int64_t at = table[p / block_size] * page_stride + (p % block_size) * token_stride;
                    if (p + PREFETCH_AHEAD < n)
                        prefetch_position(kv, format, table, p + PREFETCH_AHEAD, block_size, page_stride, token_stride,
                                          j0 * head_dim, width);
                    const float *k = kv_row(kv, format, at + j0 * head_dim, width, row);
                    for (int64_t h = 0; h < task_heads; h++) {
                        const float *qh = qb + h * head_dim, *kh = k + (h / group) * head_dim;
                        const float s = (head_dim % 32 ? dot_f32(qh, kh, head_dim) : dot_heads(qh, kh, head_dim)) * scale;
                        scores[h * longest + p] = softcap > 0.0f ? softcap * tanhf(s / softcap) : s;
                    }
                }
                float inv[task_heads];
                for (int64_t h = 0; h < task_heads; h++) {
                    float *s = scores + h * longest, top = -INFINITY, sum = 0.0f;
                    for (int64_t p = first; p < n; p++) top = s[p] > top ? s[p] : top;
                    for (int64_t p = first; p < n; p++) sum += (s[p] = expf(s[p] - top));
                    inv[h] = 1.0f / sum;
                }
                memset(acc, 0, (size_t)(task_heads * head_dim) * sizeof(float));
                for (int64_t p = first; p < n; p++) {
                    const int64_t at = table[p / block_size] * page_stride + v_offset + (p % block_size) * token_stride;
                    const float *v = kv_row(kv, format, at + j0 * head_dim, width, row);
                    for (int64_t h = 0; h < task_heads; h++)
                        axpy(acc + h * head_dim, scores[h * longest + p], v + (h / group) * head_dim, head_dim);
                }
                for (int64_t h = 0; h < task_heads; h++) {
                    float *o = out + b * out_stride + (j0 * group + h) * head_dim;
                    for (int64_t d = 0; d < head_dim; d++) o[d] = acc[h * head_dim + d] * inv[h];
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
