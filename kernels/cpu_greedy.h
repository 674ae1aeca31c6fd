/* What cpu_greedy.c's screen of a copy's logits and cpu_greedy_tiles.c's screen inside AMX's
 * product share: the bound, the float32 logit of a token in cpu_gemv.c's order, and the
 * settling of a row's argmax from its candidates (kernels/cpu_greedy.py states the bound). */
#ifndef PAGEDQ_CPU_GREEDY_H
#define PAGEDQ_CPU_GREEDY_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

#define SMALLEST_NORMAL 1.17549435e-38f

/* ||x - x'||: x' the inputs as the bfloat16 product takes them (rounded to nearest even, and
 * an input whose bfloat16 is below float's normal range counted whole: the instructions take
 * such inputs as zero) */
static inline double bf16_rounding_norm(const float *x, int64_t k) {
    double sum = 0.0;
    for (int64_t i = 0; i < k; i++) {
        const uint32_t bits = (uint32_t)to_bf16(x[i]) << 16;
        float rounded;
        memcpy(&rounded, &bits, sizeof rounded);
        const double d = fabsf(rounded) < SMALLEST_NORMAL ? fabsf(x[i]) : fabsf(x[i] - rounded);
        sum += d * d;
    }
    return sqrt(sum);
}

/* rounding[r]: ||x - x'|| of row r (bf16_rounding_norm), rounded up (cpu_greedy.c) */
void pagedq_bf16_rounding(const float *x, int64_t ldx, int64_t rows, int64_t k,
                          float *rounding);

/* Output j of x times the float32 weights in cpu_gemv.c's order: K in blocks of `block`
 * inputs, each an FMA chain from zero in input order, the blocks' sums added in order (the
 * layer has no bias). Weight (j, i) at w[j / 16 * strides[0] + j % 16 * strides[1] + i *
 * strides[2]]: the panels [vocab / 16][k][16], or rows [vocab][k] (a tied embedding's, which
 * a token reads as 2 KB in a run where a panel's column spans a line an input). */
static inline float exact_logit(const float *x, const float *w, const int64_t *strides,
                                int64_t k, int64_t block, int64_t j) {
    const float *wj = w + j / 16 * strides[0] + j % 16 * strides[1];
    const int64_t step = strides[2];
    float total = 0.0f;
    for (int64_t k0 = 0; k0 < k; k0 += block) {
        const int64_t k1 = k0 + block < k ? k0 + block : k;
        float part = 0.0f;
        for (int64_t i = k0; i < k1; i++) part = fmaf(x[i], wj[i * step], part);
        total = k0 == 0 ? part : total + part;
    }
    return total;
}

/* A token's bound, widened by far more than the float arithmetic computing it can be off (its
 * products and sums, 1e-3 of it; the approximate logit's rounding in the comparisons, 2^-20 of
 * it) */
static inline float bound(float a, float p, float q, float nx, float nd) {
    return (nx * p + nd * q) * 1.001f + fabsf(a) * 0x1p-20f + 1e-30f;
}

/* A row's float32 argmax being settled: the best token so far and its float32 logit, and the
 * tokens whose float32 logits were computed */
typedef struct {
    const float *x, *w, *p, *q;
    const int64_t *strides;
    int64_t k, block, best, seen;
    float nx, nd, top;
} settling;

/* the settling of row x from its approximation's best (its float32 logit the first top) */
static inline settling settle_from(const float *x, const float *w, const int64_t *strides,
                                   int64_t k, int64_t block, const float *p, const float *q,
                                   float nx, float nd, int64_t best) {
    return (settling){x, w, p, q, strides, k, block, best, 1, nx, nd,
                      exact_logit(x, w, strides, k, block, best)};
}

/* Token id, its approximation a, against the best so far: its float32 logit computed unless
 * its bound keeps it below */
static inline void consider(settling *s, int64_t id, float a, int64_t max_candidates) {
    if (id == s->best || a + bound(a, s->p[id], s->q[id], s->nx, s->nd) < s->top) return;
    const float logit = exact_logit(s->x, s->w, s->strides, s->k, s->block, id);
    s->seen = isfinite(logit) ? s->seen + 1 : max_candidates + 1;
    if (logit > s->top || (logit == s->top && id < s->best)) s->top = logit, s->best = id;
}

/* the row's token, or -1 where the bound left too many candidates or a non-finite logit */
static inline int64_t settled(const settling *s, int64_t max_candidates) {
    return s->seen <= max_candidates && isfinite(s->top) ? s->best : -1;
}

/* |x| of row x[0 .. k), rounded up */
static inline float norm_up(const float *x, int64_t k) {
    double norm = 0.0;
    for (int64_t i = 0; i < k; i++) norm += (double)x[i] * x[i];
    return (float)(sqrt(norm) * (1.0 + 1e-6));
}

#endif
