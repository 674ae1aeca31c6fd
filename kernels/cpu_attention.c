/* The CPU paged attention's per-token body, float32, AVX2 + FMA (AVX-512 where built for it):
 * compiled at first use by kernels/cpu_native.py; run by cpu_attention_tasks.c's parallel
 * loops (a decode step's, a prefill's) and by cpu_decode.c. Every sum runs in an order fixed
 * here, whatever the batch around the token, whichever heads a call takes (each head's
 * arithmetic is its own) and however many tokens share a call's key loads, so decode and
 * prefill give a token the same bits.
 *
 * A token's keys are taken in chunks of CHUNK positions, each chunk's softmax partial (its
 * max, its sum of exponentials and its weighted values) by pagedq_attend_parts, then combined
 * in chunk order by pagedq_attend_combine (cpu_attention_tasks.c). A prefill's scores may read
 * its keys as columns (cpu_attention_columns.h), with the same bits. The chunks are fixed by
 * position, not by the threads, so that one long sequence's chunks run on every core with the
 * same bits.
 *
 * Pool layout [num_blocks][block_size][num_kv_heads][head_dim]; head_dim a multiple of 8. The
 * pools hold float32, or bfloat16 in cpu_bf16.c's build (stored_t, widened as they load). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_attention_ahead.h"
#include "cpu_attention_columns.h"
#include "cpu_attention_pairs.h"
#include "cpu_attention_values.h"
#include "cpu_kernels.h"

/* The scores of 8 keys (rows[k], one KV head's) for the G query heads from g0: per head and
 * key, 8 lanes over head_dim, an FMA chain in d's order, then sum8. Every key row is loaded
 * once for the G heads. Each step of 8 asks for its share of `ahead`'s lines. */
static inline __attribute__((always_inline)) void score_tile(
        const float *qs, const stored_t *const *rows, int64_t head_dim, const int G, int64_t g0,
        float *scores, int64_t padded, int64_t t0, ahead_t *ahead) {
    __m256 a[QGROUP][8];
    for (int g = 0; g < G; g++)
        for (int k = 0; k < 8; k++) a[g][k] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
        ahead_ask(ahead);
        __m256 qv[QGROUP];
        for (int g = 0; g < G; g++) qv[g] = _mm256_load_ps(qs + (g0 + g) * head_dim + d);
        for (int k = 0; k < 8; k++) {
            const __m256 kv = load8_stored(rows[k] + d);
            for (int g = 0; g < G; g++) a[g][k] = _mm256_fmadd_ps(qv[g], kv, a[g][k]);
        }
    }
    for (int g = 0; g < G; g++) _mm256_store_ps(scores + (g0 + g) * padded + t0, sum8(a[g]));
}

/* The highest of x[0 .. n), n > 0: 8 lanes, then across them (a max is exact in any order;
 * the scalar scan's chain of compares had taken a tenth of the attention's time in perf). */
static inline float max_of(const float *x, int64_t n) {
    __m256 top = _mm256_set1_ps(x[0]);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) top = _mm256_max_ps(_mm256_loadu_ps(x + t), top);
    float lanes[8], best = x[0];
    _mm256_storeu_ps(lanes, top);
    for (int k = 0; k < 8; k++) best = lanes[k] > best ? lanes[k] : best;
    for (; t < n; t++) best = x[t] > best ? x[t] : best;
    return best;
}

/* The chunk partials of nq query tokens of one sequence over the same keys from t_begin, query
 * i's up to t_end[i], for KV heads kv_begin to kv_end: per query head g, m[g] the highest
 * score, s[g] the sum of exp(score - m[g]) and acc[g][:] the sum of exp(score - m[g]) times
 * the key's value; query i's q at q + i * ldq, its m and s at + i * ld_m, its acc at
 * + i * ld_m * head_dim. Each query's arithmetic is the one-query call's: its scores, softmax
 * and values in the same order. Only the loads are shared: each tile of 8 keys' rows serves
 * every query from L1, where one query at a time had read a prefill's keys again per token
 * (random-26m's 128 prompts: 98 GB a run from L2 and L3). Returns 0, or -1 where scratch
 * memory could not be had (m, s and acc are then undefined). */
