/* The approximate logits of a greedy step from an int8 copy of the output layer, which
 * cpu_greedy.c settles against the float32 weights: each token's weights as integers of at
 * most 127 times a scale of its own, each row's inputs as integers of at most x_max() times
 * one scale, their products summed exactly in int32 (pairs of 16-bit integers, vpmaddwd),
 * then scaled. Compiled at first use by kernels/cpu_native.py; kernels/cpu_greedy.py packs
 * the copy and states the bound.
 *
 * Why: the float32 head (SmolLM2's 49,152 x 576, 113 MB) is a step's largest product, and the
 * bfloat16 copy that replaces it elsewhere computes no faster than float32 where the CPU lacks
 * AVX-512 BF16: AVX2 widens it and runs the same FMAs. A pair of 16-bit products is 16 lanes
 * of multiply-adds an instruction to the FMA's 8, and the copy reads a quarter of the float32
 * bytes. SmolLM2's head, an AMD EPYC Zen 3 (AVX2 only), 2 threads, cold, best of 7 alternating:
 * 1 row 1.20 ms (float32 3.25, bfloat16 1.84), 8 rows 2.02 (4.87, 3.34), 32 rows 6.76 (11.29,
 * 10.72), 64 rows 15.6 (23.4, 26.4). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* a weight's largest integer (kernels/cpu_greedy.py's WEIGHT_MAX, which packs them) */
#define WEIGHT_MAX 127

/* an input's largest integer: 14 bits, or as many as a sum of `steps` pairs of products by
 * weights of at most WEIGHT_MAX leaves within int32 (SmolLM2's 576 inputs: 14; 2,048: 13) */
static inline int32_t x_max(int64_t steps) {
    const int64_t most = INT32_MAX / (2 * WEIGHT_MAX * steps);
    return most < 16383 ? (int32_t)most : 16383;
}

/* 16 outputs of one row as int32 sums; a step's weights: 16 outputs' pairs widened to 16-bit
 * integers from 32 int8 (output o's pair at 2 * o, 2 * o + 1). AVX2 on every CPU: AVX-512's
 * 16-lane products would take more than this machine (AVX2 only) could test. */
typedef struct { __m256i lo, hi; } ivec;
static inline ivec izero(void) { return (ivec){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline ivec widen(const int8_t *p) {
    return (ivec){_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)),
                  _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)))};
}
static inline ivec dot_pairs(ivec sum, ivec w, int32_t pair) {
    const __m256i x = _mm256_set1_epi32(pair);
    return (ivec){_mm256_add_epi32(sum.lo, _mm256_madd_epi16(w.lo, x)),
                  _mm256_add_epi32(sum.hi, _mm256_madd_epi16(w.hi, x))};
}
static inline void store(int32_t *out, ivec sum) {
    _mm256_storeu_si256((__m256i *)out, sum.lo);
    _mm256_storeu_si256((__m256i *)(out + 8), sum.hi);
}

/* Row x's inputs as integers q of at most most, in pairs (xq[i]: q[2i] in the low half, an
 * odd k's last pair padded with 0), so that x ~ tau * q; returns tau, and |x - tau * q| (in
 * float64, where it is exact, then rounded up) in *rounding, NaN where x is not finite. */
static float quantize(const float *x, int64_t k, int32_t most, int32_t *xq, float *rounding) {
    float top = 0.0f;
    int finite = 1;
    for (int64_t i = 0; i < k; i++) {
        finite &= isfinite(x[i]) != 0;
        top = fabsf(x[i]) > top ? fabsf(x[i]) : top;
    }
    const float tau = finite ? top / (float)most : 0.0f;
    double sum = 0.0;
    for (int64_t i = 0; i < (k + 1) / 2 * 2; i += 2) {
        float q[2] = {0.0f, 0.0f};
        for (int h = 0; h < 2 && i + h < k; h++) {
            if (tau > 0.0f)
                q[h] = fminf(fmaxf(nearbyintf(x[i + h] / tau), (float)-most), (float)most);
            const double d = (double)x[i + h] - (double)tau * q[h];
            sum += d * d;
        }
        xq[i / 2] = (int32_t)((uint32_t)(uint16_t)(int16_t)q[0]
                              | (uint32_t)(uint16_t)(int16_t)q[1] << 16);
    }
    *rounding = finite ? (float)(sqrt(sum) * (1.0 + 1e-6)) : NAN;
    return tau;
}

/* A tile: up to SCREEN_ROWS rows of one panel of 16 outputs (a row or two: of two panels),
 * their sums in registers: 10 of AVX2's 16 (5 rows' two halves), the weights 2 more, a
 * broadcast and a product. 6 rows kept one sum in memory, a store and a load on its chain
 * each step: SmolLM2's head (49,152 x 576), an AMD EPYC Zen 3, 2 threads, 32 rows 9.3 ms
 * against 6.8 with 5, 64 rows 20.3 against 15.6. The sums are variables of their own: held in
 * an array, GCC 12 kept one in memory and copied the rest each step (4 rows). */
