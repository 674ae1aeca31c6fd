/* The CPU paged attention of one query token, float32, AVX2 + FMA: compiled at first use by
 * kernels/cpu_native.py and called by kernels/cpu_ops.py's decode and prefill (numba threads,
 * one token per call, for its KV heads kv_begin to kv_end). Every sum runs in an order fixed
 * here, whatever the batch around the token and whichever heads a call takes (each head's
 * arithmetic is its own), so decode and prefill give a token the same bits.
 *
 * A token's keys are taken in chunks of CHUNK positions, each chunk's softmax partial (its
 * max, its sum of exponentials and its weighted values) by pagedq_attend_part, then combined
 * in chunk order by pagedq_attend_combine. The chunks are fixed by position, not by the
 * threads: the decode step (cpu_decode.c) runs them as parallel tasks, so that one long
 * sequence uses every core (SmolLM2's 3 KV heads had split 2:1 over two), and pagedq_attend
 * runs them in a row, with the same bits.
 *
 * Pool layout [num_blocks][block_size][num_kv_heads][head_dim]; head_dim a multiple of 8. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_kernels.h"

/* keys ahead whose K and V rows the scores' loop asks the memory for (V's for the values'
 * loop after it). One thread on cold keys, SmolLM2's 3 KV heads: 280 ns a key without, 175
 * with 8 keys ahead, 186 with 32 (Xeon, 2 cores) */
#define PREFETCH 8

static inline void prefetch_row(const float *k, const float *v, int64_t head_dim) {
    for (int64_t d = 0; d < head_dim; d += 16) {
        _mm_prefetch((const char *)(k + d), _MM_HINT_T0);
        _mm_prefetch((const char *)(v + d), _MM_HINT_T0);
    }
}

/* Query heads one load of a key's (or value's) row feeds: the sub-group's accumulators (8
 * keys by QGROUP heads) need AVX-512's 32 vector registers; AVX2's 16 hold one head's. */
#ifdef __AVX512F__
#define QGROUP 3
#else
#define QGROUP 1
#endif

/* The scores of 8 keys (rows[k], one KV head's) for the G query heads from g0: per head and
 * key, 8 lanes over head_dim, an FMA chain in d's order, then sum8. Every key row is loaded
 * once for the G heads. */
static inline __attribute__((always_inline)) void score_tile(
        const float *qs, const float *const *rows, int64_t head_dim, const int G, int64_t g0,
        float *scores, int64_t padded, int64_t t0) {
    __m256 a[QGROUP][8];
    for (int g = 0; g < G; g++)
        for (int k = 0; k < 8; k++) a[g][k] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
        __m256 qv[QGROUP];
        for (int g = 0; g < G; g++) qv[g] = _mm256_load_ps(qs + (g0 + g) * head_dim + d);
        for (int k = 0; k < 8; k++) {
            const __m256 kv = _mm256_loadu_ps(rows[k] + d);
            for (int g = 0; g < G; g++) a[g][k] = _mm256_fmadd_ps(qv[g], kv, a[g][k]);
        }
    }
    for (int g = 0; g < G; g++) _mm256_store_ps(scores + (g0 + g) * padded + t0, sum8(a[g]));
}

/* Adds n keys' weighted values (rows[k]) to the G query heads' sums from g0: each lane a chain
 * of FMAs in key order. In 16 lanes where head_dim allows (AVX-512): lane j of a 16-wide step
 * is the lane its 8-wide step would be, so the bits are the same. */
static inline __attribute__((always_inline)) void value_tile(
        const float *scores, int64_t padded, int64_t t0, const float *const *rows, int n,
        int64_t head_dim, const int G, int64_t g0, float *sums) {
    int64_t d = 0;
#ifdef __AVX512F__
    for (; d + 16 <= head_dim; d += 16) {
        __m512 x[QGROUP];
        for (int g = 0; g < G; g++) x[g] = _mm512_loadu_ps(sums + (g0 + g) * head_dim + d);
        for (int k = 0; k < n; k++) {
            const __m512 vv = _mm512_loadu_ps(rows[k] + d);
            for (int g = 0; g < G; g++)
                x[g] = _mm512_fmadd_ps(_mm512_set1_ps(scores[(g0 + g) * padded + t0 + k]), vv,
                                       x[g]);
        }
        for (int g = 0; g < G; g++) _mm512_storeu_ps(sums + (g0 + g) * head_dim + d, x[g]);
    }
#endif
    for (; d < head_dim; d += 8) {
        __m256 x[QGROUP];
        for (int g = 0; g < G; g++) x[g] = _mm256_loadu_ps(sums + (g0 + g) * head_dim + d);
        for (int k = 0; k < n; k++) {
            const __m256 vv = _mm256_loadu_ps(rows[k] + d);
            for (int g = 0; g < G; g++)
                x[g] = _mm256_fmadd_ps(_mm256_set1_ps(scores[(g0 + g) * padded + t0 + k]), vv,
                                       x[g]);
        }
        for (int g = 0; g < G; g++) _mm256_storeu_ps(sums + (g0 + g) * head_dim + d, x[g]);
    }
}

