/* The row-wise ops of a Llama layer, float32, AVX2 + FMA: RMSNorm with its residual add,
 * rotary embeddings, SiLU-and-mul, and the KV store; and the greedy sampler's argmax. Compiled at first use by
 * kernels/cpu_native.py; kernels/cpu_rows.py calls them for every batch, and cpu_decode.c's
 * decode step calls the same functions, so that a row has the same bits whichever path and
 * whichever batch computes it (the engine's resumes and n-sample sharing rest on that).
 *
 * Each row's arithmetic is fixed here, lane by lane, and its own: rows are split over
 * `threads` OpenMP threads (torch's pool) only past PARALLEL_FROM floats, and a thread runs a
 * row as any other would. Built with -ffp-contract=off: a product and a sum stay two roundings
 * wherever the compiler vectorizes a loop or not. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

#define PARALLEL_FROM (1 << 15) /* floats; below, a parallel region costs more than it saves */

/* out = weight * (v * 1/sqrt(mean(v^2) + eps)) with v = x (+ residual), v into res_out when
 * residual is given (res_out may be residual itself). The squares are summed in 8 lanes,
 * the lanes pairwise, then the tail in order. */
static void rms_norm_row(const float *x, const float *residual, const float *weight,
                         float eps, int64_t size, float *out, float *res_out) {
    const float *v = residual ? res_out : x;
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= size; i += 8) {
        __m256 xv = _mm256_loadu_ps(x + i);
        if (residual) {
            xv = _mm256_add_ps(xv, _mm256_loadu_ps(residual + i));
            _mm256_storeu_ps(res_out + i, xv);
        }
        acc = _mm256_fmadd_ps(xv, xv, acc);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    float total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                  ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (; i < size; i++) {
        const float xi = residual ? x[i] + residual[i] : x[i];
        if (residual) res_out[i] = xi;
        total += xi * xi;
    }
    const float inv = 1.0f / sqrtf(total / (float)size + eps);
    for (i = 0; i < size; i++) out[i] = weight[i] * (v[i] * inv);
}

void pagedq_rms_norm(const float *x, const float *residual, const float *weight, float eps,
                     float *out, float *res_out, int64_t rows, int64_t size, int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * size >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++)
        rms_norm_row(x + r * size, residual ? residual + r * size : 0, weight, eps, size,
                     out + r * size, residual ? res_out + r * size : 0);
}

/* One head: x1 = x[:half], x2 = x[half:]; out = (x1 cos - x2 sin, x2 cos + x1 sin), the
 * tables' rows at the token's position. */
static void rotary_head(const float *x, const float *cos, const float *sin, int64_t half,
                        float *out) {
    for (int64_t d = 0; d < half; d++) {
        const float x1 = x[d], x2 = x[d + half];
        out[d] = x1 * cos[d] - x2 * sin[d];
        out[d + half] = x2 * cos[d + half] + x1 * sin[d + half];
    }
}

/* q [tokens] rows of num_heads heads (row stride ldq, heads contiguous), k likewise; out_q and
 * out_k contiguous. cos and sin [positions][head_dim]. */
void pagedq_rotary(const float *q, int64_t ldq, const float *k, int64_t ldk, const float *cos,
                   const float *sin, const int64_t *positions, float *out_q, float *out_k,
                   int64_t tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (tokens * (num_heads + num_kv_heads) * head_dim >= PARALLEL_FROM)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + positions[t] * head_dim, *s = sin + positions[t] * head_dim;
        for (int64_t h = 0; h < num_heads; h++)
            rotary_head(q + t * ldq + h * head_dim, c, s, half,
                        out_q + (t * num_heads + h) * head_dim);
        for (int64_t h = 0; h < num_kv_heads; h++)
            rotary_head(k + t * ldk + h * head_dim, c, s, half,
                        out_k + (t * num_kv_heads + h) * head_dim);
    }
}

/* 8 outputs: gate / (1 + exp(-gate)) * up, as torch's silu(gate) * up. */
static inline __m256 silu_mul8(__m256 gate, __m256 up) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate));
    return _mm256_mul_ps(_mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), up);
}

#ifdef __AVX512F__
/* silu_mul8 on 16 lanes, each lane's bits silu_mul8's (exp16) */
static inline __m512 silu_mul16(__m512 gate, __m512 up) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate));
    return _mm512_mul_ps(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), up);
}
#endif

/* x [rows][2 * size]: gate then up; out [rows][size]. The tail goes through the same 8 lanes,
 * padded, so every element takes the one formula; with AVX-512, 16 lanes at a time before it
 * (SmolLM2's 2,048 x 1,536, 2 threads, an AMD EPYC Zen 5: 0.97-1.08 -> 0.74-0.75 ms, the
 * same bits, specials included). */
