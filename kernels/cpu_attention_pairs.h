/* The attention's scores and value sums in pairs of bfloat16s (vdpbf16ps), for bfloat16 pools
 * on CPUs with AVX-512 BF16 (cpu_attention.c's bfloat16 build, head_dim a multiple of 32).
 *
 * Why: widened to floats, a bfloat16 key cost as many instructions as a float one, and the
 * attention was bound by them, not by the memory (random-26m's shapes, 8 sequences cached: 34
 * ns a key both ways; 110 sequences from memory: 57 ns bfloat16, 109 float32; AMD EPYC Zen 4,
 * 2 threads). A vdpbf16ps multiplies and adds 32 pairs where an FMA takes 8 or 16 floats.
 *
 * What it rounds: the scaled query and the softmax numerators to bfloat16 (as flash
 * attention's bfloat16 kernels round P), every product exact and summed in float32. Scores sum
 * a head's pairs in 16 lanes, then the lanes; values sum each pair of keys' products per lane
 * in key order. A token's arithmetic does not depend on the other queries that share its key
 * loads, so prefill and decode still agree bit for bit. */
#ifndef PAGEDQ_CPU_ATTENTION_PAIRS_H
#define PAGEDQ_CPU_ATTENTION_PAIRS_H
#include <immintrin.h>
#include <stdint.h>

#include "cpu_attention_ahead.h"
#include "cpu_attention_values.h"
#include "cpu_kernels.h"

#if PAIRED
/* The scores of 8 keys (rows[k], one KV head's) for the G query heads from g0, their scaled
 * queries as bfloat16 pairs at qp (head_dim / 2 a head); each step asks for `ahead`'s share. */
static inline __attribute__((always_inline)) void score_tile_pairs(
        const uint32_t *qp, const stored_t *const *rows, int64_t head_dim, const int G, int64_t g0,
        float *scores, int64_t padded, int64_t t0, ahead_t *ahead) {
    __m512 a[QGROUP][8];
    for (int g = 0; g < G; g++)
        for (int k = 0; k < 8; k++) a[g][k] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 32) {
        ahead_ask(ahead);
        __m512bh qv[QGROUP];
        for (int g = 0; g < G; g++)
            qv[g] = (__m512bh)_mm512_loadu_si512(qp + (g0 + g) * head_dim / 2 + d / 2);
        for (int k = 0; k < 8; k++) {
            const __m512bh kv = (__m512bh)_mm512_loadu_si512(rows[k] + d);
            for (int g = 0; g < G; g++) a[g][k] = _mm512_dpbf16_ps(a[g][k], qv[g], kv);
        }
    }
    for (int g = 0; g < G; g++) {
        __m256 half[8];
        for (int k = 0; k < 8; k++)
            half[k] = _mm256_add_ps(_mm512_castps512_ps256(a[g][k]),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(
                                        _mm512_castps_pd(a[g][k]), 1)));
        _mm256_store_ps(scores + (g0 + g) * padded + t0, sum8(half));
    }
}

/* value_pass over bfloat16 pairs: sums[g][:] for the G query heads from g0, over pairs of
 * keys (2i, 2i + 1) below 2 * npairs, their numerators as bfloat16 pairs at pp + g * ldp (a
 * padding key's numerator zero). The two keys' rows interleave (unpack) into the pairs a
 * vdpbf16ps takes, lanes in the unpack's order, put back in head_dim's order at the end; 64
 * of head_dim at a time. */
static inline __attribute__((always_inline)) void value_pass_pairs(
        const uint32_t *pp, int64_t ldp, const stored_t *v, const int64_t *offsets, int64_t npairs,
        const int G, int64_t g0, float *sums, int64_t head_dim) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21,
                                            22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15,
                                             28, 29, 30, 31);
    for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
        const int S = head_dim - d0 >= 64 ? 2 : 1; /* 32-wide chunks in this slab */
        __m512 lo[QGROUP][2], hi[QGROUP][2];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < S; c++) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
        for (int64_t i = 0; i < npairs; i++) {
            const stored_t *r0 = v + offsets[2 * i] + d0, *r1 = v + offsets[2 * i + 1] + d0;
            __m512bh pl[2], ph[2];
            for (int c = 0; c < S; c++) {
                const __m512i a = _mm512_loadu_si512(r0 + 32 * c);
                const __m512i b = _mm512_loadu_si512(r1 + 32 * c);
                pl[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
                ph[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
            }
            for (int g = 0; g < G; g++) {
                const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pp[(g0 + g) * ldp + i]);
                for (int c = 0; c < S; c++) {
                    lo[g][c] = _mm512_dpbf16_ps(lo[g][c], p, pl[c]);
                    hi[g][c] = _mm512_dpbf16_ps(hi[g][c], p, ph[c]);
                }
            }
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < S; c++) {
                float *out = sums + (g0 + g) * head_dim + d0 + 32 * c;
                _mm512_storeu_ps(out, _mm512_permutex2var_ps(lo[g][c], first, hi[g][c]));
                _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(lo[g][c], second, hi[g][c]));
            }
    }
}
#endif

#endif
