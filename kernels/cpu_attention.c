/* The CPU paged attention of one query token, float32, AVX2 + FMA: compiled at first use by
 * kernels/cpu_native.py and called by kernels/cpu_ops.py's decode and prefill (numba threads,
 * one token per call, for its KV heads kv_begin to kv_end). Every sum runs in an order fixed
 * here, whatever the batch around the token and whichever heads a call takes (each head's
 * arithmetic is its own), so decode and prefill give a token the same bits.
 *
 * Pool layout [num_blocks][block_size][num_kv_heads][head_dim]; head_dim a multiple of 8. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

/* Lane k of the result: the sum of a[k]'s 8 lanes. */
static inline __m256 sum8(const __m256 *a) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                         _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* exp of 8 floats (Cephes' expf: 2^n times a degree-7 polynomial; within 2 ulp of the true
 * value for x >= -87.3, and 0 below, where it would leave float's normal range). */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    const __m256 below = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                               _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(below, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

void pagedq_attend(const float *restrict q, const float *restrict k_cache,
                   const float *restrict v_cache, const int32_t *restrict table,
                   int64_t length, float scale, float *restrict out, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                   int64_t kv_begin, int64_t kv_end) {
    const int64_t group = num_heads / num_kv_heads, row = num_kv_heads * head_dim;
    const int64_t g_begin = kv_begin * group, g_end = kv_end * group;
    const int64_t padded = (length + 7) & ~(int64_t)7;
    float *scores = aligned_alloc(32, sizeof(float) * (size_t)(num_heads * padded));
    float *qs = aligned_alloc(32, sizeof(float) * (size_t)(num_heads * head_dim));
    float *acc = aligned_alloc(32, sizeof(float) * (size_t)(num_heads * head_dim));
    float *denom = malloc(sizeof(float) * (size_t)num_heads);
    int64_t *offsets = malloc(sizeof(int64_t) * (size_t)padded);
    /* each key's row in the pool, block by block; the padding repeats the last key */
    for (int64_t i = 0, t = 0; t < length; i++)
        for (int64_t j = 0; j < block_size && t < length; j++, t++)
            offsets[t] = ((int64_t)table[i] * block_size + j) * row;
    for (int64_t t = length; t < padded; t++) offsets[t] = offsets[length - 1];
    for (int64_t i = g_begin * head_dim; i < g_end * head_dim; i++) {
        qs[i] = q[i] * scale;
        acc[i] = 0.0f;
    }
    /* scores, a tile of 8 keys for every head: 8 lanes over head_dim per key, then sum8 */
    for (int64_t t0 = 0; t0 < padded; t0 += 8) {
        for (int64_t h = kv_begin; h < kv_end; h++) {
            const float *rows[8];
            for (int k = 0; k < 8; k++) rows[k] = k_cache + offsets[t0 + k] + h * head_dim;
            for (int64_t g = h * group; g < (h + 1) * group; g++) {
                __m256 a[8];
                for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_ps();
                for (int64_t d = 0; d < head_dim; d += 8) {
                    const __m256 qv = _mm256_load_ps(qs + g * head_dim + d);
                    for (int k = 0; k < 8; k++)
                        a[k] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[k] + d), a[k]);
                }
                _mm256_store_ps(scores + g * padded + t0, sum8(a));
            }
        }
    }
    /* softmax numerators, the padding's zeroed; each head's total summed in 8 lanes */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t g = g_begin; g < g_end; g++) {
        float *s = scores + g * padded, top = s[0];
        for (int64_t t = 1; t < length; t++) top = s[t] > top ? s[t] : top;
        const __m256 tv = _mm256_set1_ps(top);
        __m256 total = _mm256_setzero_ps();
        for (int64_t t0 = 0; t0 < padded; t0 += 8) {
            const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                _mm256_set1_epi32((int)(length - t0)), lane));
            const __m256 e = _mm256_and_ps(live, exp8(_mm256_sub_ps(_mm256_load_ps(s + t0), tv)));
            _mm256_store_ps(s + t0, e);
            total = _mm256_add_ps(total, e);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, total);
        denom[g] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                   ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    }
    /* out: keys in order, 8 at a time, into each head's accumulator */
    for (int64_t t0 = 0; t0 < length; t0 += 8) {
        const int n = length - t0 < 8 ? (int)(length - t0) : 8;
        for (int64_t h = kv_begin; h < kv_end; h++) {
            const float *rows[8];
            for (int k = 0; k < n; k++) rows[k] = v_cache + offsets[t0 + k] + h * head_dim;
            for (int64_t g = h * group; g < (h + 1) * group; g++) {
                __m256 p[8];
                for (int k = 0; k < n; k++) p[k] = _mm256_set1_ps(scores[g * padded + t0 + k]);
                float *ag = acc + g * head_dim;
                for (int64_t d = 0; d < head_dim; d += 8) {
                    __m256 x = _mm256_load_ps(ag + d);
                    for (int k = 0; k < n; k++)
                        x = _mm256_fmadd_ps(p[k], _mm256_loadu_ps(rows[k] + d), x);
                    _mm256_store_ps(ag + d, x);
                }
            }
        }
    }
    for (int64_t g = g_begin; g < g_end; g++) {
        const __m256 dv = _mm256_set1_ps(denom[g]);
        for (int64_t d = 0; d < head_dim; d += 8)
            _mm256_storeu_ps(out + g * head_dim + d,
                             _mm256_div_ps(_mm256_load_ps(acc + g * head_dim + d), dv));
    }
    free(scores);
    free(qs);
    free(acc);
    free(denom);
    free(offsets);
}