int NAME(pagedq_attend_parts)(const float *restrict q, int64_t ldq, int64_t nq,
                              const stored_t *restrict k_cache,
                              const stored_t *restrict v_cache, const int32_t *restrict table,
                              int64_t t_begin, const int64_t *restrict t_end, float scale,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t block_size, int64_t kv_begin, int64_t kv_end,
                              float *restrict m, float *restrict s, float *restrict acc,
                              int64_t ld_m, const float *restrict columns) {
    const int64_t group = num_heads / num_kv_heads, row = num_kv_heads * head_dim;
    const int64_t g_begin = kv_begin * group, g_end = kv_end * group;
    const int64_t qsize = num_heads * head_dim;
    int64_t longest = 0;
    for (int64_t i = 0; i < nq; i++)
        longest = t_end[i] - t_begin > longest ? t_end[i] - t_begin : longest;
    /* a head's scores, every query's: whole tiles of 8 keys, or of 16 over columns */
    const int64_t pad = COLUMNS && columns ? 15 : 7, stride = (longest + pad) & ~pad;
    float *scores = aligned_alloc(64, sizeof(float) * (size_t)(nq * num_heads * stride));
    float *qs = aligned_alloc(64, sizeof(float) * (size_t)(nq * qsize));
    int64_t *offsets = malloc(sizeof(int64_t) * (size_t)stride);
    if (!scores || !qs || !offsets) {
        free(scores);
        free(qs);
        free(offsets);
        return -1;
    }
    /* each key's row in the pool; the padding repeats the last key (a query's padding past its
     * own keys reads later ones: its scores are masked out of the softmax either way) */
    for (int64_t t = 0; t < longest;) { /* a block's run of slots at a time: one division */
        const int64_t p = t_begin + t, base = (int64_t)table[p / block_size] * block_size;
        for (int64_t j = p % block_size; j < block_size && t < longest; j++, t++)
            offsets[t] = (base + j) * row;
    }
    for (int64_t t = longest; t < stride; t++) offsets[t] = offsets[longest - 1];
    for (int64_t i = 0; i < nq; i++)
        for (int64_t e = g_begin * head_dim; e < g_end * head_dim; e++)
            qs[i * qsize + e] = q[i * ldq + e] * scale;
#if PAIRED
    /* the scaled queries, then the numerators, as bfloat16 pairs (cpu_attention_pairs.h) */
    const int paired = head_dim % 32 == 0;
    const int64_t ldp = stride / 2;
    uint32_t *qp = paired ? malloc(sizeof(uint32_t) * (size_t)(nq * (qsize + num_heads * stride)
                                                                / 2)) : 0;
    uint32_t *pp = paired ? qp + nq * qsize / 2 : 0;
    if (paired && !qp) {
        free(scores);
        free(qs);
        free(offsets);
        return -1;
    }
    for (int64_t i = 0; paired && i < nq; i++)
        for (int64_t g = g_begin; g < g_end; g++)
            to_pairs(qs + i * qsize + g * head_dim, head_dim,
                     qp + (i * qsize + g * head_dim) / 2);
#endif
    /* scores, a tile of 8 keys for every head, QGROUP query heads at a time; a tile's steps
     * (each asks for a share of the lines ahead) are 8 of head_dim, 32 in pairs, per KV head */
#if PAIRED
    const int64_t steps = (kv_end - kv_begin) * (head_dim / (paired ? 32 : 8));
#else
    const int64_t steps = (kv_end - kv_begin) * (head_dim / 8);
#endif
#if COLUMNS
    if (columns)
        scores_over_columns(qs, nq, columns, t_begin, t_end, stride, num_heads, num_kv_heads,
                            head_dim, kv_begin, kv_end, scores);
    for (int64_t t0 = 0; !columns && t0 < stride; t0 += 8) {
#else
    (void)columns;
    for (int64_t t0 = 0; t0 < stride; t0 += 8) {
#endif
        ahead_t ahead;
        ahead_start(&ahead, k_cache, v_cache, offsets, t0, stride, kv_begin, kv_end, head_dim,
                    steps);
        for (int64_t h = kv_begin; h < kv_end; h++) {
            const stored_t *rows[8];
            for (int k = 0; k < 8; k++) rows[k] = k_cache + offsets[t0 + k] + h * head_dim;
            ahead_t *asks = &ahead; /* the first query that computes the tile asks */
            for (int64_t i = 0; i < nq; i++) {
                if (t0 >= t_end[i] - t_begin) continue;
                const float *qi = qs + i * qsize;
                float *si = scores + i * num_heads * stride;
                for (int64_t g = h * group; g < (h + 1) * group; g += QGROUP) {
                    const int64_t G = (h + 1) * group - g < QGROUP ? (h + 1) * group - g : QGROUP;
                    ahead_t *a = g == h * group ? asks : 0;
#if PAIRED
                    const uint32_t *qpi = qp + i * qsize / 2;
                    if (paired && G == 3) score_tile_pairs(qpi, rows, head_dim, 3, g, si, stride,
                                                           t0, a);
                    else if (paired && G == 2) score_tile_pairs(qpi, rows, head_dim, 2, g, si,
                                                                stride, t0, a);
                    else if (paired) score_tile_pairs(qpi, rows, head_dim, 1, g, si, stride, t0,
                                                      a);
                    else
#endif
                    if (G == 3) score_tile(qi, rows, head_dim, 3, g, si, stride, t0, a);
                    else if (G == 2) score_tile(qi, rows, head_dim, 2, g, si, stride, t0, a);
                    else score_tile(qi, rows, head_dim, 1, g, si, stride, t0, a);
                }
                asks = 0;
            }
        }
    }
    /* softmax numerators, the padding's zeroed; each head's total summed in 8 lanes */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t i = 0; i < nq; i++) {
        const int64_t length = t_end[i] - t_begin, padded = (length + 7) & ~(int64_t)7;
        for (int64_t g = g_begin; g < g_end; g++) {
            float *row_s = scores + (i * num_heads + g) * stride;
            const float top = max_of(row_s, length);
            const __m256 tv = _mm256_set1_ps(top);
            __m256 total = _mm256_setzero_ps();
            int64_t t0 = 0;
#ifdef __AVX512F__
            /* 16 at a time, each half added to the 8 lanes in turn: exp8's bits, its sums */
            for (; t0 + 16 <= padded; t0 += 16) {
                const __mmask16 live = length - t0 >= 16 ? 0xffff
                                       : (__mmask16)((1u << (length - t0)) - 1);
                const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(
                    _mm512_loadu_ps(row_s + t0), _mm512_set1_ps(top))));
                _mm512_storeu_ps(row_s + t0, e);
                total = _mm256_add_ps(total, _mm512_castps512_ps256(e));
                total = _mm256_add_ps(total, _mm256_castpd_ps(_mm512_extractf64x4_pd(
                    _mm512_castps_pd(e), 1)));
            }
#endif
            for (; t0 < padded; t0 += 8) {
                const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                    _mm256_set1_epi32((int)(length - t0)), lane));
                const __m256 e = _mm256_and_ps(
                    live, exp8(_mm256_sub_ps(_mm256_load_ps(row_s + t0), tv)));
                _mm256_store_ps(row_s + t0, e);
                total = _mm256_add_ps(total, e);
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, total);
            m[i * ld_m + g] = top;
            s[i * ld_m + g] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                              ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