#define SCREEN_ROWS 5

/* `rows` rows' sums over `panels` panels (1, or 2 for up to 2 rows), the weights
 * w[panel][steps][32], into sums[row][panels * 16]; both constants where inlined. GCC 12
 * kept 10 of the 12 sums in memory where the loop was blocked (the sums going to floats every
 * few hundred steps), and where the tile converted them to floats at its end. */
static inline __attribute__((always_inline)) void tile(const int32_t *xq, int64_t steps,
                                                       const int rows, const int panels,
                                                       const int8_t *w, int32_t *sums) {
    ivec a0 = izero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, b0 = a0, b1 = a0;
    for (int64_t s = 0; s < steps; s++) {
        const ivec w0 = widen(w + s * 32), w1 = panels > 1 ? widen(w + (steps + s) * 32) : w0;
        const int32_t *x = xq + s;
#define ROW(r) if (rows > r) a##r = dot_pairs(a##r, w0, x[r * steps]);
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4)
#undef ROW
        if (panels > 1) b0 = dot_pairs(b0, w1, x[0]);
        if (panels > 1 && rows > 1) b1 = dot_pairs(b1, w1, x[steps]);
    }
#define STORE(r, sum, j) if (rows > r && panels > j) store(sums + (r * panels + j) * 16, sum);
    STORE(0, a0, 0) STORE(1, a1, 0) STORE(2, a2, 0) STORE(3, a3, 0) STORE(4, a4, 0)
    STORE(0, b0, 1) STORE(1, b1, 1)
#undef STORE
}

static void any_tile(const int32_t *xq, int64_t steps, int64_t rows, int64_t panels,
                     const int8_t *w, int32_t *sums) {
    switch (rows) {
        case 1: panels == 2 ? tile(xq, steps, 1, 2, w, sums) : tile(xq, steps, 1, 1, w, sums);
            break;
        case 2: panels == 2 ? tile(xq, steps, 2, 2, w, sums) : tile(xq, steps, 2, 1, w, sums);
            break;
        case 3: tile(xq, steps, 3, 1, w, sums); break;
        case 4: tile(xq, steps, 4, 1, w, sums); break;
        default: tile(xq, steps, SCREEN_ROWS, 1, w, sums);
    }
}

/* approx[rows][n] (row stride ld_approx) ~ x[rows][k] (row stride ldx) times the layer, from
 * its int8 copy w[n / 16][(k + 1) / 2][16][2] (outputs padded to 16, inputs to even) and each
 * output's scale; rounding[rows]: each row's |x - x'| (quantize). A row or two take two panels
 * at a time (two streams from the memory); more rows one panel, in tiles of SCREEN_ROWS.
 * Returns 0, or -1 where the inputs' memory could not be had. */
int pagedq_screen(const float *x, int64_t ldx, int64_t rows, const int8_t *w,
                  const float *scales, float *approx, int64_t ld_approx, int64_t n, int64_t k,
                  float *rounding, int64_t threads) {
    const int64_t steps = (k + 1) / 2;
    int32_t *xq = malloc(sizeof(int32_t) * (size_t)(rows * steps));
    float *tau = malloc(sizeof(float) * (size_t)rows);
    if (!xq || !tau) {
        free(xq), free(tau);
        return -1;
    }
    const int32_t most = x_max(steps);
    for (int64_t r = 0; r < rows; r++)
        tau[r] = quantize(x + r * ldx, k, most, xq + r * steps, rounding + r);
    const int64_t group = rows <= 2 ? 2 : 1, panels = (n + 15) / 16;
    const int64_t groups = (panels + group - 1) / group;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t p0 = g * group, np = panels - p0 < group ? panels - p0 : group;
        const int64_t o0 = p0 * 16, width = n - o0 < np * 16 ? n - o0 : np * 16;
        int32_t sums[SCREEN_ROWS * 2 * 16];
        for (int64_t r0 = 0; r0 < rows; r0 += SCREEN_ROWS) {
            const int64_t nr = rows - r0 < SCREEN_ROWS ? rows - r0 : SCREEN_ROWS;
            any_tile(xq + r0 * steps, steps, nr, np, w + p0 * steps * 32, sums);
            for (int64_t r = 0; r < nr; r++) {
                float *out = approx + (r0 + r) * ld_approx + o0;
                const int32_t *s = sums + r * np * 16;
                for (int64_t o = 0; o < width; o++)
                    out[o] = (float)s[o] * scales[o0 + o] * tau[r0 + r];
            }
        }
    }
    free(xq), free(tau);
    return 0;
}