/* Keys t_begin to t_end of one query token, for KV heads kv_begin to kv_end: per query head g,
 * m[g] the highest score, s[g] the sum of exp(score - m[g]) and acc[g][:] the sum of
 * exp(score - m[g]) times the key's value. */
void pagedq_attend_part(const float *restrict q, const float *restrict k_cache,
                        const float *restrict v_cache, const int32_t *restrict table,
                        int64_t t_begin, int64_t t_end, float scale, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                        int64_t kv_begin, int64_t kv_end, float *restrict m,
                        float *restrict s, float *restrict acc) {
    const int64_t group = num_heads / num_kv_heads, row = num_kv_heads * head_dim;
    const int64_t g_begin = kv_begin * group, g_end = kv_end * group;
    const int64_t length = t_end - t_begin, padded = (length + 7) & ~(int64_t)7;
    float *scores = aligned_alloc(64, sizeof(float) * (size_t)(num_heads * padded));
    float *qs = aligned_alloc(64, sizeof(float) * (size_t)(num_heads * head_dim));
    float *sums = aligned_alloc(64, sizeof(float) * (size_t)(num_heads * head_dim));
    int64_t *offsets = malloc(sizeof(int64_t) * (size_t)padded);
    /* each key's row in the pool; the padding repeats the last key */
    for (int64_t t = 0; t < length; t++) {
        const int64_t p = t_begin + t;
        offsets[t] = ((int64_t)table[p / block_size] * block_size + p % block_size) * row;
    }
    for (int64_t t = length; t < padded; t++) offsets[t] = offsets[length - 1];
    for (int64_t i = g_begin * head_dim; i < g_end * head_dim; i++) {
        qs[i] = q[i] * scale;
        sums[i] = 0.0f;
    }
    /* scores, a tile of 8 keys for every head, QGROUP query heads at a time */
    for (int64_t t0 = 0; t0 < padded; t0 += 8) {
        if (t0 + PREFETCH < padded)
            for (int k = 0; k < 8; k++)
                for (int64_t h = kv_begin; h < kv_end; h++)
                    prefetch_row(k_cache + offsets[t0 + PREFETCH + k] + h * head_dim,
                                 v_cache + offsets[t0 + PREFETCH + k] + h * head_dim, head_dim);
        for (int64_t h = kv_begin; h < kv_end; h++) {
            const float *rows[8];
            for (int k = 0; k < 8; k++) rows[k] = k_cache + offsets[t0 + k] + h * head_dim;
            for (int64_t g = h * group; g < (h + 1) * group; g += QGROUP) {
                const int64_t G = (h + 1) * group - g < QGROUP ? (h + 1) * group - g : QGROUP;
                if (G == 3) score_tile(qs, rows, head_dim, 3, g, scores, padded, t0);
                else if (G == 2) score_tile(qs, rows, head_dim, 2, g, scores, padded, t0);
                else score_tile(qs, rows, head_dim, 1, g, scores, padded, t0);
            }
        }
    }
    /* softmax numerators, the padding's zeroed; each head's total summed in 8 lanes */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t g = g_begin; g < g_end; g++) {
        float *row_s = scores + g * padded, top = row_s[0];
        for (int64_t t = 1; t < length; t++) top = row_s[t] > top ? row_s[t] : top;
        const __m256 tv = _mm256_set1_ps(top);
        __m256 total = _mm256_setzero_ps();
        for (int64_t t0 = 0; t0 < padded; t0 += 8) {
            const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                _mm256_set1_epi32((int)(length - t0)), lane));
            const __m256 e = _mm256_and_ps(live, exp8(_mm256_sub_ps(_mm256_load_ps(row_s + t0), tv)));
            _mm256_store_ps(row_s + t0, e);
            total = _mm256_add_ps(total, e);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, total);
        m[g] = top;
        s[g] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
               ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    }
    /* out: keys in order, 8 at a time, into each head's accumulator */
    for (int64_t t0 = 0; t0 < length; t0 += 8) {
        const int n = length - t0 < 8 ? (int)(length - t0) : 8;
        for (int64_t h = kv_begin; h < kv_end; h++) {
            const float *rows[8];
            for (int k = 0; k < n; k++) rows[k] = v_cache + offsets[t0 + k] + h * head_dim;
            for (int64_t g = h * group; g < (h + 1) * group; g += QGROUP) {
                const int64_t G = (h + 1) * group - g < QGROUP ? (h + 1) * group - g : QGROUP;
                if (G == 3) value_tile(scores, padded, t0, rows, n, head_dim, 3, g, sums);
                else if (G == 2) value_tile(scores, padded, t0, rows, n, head_dim, 2, g, sums);
                else value_tile(scores, padded, t0, rows, n, head_dim, 1, g, sums);
            }
        }
    }
    for (int64_t i = g_begin * head_dim; i < g_end * head_dim; i++) acc[i] = sums[i];
    free(scores);
    free(qs);
    free(sums);
    free(offsets);
}

