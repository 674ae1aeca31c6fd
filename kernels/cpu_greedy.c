/* A greedy step's tokens without the float32 output layer: approximate logits from a copy of
 * its weights (bfloat16: half the bytes, AMX's or AVX-512 BF16's rate; int8: cpu_screen.c), a
 * proven bound on how far each can be from the float32 logit, and the float32 logits of the
 * few tokens the bound cannot rule out, computed in cpu_gemv.c's order, so that they have the
 * bits of the float32 layer in any batch. Compiled at first use by kernels/cpu_native.py;
 * called by kernels/cpu_greedy.py, which states the bound.
 *
 * Why: the output layer (SmolLM2's 49,152 x 576) was the largest product of a decode step: at
 * 32 rows 7.2 ms of float32 against 2.9 for the bfloat16 copy, at one row 4.1 against 2.6 (a
 * Xeon with AMX, 2 threads, cold). A greedy token is the argmax, which needs the exact value
 * only of the tokens within the bound of the best (2 a row at the median, 10 at most, on
 * SmolLM2's states of random prompts). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "cpu_greedy.h"

/* rounding[r]: ||x - x'|| of row r (bf16_rounding_norm), rounded up */
void pagedq_bf16_rounding(const float *x, int64_t ldx, int64_t rows, int64_t k,
                          float *rounding) {
    for (int64_t r = 0; r < rows; r++)
        rounding[r] = (float)(bf16_rounding_norm(x + r * ldx, k) * (1.0 + 1e-6));
}

/* Row r's token: tokens[r] = the lowest id of the highest float32 logit, or -1 where the
 * approximation cannot settle it here (a non-finite value, more than max_candidates tokens
 * within the bound). approx [rows][vocab] (row stride ld_approx): the copy's products; w
 * and strides: the float32 weights (exact_logit); p and q [vocab]: the float32 logit of token
 * j is within |x| * p[j] + |x - x'| * q[j] of its approximation, x' the inputs as the copy's
 * product took them (kernels/cpu_greedy.py derives p and q), p_max and q_max their highest;
 * rounding[rows]: each row's |x - x'| rounded up (NULL: x' is x).
 *
 * The float32 logit of the approximation's best is a lower bound of the highest; a token
 * whose upper bound is below the best float32 logit found so far cannot be the argmax, nor
 * tie it, and only the others' float32 logits are computed. Two passes over the row: its
 * highest, lowest and NaNs; then each token against the best so far less the widest bound,
 * and the few that pass against their own. */
void pagedq_greedy(const float *x, int64_t ldx, int64_t rows, const float *approx,
                   int64_t ld_approx, int64_t vocab, const float *w, const int64_t *strides,
                   int64_t k, int64_t block, const float *p, const float *q, float p_max,
                   float q_max, const float *rounding, int64_t max_candidates, int64_t *tokens,
                   int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx, *a = approx + r * ld_approx;
        const float nx = norm_up(xr, k);
        const float nd = rounding ? rounding[r] : 0.0f;
        tokens[r] = -1;
        const int64_t whole = vocab / 8 * 8;
        __m256 high8 = _mm256_set1_ps(-INFINITY), low8 = _mm256_set1_ps(INFINITY);
        __m256 nan8 = _mm256_setzero_ps();
        for (int64_t j = 0; j < whole; j += 8) {
            const __m256 av = _mm256_loadu_ps(a + j);
            high8 = _mm256_max_ps(high8, av);
            low8 = _mm256_min_ps(low8, av);
            nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(av, av, _CMP_UNORD_Q));
        }
        float lanes[8], high = -INFINITY, low = INFINITY;
        int nan = _mm256_movemask_ps(nan8) != 0;
        _mm256_storeu_ps(lanes, high8);
        for (int i = 0; i < 8; i++) high = lanes[i] > high ? lanes[i] : high;
        _mm256_storeu_ps(lanes, low8);
        for (int i = 0; i < 8; i++) low = lanes[i] < low ? lanes[i] : low;
        for (int64_t j = whole; j < vocab; j++) {
            nan |= isnan(a[j]);
            high = a[j] > high ? a[j] : high;
            low = a[j] < low ? a[j] : low;
        }
        if (nan || !isfinite(high) || !isfinite(low) || !isfinite(nx) || !isfinite(nd))
            continue;
        int64_t best = 0;
        while (a[best] != high) best++;
        settling s = settle_from(xr, w, strides, k, block, p, q, nx, nd, best);
        /* no token's bound exceeds this */
        const float widest = bound(fabsf(high) > fabsf(low) ? high : low, p_max, q_max, nx, nd);
        for (int64_t j = 0; j < vocab && s.seen <= max_candidates && isfinite(s.top); j += 8) {
            int mask;
            if (j + 8 <= vocab) {
                mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(a + j),
                                                        _mm256_set1_ps(s.top - widest),
                                                        _CMP_GE_OQ));
            } else {
                mask = 0;
                for (int i = 0; j + i < vocab; i++) mask |= (a[j + i] >= s.top - widest) << i;
            }
            for (; mask; mask &= mask - 1) {
                const int64_t id = j + __builtin_ctz((unsigned)mask);
                consider(&s, id, a[id], max_candidates);
            }
        }
        tokens[r] = settled(&s, max_candidates);
    }
}