#if PAIRED
            if (paired) to_pairs(row_s, padded, pp + (i * num_heads + g) * ldp);
#endif
        }
    }
    /* acc: each query head's values, its sums over the keys in order (value_pass writes them
     * whole) */
    for (int64_t i = 0; i < nq;) {
        /* two queries at a time share the value rows' loads (value_slab); one in pairs */
#if PAIRED
        const int Q = nq - i > 1 && !paired ? 2 : 1;
#else
        const int Q = nq - i > 1 ? 2 : 1;
#endif
        const int64_t length[2] = {t_end[i] - t_begin, Q == 2 ? t_end[i + 1] - t_begin : 0};
        const int64_t next_scores = num_heads * stride, next_sums = ld_m * head_dim;
        const float *si = scores + i * next_scores;
        float *ai = acc + i * next_sums;
        for (int64_t h = kv_begin; h < kv_end; h++)
            for (int64_t g = h * group; g < (h + 1) * group; g += QGROUP) {
                const int64_t G = (h + 1) * group - g < QGROUP ? (h + 1) * group - g : QGROUP;
                const stored_t *vh = v_cache + h * head_dim;
#if PAIRED
                const uint32_t *ppi = pp + i * num_heads * ldp;
                const int64_t npairs = (length[0] + 1) / 2;
                if (paired && G == 3)
                    value_pass_pairs(ppi, ldp, vh, offsets, npairs, 3, g, ai, head_dim);
                else if (paired && G == 2)
                    value_pass_pairs(ppi, ldp, vh, offsets, npairs, 2, g, ai, head_dim);
                else if (paired)
                    value_pass_pairs(ppi, ldp, vh, offsets, npairs, 1, g, ai, head_dim);
                else
#endif
#define VALUE_PASS(Q, G) value_pass(si, stride, vh, offsets, length, Q, G, g, ai, head_dim, \
                                    next_scores, next_sums)
                if (Q == 2 && G == 3) VALUE_PASS(2, 3);
                else if (Q == 2 && G == 2) VALUE_PASS(2, 2);
                else if (Q == 2) VALUE_PASS(2, 1);
                else if (G == 3) VALUE_PASS(1, 3);
                else if (G == 2) VALUE_PASS(1, 2);
                else VALUE_PASS(1, 1);
#undef VALUE_PASS
            }
        i += Q;
    }
    free(scores);
    free(qs);
    free(offsets);
#if PAIRED
    free(qp);
#endif
    return 0;
}
