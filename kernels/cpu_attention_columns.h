/* The prefill's scores over keys laid out as columns (kernels/cpu_attention.c): 16 keys of one
 * KV head as [head_dim][16], so that one vector holds an element of 16 keys and the FMAs run
 * across keys. pagedq_prefill (cpu_attention_tasks.c) lays a sequence's keys out so once per
 * call, for every query tile that reads them.
 *
 * The bits are score_tile's: there, key k's score is lane i of an 8-lane FMA chain over d (lane
 * i takes d = i, i + 8, ...), then sum8's tree ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 +
 * l7)). Here a[i] holds lane i's chain for 16 keys at once, the same FMAs in the same order,
 * and the tree adds the eight vectors. What changes is the work per score: 4 full-width FMAs
 * and no shuffles, where score_tile's took 8 half-width ones and sum8's horizontal adds. The
 * prefill's attention, SmolLM2's shapes (9 query heads, 3 KV heads), four 512-token prompts, 2
 * threads, a Xeon with AVX-512: 9.4-9.6 -> 8.0 ms; random-26m's (8 and 4 heads) 10.4-10.8 ->
 * 8.8 ms; with value_slab's two-query pass, 9.9-10.2 -> 7.3-7.4 and 11.1 -> 7.8-8.2 (a later,
 * slower hour of the same machine). Laying the keys out costs ~2 % of it (perf).
 *
 * Only the float32 build with AVX-512 (COLUMNS): elsewhere pagedq_prefill passes no columns and
 * score_tile computes every token. */
#ifndef PAGEDQ_CPU_ATTENTION_COLUMNS_H
#define PAGEDQ_CPU_ATTENTION_COLUMNS_H
#include <immintrin.h>
#include <stdint.h>

#include "cpu_attention_values.h"
#include "cpu_kernels.h"

#if !defined(PAGEDQ_BF16) && defined(__AVX512F__)
#define COLUMNS 1

/* The scores of 16 keys (`columns`, one KV head's) for the G query heads from g0, into
 * scores[(g0 + g) * stride + t0 ...], t0 a multiple of 16. */
static inline __attribute__((always_inline)) void score_columns(
        const float *qs, const float *columns, int64_t head_dim, const int G, int64_t g0,
        float *scores, int64_t stride, int64_t t0) {
    __m512 a[QGROUP][8];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < 8; i++) a[g][i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8)
        for (int i = 0; i < 8; i++) {
            const __m512 kv = _mm512_load_ps(columns + (d + i) * 16);
            for (int g = 0; g < G; g++)
                a[g][i] = _mm512_fmadd_ps(_mm512_set1_ps(qs[(g0 + g) * head_dim + d + i]), kv,
                                          a[g][i]);
        }
    for (int g = 0; g < G; g++) {
        const __m512 low = _mm512_add_ps(_mm512_add_ps(a[g][0], a[g][1]),
                                         _mm512_add_ps(a[g][2], a[g][3]));
        const __m512 high = _mm512_add_ps(_mm512_add_ps(a[g][4], a[g][5]),
                                          _mm512_add_ps(a[g][6], a[g][7]));
        _mm512_store_ps(scores + (g0 + g) * stride + t0, _mm512_add_ps(low, high));
    }
}

/* score_columns for query heads g_begin to g_end (one KV head's), QGROUP at a time */
static inline void score_columns_heads(const float *qi, const float *col, int64_t head_dim,
                                       int64_t g_begin, int64_t g_end, float *si,
                                       int64_t stride, int64_t t0) {
    for (int64_t g = g_begin; g < g_end; g += QGROUP) {
        if (g_end - g >= 3) score_columns(qi, col, head_dim, 3, g, si, stride, t0);
        else if (g_end - g == 2) score_columns(qi, col, head_dim, 2, g, si, stride, t0);
        else score_columns(qi, col, head_dim, 1, g, si, stride, t0);
    }
}

/* The scores of nq queries (qs, scaled, qsize apart) over keys t_begin (a multiple of 16) to
 * t_end[i] - 1 of their sequence (`columns`: key_columns' groups of 16 from its first key), KV
 * heads kv_begin to kv_end, into scores [nq][num_heads][stride]. A group's columns serve every
 * query from L1. */
static inline void scores_over_columns(const float *qs, int64_t nq, const float *columns,
                                       int64_t t_begin, const int64_t *t_end, int64_t stride,
                                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                       int64_t kv_begin, int64_t kv_end, float *scores) {
    const int64_t group = num_heads / num_kv_heads, qsize = num_heads * head_dim;
    for (int64_t t0 = 0; t0 < stride; t0 += 16)
        for (int64_t h = kv_begin; h < kv_end; h++) {
            const float *col = columns + ((t_begin + t0) / 16 * num_kv_heads + h) * head_dim * 16;
            for (int64_t i = 0; i < nq; i++)
                if (t0 < t_end[i] - t_begin)
                    score_columns_heads(qs + i * qsize, col, head_dim, h * group,
                                        (h + 1) * group, scores + i * num_heads * stride, stride,
                                        t0);
        }
}

/* Keys t0 to t0 + 15 of a sequence (its blocks at table; rows of `row` floats in the pool) as
 * columns: dst[e * 16 + j] is key t0 + j's element e, zero past n_keys. */
static inline void key_columns(const float *k_cache, const int32_t *table, int64_t block_size,
                               int64_t row, int64_t t0, int64_t n_keys, float *dst) {
    for (int64_t j = 0; j < 16; j++) {
        const int64_t t = t0 + j;
        const float *src = t < n_keys
            ? k_cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row : 0;
        for (int64_t e = 0; e < row; e++) dst[e * 16 + j] = src ? src[e] : 0.0f;
    }
}
#else
#define COLUMNS 0
#endif

#endif
