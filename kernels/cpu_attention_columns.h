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
 * score_block then took those chains apart: one chain index at a time for SCORE_R query heads
 * by SCORE_C groups of keys, so that a column load feeds SCORE_R FMAs and a broadcast SCORE_C,
 * where each FMA had taken a broadcast and a column load of its own (GCC folds the loads into
 * the FMAs), and the loads, not the FMAs, had bound it (perf: 47 % of the attention's samples
 * on this loop, an AMD EPYC Zen 5). The eight chains' sums wait in L1 for the tree. With
 * exp16's softmax (cpu_attention.c), random-26m's shapes, eight prompts of 80-512 tokens in one
 * 2,048-token step, 2 threads, that Zen 5: 3.57-3.89 -> 2.97-3.20 ms (medians of 50,
 * alternating); random-26m's 128 prompts prefilled in 4.13-4.50 s against 4.34-4.70.
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

/* Query heads (of one KV head, any of the tile's queries) and groups of 16 keys whose scores
 * one pass computes: SCORE_R x SCORE_C accumulators, each d's SCORE_C column loads and
 * SCORE_R broadcasts feeding SCORE_R * SCORE_C FMAs. */
#define SCORE_R 4
#define SCORE_C 4

/* The scores of R query heads (qp[r], scaled) over C groups of 16 keys (the first group's
 * columns at col, the next group_stride floats on), into out[r][c * 16 ...]. Lane i's chain
 * (d = i, i + 8, ...) runs alone for every accumulator, its sums kept in part[i], then the
 * tree adds part[0..7]: score_tile's FMAs and sum8's order, key by key. */
static inline __attribute__((always_inline)) void score_block(
        const float *const *qp, const float *col, int64_t group_stride, int64_t head_dim,
        const int R, const int C, float *const *out) {
    float part[8][SCORE_R][SCORE_C][16] __attribute__((aligned(64)));
    for (int i = 0; i < 8; i++) {
        __m512 a[SCORE_R][SCORE_C];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) a[r][c] = _mm512_setzero_ps();
        for (int64_t d = i; d < head_dim; d += 8) {
            __m512 kv[SCORE_C];
            for (int c = 0; c < C; c++) kv[c] = _mm512_load_ps(col + c * group_stride + d * 16);
            for (int r = 0; r < R; r++) {
                const __m512 b = _mm512_set1_ps(qp[r][d]);
                for (int c = 0; c < C; c++) a[r][c] = _mm512_fmadd_ps(b, kv[c], a[r][c]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) _mm512_store_ps(part[i][r][c], a[r][c]);
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            const __m512 low = _mm512_add_ps(
                _mm512_add_ps(_mm512_load_ps(part[0][r][c]), _mm512_load_ps(part[1][r][c])),
                _mm512_add_ps(_mm512_load_ps(part[2][r][c]), _mm512_load_ps(part[3][r][c])));
            const __m512 high = _mm512_add_ps(
                _mm512_add_ps(_mm512_load_ps(part[4][r][c]), _mm512_load_ps(part[5][r][c])),
                _mm512_add_ps(_mm512_load_ps(part[6][r][c]), _mm512_load_ps(part[7][r][c])));
            _mm512_store_ps(out[r] + c * 16, _mm512_add_ps(low, high));
        }
}

/* score_block for R (1 to SCORE_R) pairs and C (1 to SCORE_C) groups */
static inline void score_blocks(const float *const *qp, const float *col, int64_t group_stride,
                                int64_t head_dim, int R, int C, float *const *out) {
#define SCORE_BLOCK(r, c) score_block(qp, col, group_stride, head_dim, r, c, out)
#define SCORE_BLOCKS(r) do { \
        if (C == 4) SCORE_BLOCK(r, 4); else if (C == 3) SCORE_BLOCK(r, 3); \
        else if (C == 2) SCORE_BLOCK(r, 2); else SCORE_BLOCK(r, 1); } while (0)
    if (R == 4) SCORE_BLOCKS(4);
    else if (R == 3) SCORE_BLOCKS(3);
    else if (R == 2) SCORE_BLOCKS(2);
    else SCORE_BLOCKS(1);
#undef SCORE_BLOCKS
#undef SCORE_BLOCK
}

/* The scores of nq queries (qs, scaled, qsize apart) over keys t_begin (a multiple of 16) to
 * t_end[i] - 1 of their sequence (`columns`: key_columns' groups of 16 from its first key), KV
 * heads kv_begin to kv_end, into scores [nq][num_heads][stride]. Per KV head, SCORE_C groups
 * of columns at a time serve, from L1, every (query, query head) pair that reaches them,
 * SCORE_R pairs a pass; a pair whose query stops inside the groups scores the keys past its
 * own too, inside its stride, which its softmax never reads. */
static inline void scores_over_columns(const float *qs, int64_t nq, const float *columns,
                                       int64_t t_begin, const int64_t *t_end, int64_t stride,
                                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                       int64_t kv_begin, int64_t kv_end, float *scores) {
    const int64_t group = num_heads / num_kv_heads, qsize = num_heads * head_dim;
    const int64_t group_stride = num_kv_heads * head_dim * 16;
    for (int64_t h = kv_begin; h < kv_end; h++)
        for (int64_t t0 = 0; t0 < stride; t0 += SCORE_C * 16) {
            const int C = (stride - t0) / 16 < SCORE_C ? (int)((stride - t0) / 16) : SCORE_C;
            const float *col = columns + ((t_begin + t0) / 16 * num_kv_heads + h) * head_dim * 16;
            const float *qp[SCORE_R];
            float *out[SCORE_R];
            int R = 0;
            for (int64_t i = 0; i < nq; i++) {
                if (t0 >= t_end[i] - t_begin) continue; /* query i's keys end before t0 */
                for (int64_t g = h * group; g < (h + 1) * group; g++) {
                    qp[R] = qs + i * qsize + g * head_dim;
                    out[R++] = scores + (i * num_heads + g) * stride + t0;
                    if (R == SCORE_R) {
                        score_blocks(qp, col, group_stride, head_dim, R, C, out);
                        R = 0;
                    }
                }
            }
            if (R > 0) score_blocks(qp, col, group_stride, head_dim, R, C, out);
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