void pagedq_silu_and_mul(const float *x, float *out, int64_t rows, int64_t size,
                         int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * size >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * size, *up = gate + size;
        float *o = out + r * size;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= size; i += 16)
            _mm512_storeu_ps(o + i, silu_mul16(_mm512_loadu_ps(gate + i),
                                               _mm512_loadu_ps(up + i)));
#endif
        for (; i + 8 <= size; i += 8)
            _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(gate + i),
                                              _mm256_loadu_ps(up + i)));
        if (i < size) {
            float g[8] = {0}, u[8] = {0}, y[8];
            memcpy(g, gate + i, sizeof(float) * (size_t)(size - i));
            memcpy(u, up + i, sizeof(float) * (size_t)(size - i));
            _mm256_storeu_ps(y, silu_mul8(_mm256_loadu_ps(g), _mm256_loadu_ps(u)));
            memcpy(o + i, y, sizeof(float) * (size_t)(size - i));
        }
    }
}

/* key and value [tokens] rows of `row` floats (row strides ldk, ldv) into their slots of the
 * pools [blocks * block_size][row]; a negative slot is skipped (a padded row). */
void pagedq_store_kv(const float *key, int64_t ldk, const float *value, int64_t ldv,
                     float *k_cache, float *v_cache, const int64_t *slots, int64_t tokens,
                     int64_t row) {
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row, key + t * ldk, sizeof(float) * (size_t)row);
        memcpy(v_cache + slots[t] * row, value + t * ldv, sizeof(float) * (size_t)row);
    }
}

/* pagedq_store_kv into bfloat16 pools, each float as to_bf16 rounds it */
void pagedq_store_kv_bf16(const float *key, int64_t ldk, const float *value, int64_t ldv,
                          uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots,
                          int64_t tokens, int64_t row) {
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        for (int64_t e = 0; e < row; e++) {
            k_cache[slots[t] * row + e] = to_bf16(key[t * ldk + e]);
            v_cache[slots[t] * row + e] = to_bf16(value[t * ldv + e]);
        }
    }
}

/* out[r] = the index of row r's largest float (rows ld apart, `cols` each), the first where
 * several tie, the first NaN where there is one: torch's argmax(dim=-1). Four sets of 8 lanes
 * keep each lane's first maximum (a strict > only moves it) so that no compare waits on the
 * last; a lane's first maximum is the row's first among its lanes, so the smallest index of
 * those that hold the row's maximum is the row's answer.
 * Why: torch's argmax of SmolLM2's 32 x 49,152 logits took 1.4 ms a decode step (4.6 GB/s,
 * one thread), 2 % of a 32-row step. */
void pagedq_argmax(const float *x, int64_t ld, int64_t rows, int64_t cols, int64_t *out,
                   int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * ld;
        __m256 best[4], nan = _mm256_setzero_ps();
        __m256i at[4];
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for (int s = 0; s < 4; s++) {
            best[s] = _mm256_set1_ps(-INFINITY);
            at[s] = _mm256_setzero_si256();
        }
        int64_t i = 0;
        for (; i + 32 <= cols; i += 32)
            for (int s = 0; s < 4; s++) {
                const __m256 v = _mm256_loadu_ps(row + i + 8 * s);
                const __m256 more = _mm256_cmp_ps(v, best[s], _CMP_GT_OQ);
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                best[s] = _mm256_blendv_ps(best[s], v, more);
                at[s] = _mm256_blendv_epi8(
                    at[s], _mm256_add_epi32(lane, _mm256_set1_epi32((int)(i + 8 * s))),
                    _mm256_castps_si256(more));
            }
        float values[32];
        int32_t indices[32];
        for (int s = 0; s < 4; s++) {
            _mm256_storeu_ps(values + 8 * s, best[s]);
            _mm256_storeu_si256((__m256i *)(indices + 8 * s), at[s]);
        }
        float top = values[0];
        int64_t index = indices[0];
        for (int j = 1; j < 32; j++)
            if (values[j] > top || (values[j] == top && indices[j] < index))
                top = values[j], index = indices[j];
        int64_t first_nan = -1;
        if (_mm256_movemask_ps(nan)) i = 0;  /* a NaN in the vectors: find the first */
        for (; i < cols; i++) {
            if (row[i] != row[i]) {
                first_nan = i;
                break;
            }
            if (row[i] > top) top = row[i], index = i;
        }
        out[r] = first_nan >= 0 ? first_nan : index;
    }
}
