/* A linear layer's product for a few rows (decode at small batch), float32, AVX-512 or AVX2 +
 * FMA, on torch's OpenMP threads: compiled at first use by kernels/cpu_native.py, called by
 * engine/cpu_linear.py where a probe at load found its sums equal to oneDNN's many-row ones.
 *
 * Why: oneDNN's product of one row (or two) reads the weights at 13.5 GB/s of the 32.7 a
 * 2-core machine streams, the rest lost in its threads' barrier; at batch 1 the linear layers
 * were 71 % of a SmolLM2 decode step. This kernel streams them.
 *
 * The order of the sums is the contract: y[m][n] is K cut into blocks of `block` inputs, each
 * block an FMA chain from zero in input order, the blocks' sums added in order, then the bias.
 * That is how oneDNN's many-row kernel sums on AVX-512 (block 512 up to 1,024 inputs, 1,024
 * past them, measured on an AMD EPYC); so a row gets the same bits here as in any batch.
 *
 * Weights are panels of 16 outputs, input-major: w[panel][k][16], outputs padded to 16. */
#include <immintrin.h>
#include <stdint.h>

#ifdef __AVX512F__
typedef __m512 vec16;
static inline vec16 zero16(void) { return _mm512_setzero_ps(); }
static inline vec16 load16(const float *p) { return _mm512_loadu_ps(p); }
static inline vec16 fma16(float a, vec16 b, vec16 c) {
    return _mm512_fmadd_ps(_mm512_set1_ps(a), b, c);
}
static inline vec16 add16(vec16 a, vec16 b) { return _mm512_add_ps(a, b); }
static inline void store16(float *p, vec16 v, int64_t lanes) {
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << lanes) - 1u), v);
}
#else
typedef struct { __m256 lo, hi; } vec16;
static inline vec16 zero16(void) { return (vec16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vec16 load16(const float *p) {
    return (vec16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
static inline vec16 fma16(float a, vec16 b, vec16 c) {
    const __m256 s = _mm256_set1_ps(a);
    return (vec16){_mm256_fmadd_ps(s, b.lo, c.lo), _mm256_fmadd_ps(s, b.hi, c.hi)};
}
static inline vec16 add16(vec16 a, vec16 b) {
    return (vec16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
static inline void store16(float *p, vec16 v, int64_t lanes) {
    float tmp[16];
    _mm256_storeu_ps(tmp, v.lo);
    _mm256_storeu_ps(tmp + 8, v.hi);
    for (int64_t i = 0; i < lanes; i++) p[i] = tmp[i];
}
#endif

#define MAX_ROWS 4

/* One panel's 16 outputs for `rows` rows (a constant where it is inlined). */
static inline __attribute__((always_inline)) void panel(
        const float *x, int64_t ldx, const int rows, const float *w, const float *bias,
        float *y, int64_t ldy, int64_t k, int64_t block, int64_t lanes) {
    vec16 total[MAX_ROWS], part[MAX_ROWS];
    for (int64_t k0 = 0; k0 < k; k0 += block) {
        const int64_t k1 = k0 + block < k ? k0 + block : k;
        for (int r = 0; r < rows; r++) part[r] = zero16();
        for (int64_t i = k0; i < k1; i++) {
            const vec16 wv = load16(w + i * 16);
            for (int r = 0; r < rows; r++) part[r] = fma16(x[r * ldx + i], wv, part[r]);
        }
        for (int r = 0; r < rows; r++) total[r] = k0 == 0 ? part[r] : add16(total[r], part[r]);
    }
    for (int r = 0; r < rows; r++) {
        if (bias) {
            float b[16] = {0};
            for (int64_t i = 0; i < lanes; i++) b[i] = bias[i];
            total[r] = add16(total[r], load16(b));
        }
        store16(y + r * ldy, total[r], lanes);
    }
}

/* y[rows][n] (row stride ldy) = x[rows][k] (row stride ldx) times the panels' weights, plus
 * bias (or NULL); rows from 1 to MAX_ROWS, k > 0. */
void pagedq_gemv(const float *x, int64_t ldx, int64_t rows, const float *w, const float *bias,
                 float *y, int64_t ldy, int64_t n, int64_t k, int64_t block, int64_t threads) {
    const int64_t panels = (n + 15) / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t lanes = n - p * 16 < 16 ? n - p * 16 : 16;
        const float *wp = w + p * k * 16, *bp = bias ? bias + p * 16 : 0;
        float *yp = y + p * 16;
        switch (rows) {
            case 1: panel(x, ldx, 1, wp, bp, yp, ldy, k, block, lanes); break;
            case 2: panel(x, ldx, 2, wp, bp, yp, ldy, k, block, lanes); break;
            case 3: panel(x, ldx, 3, wp, bp, yp, ldy, k, block, lanes); break;
            default: panel(x, ldx, 4, wp, bp, yp, ldy, k, block, lanes); break;
        }
    }
}
