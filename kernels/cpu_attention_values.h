/* The attention's value sums (kernels/cpu_attention.c): each query head's weighted values over
 * a chunk's keys, held in registers, and how many query heads share one load of a row. */
#ifndef PAGEDQ_CPU_ATTENTION_VALUES_H
#define PAGEDQ_CPU_ATTENTION_VALUES_H
#include <immintrin.h>
#include <stdint.h>

#include "cpu_kernels.h"

/* Query heads one load of a key's (or value's) row feeds: the sub-group's accumulators (8
 * keys by QGROUP heads) need AVX-512's 32 vector registers; AVX2's 16 hold one head's. */
#ifdef __AVX512F__
#define QGROUP 3
#else
#define QGROUP 1
#endif

/* The values' sums run in VW lanes (16 with AVX-512, else 8), SLAB vectors of head_dim at a
 * time: a slab's sums stay in registers over all of a query's keys. */
#ifdef __AVX512F__
#define VW 16
typedef __m512 vsum;
#define VZERO _mm512_setzero_ps
#define VLOAD_KV load16_stored
#define VSTORE _mm512_storeu_ps
#define VFMA _mm512_fmadd_ps
#define VSET1 _mm512_set1_ps
#else
#define VW 8
typedef __m256 vsum;
#define VZERO _mm256_setzero_ps
#define VLOAD_KV load8_stored
#define VSTORE _mm256_storeu_ps
#define VFMA _mm256_fmadd_ps
#define VSET1 _mm256_set1_ps
#endif
#define SLAB 4

/* sums[g][d0 .. d0 + S * VW) for the G query heads from g0: the weighted values of keys 0 to
 * length (rows at v + offsets[t]), each lane one chain of FMAs from zero in key order. Every
 * lane's chain is the one an 8-wide step per tile of keys makes (the previous kernel's, and
 * AVX2's), so the bits are the same; held in registers over the keys, the G * S chains
 * interleave, where a tile's store and reload had put each chain's latency in the way (half
 * the attention's time in perf, SmolLM2's shapes). With Q = 2, a second query's (scores and
 * sums `next` further on, its own length[1]) share each value row's loads: a prefill's
 * queries had each read the chunk's values again from L2 (with the scores over columns, SmolLM2's
 * shapes, four 512-token prompts, 2 threads, a Xeon: 8.0 -> 7.1 ms). Each query's chain stops at
 * its own length, so its bits are those it gets alone. */
static inline __attribute__((always_inline)) void value_slab(
        const float *scores, int64_t stride, const stored_t *v, const int64_t *offsets,
        const int64_t *length, const int Q, const int G, const int S, int64_t g0, float *sums,
        int64_t head_dim, int64_t d0, int64_t next_scores, int64_t next_sums) {
    vsum x[2][QGROUP][SLAB];
    for (int q = 0; q < Q; q++)
        for (int g = 0; g < G; g++)
            for (int j = 0; j < S; j++) x[q][g][j] = VZERO();
    const int64_t longest = Q == 2 && length[1] > length[0] ? length[1] : length[0];
    for (int64_t t = 0; t < longest; t++) {
        const stored_t *row = v + offsets[t] + d0;
        vsum vv[SLAB];
        for (int j = 0; j < S; j++) vv[j] = VLOAD_KV(row + j * VW);
        for (int q = 0; q < Q; q++) {
            if (Q == 2 && t >= length[q]) continue;
            for (int g = 0; g < G; g++) {
                const vsum p = VSET1(scores[q * next_scores + (g0 + g) * stride + t]);
                for (int j = 0; j < S; j++) x[q][g][j] = VFMA(p, vv[j], x[q][g][j]);
            }
        }
    }
    for (int q = 0; q < Q; q++)
        for (int g = 0; g < G; g++)
            for (int j = 0; j < S; j++)
                VSTORE(sums + q * next_sums + (g0 + g) * head_dim + d0 + j * VW, x[q][g][j]);
}

#ifdef __AVX512F__
/* value_slab for the last 8 lanes of a head_dim that 16 does not divide */
static inline __attribute__((always_inline)) void value_tail8(
        const float *scores, int64_t stride, const stored_t *v, const int64_t *offsets,
        int64_t length, const int G, int64_t g0, float *sums, int64_t head_dim, int64_t d0) {
    __m256 x[QGROUP];
    for (int g = 0; g < G; g++) x[g] = _mm256_setzero_ps();
    for (int64_t t = 0; t < length; t++) {
        const __m256 vv = load8_stored(v + offsets[t] + d0);
        for (int g = 0; g < G; g++)
            x[g] = _mm256_fmadd_ps(_mm256_set1_ps(scores[(g0 + g) * stride + t]), vv, x[g]);
    }
    for (int g = 0; g < G; g++) _mm256_storeu_ps(sums + (g0 + g) * head_dim + d0, x[g]);
}
#endif

/* Every value slab of the G query heads from g0 (KV head h's values at v), for Q queries
 * (value_slab). */
static inline __attribute__((always_inline)) void value_pass(
        const float *scores, int64_t stride, const stored_t *v, const int64_t *offsets,
        const int64_t *length, const int Q, const int G, int64_t g0, float *sums,
        int64_t head_dim, int64_t next_scores, int64_t next_sums) {
    int64_t d0 = 0;
#define VALUE_SLAB(S) value_slab(scores, stride, v, offsets, length, Q, G, S, g0, sums, head_dim, \
                                 d0, next_scores, next_sums)
    for (; d0 + SLAB * VW <= head_dim; d0 += SLAB * VW) VALUE_SLAB(SLAB);
    const int64_t rest = (head_dim - d0) / VW;
    if (rest == 3) VALUE_SLAB(3);
    if (rest == 2) VALUE_SLAB(2);
    if (rest == 1) VALUE_SLAB(1);
#undef VALUE_SLAB
    d0 += rest * VW;
#ifdef __AVX512F__
    for (int q = 0; d0 < head_dim && q < Q; q++)
        value_tail8(scores + q * next_scores, stride, v, offsets, length[q], G, g0,
                    sums + q * next_sums, head_dim, d0);
#endif
}

#endif