/* out[g] for query heads g_begin to g_end from `chunks` partials of pagedq_attend_part, chunk
 * c's at m + c * num_heads, s + c * num_heads, acc + c * num_heads * head_dim: each rescaled
 * by exp(its max - the highest), summed in chunk order, divided by the summed s. */
void pagedq_attend_combine(const float *m, const float *s, const float *acc, int64_t chunks,
                           int64_t num_heads, int64_t head_dim, int64_t g_begin, int64_t g_end,
                           float *out) {
    for (int64_t g = g_begin; g < g_end; g++) {
        float top = m[g], denom = 0.0f, *o = out + g * head_dim;
        for (int64_t c = 1; c < chunks; c++) {
            const float mc = m[c * num_heads + g];
            top = mc > top ? mc : top;
        }
        for (int64_t d = 0; d < head_dim; d += 8) _mm256_storeu_ps(o + d, _mm256_setzero_ps());
        for (int64_t c = 0; c < chunks; c++) {
            const __m256 w = exp8(_mm256_set1_ps(m[c * num_heads + g] - top));
            denom += s[c * num_heads + g] * _mm256_cvtss_f32(w);
            const float *a = acc + (c * num_heads + g) * head_dim;
            for (int64_t d = 0; d < head_dim; d += 8)
                _mm256_storeu_ps(o + d, _mm256_fmadd_ps(_mm256_loadu_ps(a + d), w,
                                                        _mm256_loadu_ps(o + d)));
        }
        const __m256 dv = _mm256_set1_ps(denom);
        for (int64_t d = 0; d < head_dim; d += 8)
            _mm256_storeu_ps(o + d, _mm256_div_ps(_mm256_loadu_ps(o + d), dv));
    }
}

/* One query token over its first `length` keys, for KV heads kv_begin to kv_end: its chunks in
 * a row, then their combination. */
void pagedq_attend(const float *restrict q, const float *restrict k_cache,
                   const float *restrict v_cache, const int32_t *restrict table,
                   int64_t length, float scale, float *restrict out, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                   int64_t kv_begin, int64_t kv_end) {
    const int64_t chunks = (length + CHUNK - 1) / CHUNK, group = num_heads / num_kv_heads;
    float *m = malloc(sizeof(float) * (size_t)(chunks * num_heads));
    float *s = malloc(sizeof(float) * (size_t)(chunks * num_heads));
    float *acc = malloc(sizeof(float) * (size_t)(chunks * num_heads * head_dim));
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t end = (c + 1) * CHUNK < length ? (c + 1) * CHUNK : length;
        pagedq_attend_part(q, k_cache, v_cache, table, c * CHUNK, end, scale, num_heads,
                           num_kv_heads, head_dim, block_size, kv_begin, kv_end,
                           m + c * num_heads, s + c * num_heads, acc + c * num_heads * head_dim);
    }
    pagedq_attend_combine(m, s, acc, chunks, num_heads, head_dim, kv_begin * group,
                          kv_end * group, out);
    free(m);
    free(s);
    free(acc);
}
