/* What the C kernels share: the functions each source exports (for cpu_decode.c, which calls
 * the others), the attention's chunk of keys, and the vector helpers (AVX2 + FMA), so that the
 * attention's softmax and the SiLU take one exp. */
#ifndef PAGEDQ_CPU_KERNELS_H
#define PAGEDQ_CPU_KERNELS_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* stored_t, the element type of the weights (cpu_gemv.c's panels) and of the KV pools: float32,
 * or bfloat16 where cpu_bf16.c compiles the same sources again with PAGEDQ_BF16 defined (NAME()
 * gives that build's functions their _bf16 names). A bfloat16 is a float's upper 16 bits, so
 * the loads below widen it exactly and every sum runs in float32 as in the float32 build: the
 * bfloat16 build halves the bytes the memory-bound products and attention read (llama.cpp's
 * F16 shape: 16-bit weights and cache, float32 activations). Only on CPUs with AVX-512 BF16
 * do the products and the attention compute otherwise: on inputs rounded to bfloat16, in
 * pairs. */
/* PAIRED: the bfloat16 build on a CPU with AVX-512 BF16, whose products and attention take
 * bfloat16 pairs (cpu_gemv.c, cpu_attention_pairs.h) */
#if defined(PAGEDQ_BF16) && defined(__AVX512BF16__)
#define PAIRED 1
#else
#define PAIRED 0
#endif
#ifdef PAGEDQ_BF16
typedef uint16_t stored_t;
#define NAME(f) f##_bf16
#else
typedef float stored_t;
#define NAME(f) f
#endif

/* 8 (16) bfloat16s widened to floats */
static inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#ifdef __AVX512F__
static inline __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif

/* f rounded to the nearest bfloat16, ties to even, any NaN to 0xFFFF: torch's (vectorized)
 * conversion, which the reference store runs */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffff;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#ifdef __AVX512BF16__
/* x[0 .. k) as bfloat16 pairs, (2i, 2i + 1) in out[i] (the first in the low half), rounded
 * to nearest even; an odd k's last pair padded with zero */
static inline void to_pairs(const float *x, int64_t k, uint32_t *out) {
    int64_t i = 0;
    for (; i + 32 <= k; i += 32)
        _mm512_storeu_si512(out + i / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16),
                                                                      _mm512_loadu_ps(x + i)));
    for (; i < k; i += 2)
        out[i / 2] = to_bf16(x[i]) | (i + 1 < k ? (uint32_t)to_bf16(x[i + 1]) << 16 : 0u);
}
#endif

/* 8 (16) stored elements (weights, a pool's) as floats */
static inline __m256 load8_stored(const stored_t *p) {
#ifdef PAGEDQ_BF16
    return widen8(p);
#else
    return _mm256_loadu_ps(p);
#endif
}
#ifdef __AVX512F__
static inline __m512 load16_stored(const stored_t *p) {
#ifdef PAGEDQ_BF16
    return widen16(p);
#else
    return _mm512_loadu_ps(p);
#endif
}
#endif

/* a token's attention is computed in chunks of this many key positions (cpu_attention.c) */
#define CHUNK 256

/* `threads` for a product or an attention that a share of cpu_decode.c's split step runs once
 * another thread of the step has finished its own share: its work becomes TEAM_PARTS tasks of
 * the step's OpenMP team, which the share's thread runs but for those the idle thread takes
 * (in the loop's barrier) first. 8 parts: SmolLM2's split steps of 32 rows, an AMD EPYC Zen 3,
 * steps alternating with and without: 4 parts 0.92-0.94x the time, 8 0.91-0.96, 16 0.90-0.95,
 * 2 0.96-0.98. */
#define TEAM_TASKS 0
#define TEAM_PARTS 8

int NAME(pagedq_gemv)(const float *x, int64_t ldx, int64_t rows, const stored_t *w,
                      const float *bias, float *y, int64_t ldy, int64_t n, int64_t k,
                      int64_t block, int64_t threads);
int NAME(pagedq_gemv_tiles)(int64_t rows, int64_t k);
/* Where a product's sums go in place of its output (pagedq_gemv_sink, AMX's tiles): out[2i + j]
 * holds rows r0 + 16i to r0 + 16i + 15 (those below `rows`) by outputs o0 + 16j on (those
 * below n), out[.][r][lane] */
typedef void (*gemv_sink)(void *ctx, float (*out)[16][16], int64_t r0, int64_t o0, int64_t rows,
                          int64_t n);
int pagedq_gemv_tiles_bf16(int64_t rows, int64_t k);
int pagedq_gemv_sink_bf16(const float *x, int64_t ldx, int64_t rows, const uint16_t *w,
                          int64_t n, int64_t k, gemv_sink sink, void *ctx, int64_t threads);
int NAME(pagedq_attend_parts)(const float *q, int64_t ldq, int64_t nq,
                              const stored_t *k_cache, const stored_t *v_cache,
                              const int32_t *table, int64_t t_begin, const int64_t *t_end,
                              float scale, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, int64_t block_size, int64_t kv_begin,
                              int64_t kv_end, float *m, float *s, float *acc, int64_t ld_m,
                              const float *columns);
void NAME(pagedq_attend_combine)(const float *m, const float *s, const float *acc,
                                 int64_t chunks, int64_t num_heads, int64_t head_dim,
                                 int64_t g_begin, int64_t g_end, float *out);
int NAME(pagedq_decode_attention)(const float *q, int64_t ldq, const stored_t *k_cache,
                                  const stored_t *v_cache, const int32_t *tables,
                                  int64_t table_stride, const int32_t *context_lens,
                                  int64_t rows, float scale, float *out, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                  int64_t threads);
void pagedq_rms_norm(const float *x, const float *residual, const float *weight, float eps,
                     float *out, float *res_out, int64_t rows, int64_t size, int64_t threads);
void pagedq_rotary(const float *q, int64_t ldq, const float *k, int64_t ldk, const float *cos,
                   const float *sin, const int64_t *positions, float *out_q, float *out_k,
                   int64_t tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t threads);
void pagedq_silu_and_mul(const float *x, float *out, int64_t rows, int64_t size,
                         int64_t threads);
void pagedq_store_kv(const float *key, int64_t ldk, const float *value, int64_t ldv,
                     float *k_cache, float *v_cache, const int64_t *slots, int64_t tokens,
                     int64_t row);
void pagedq_store_kv_bf16(const float *key, int64_t ldk, const float *value, int64_t ldv,
                          uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots,
                          int64_t tokens, int64_t row);

/* Lane k of the result: the sum of a[k]'s 8 lanes. */
static inline __m256 sum8(const __m256 *a) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                         _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* Cephes' expf for x already clamped to [-87.3, 88]: 2^n times a degree-7 polynomial of the
 * remainder, within 2 ulp of the true value. One body for every vector width (P the
 * intrinsics' prefix, W their width in bits, FLOOR theirs), so that each lane's bits are the
 * same at any width: every step is lane-wise. */
#define DEFINE_EXP_CLAMPED(name, V, VI, P, W, FLOOR)                                          \
    static inline V name(V x) {                                                              \
        const V n = FLOOR(P##_fmadd_ps(x, P##_set1_ps(1.44269504088896341f),                 \
                                       P##_set1_ps(0.5f)));                                  \
        x = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                                  \
        x = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), x);                               \
        V y = P##_set1_ps(1.9875691500e-4f);                                                 \
        y = P##_fmadd_ps(y, x, P##_set1_ps(1.3981999507e-3f));                               \
        y = P##_fmadd_ps(y, x, P##_set1_ps(8.3334519073e-3f));                               \
        y = P##_fmadd_ps(y, x, P##_set1_ps(4.1665795894e-2f));                               \
        y = P##_fmadd_ps(y, x, P##_set1_ps(1.6666665459e-1f));                               \
        y = P##_fmadd_ps(y, x, P##_set1_ps(5.0000001201e-1f));                               \
        y = P##_fmadd_ps(y, P##_mul_ps(x, x), P##_add_ps(x, P##_set1_ps(1.0f)));             \
        const VI e = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), \
                                    23);                                                     \
        return P##_mul_ps(y, P##_castsi##W##_ps(e));                                         \
    }
DEFINE_EXP_CLAMPED(exp8_clamped, __m256, __m256i, _mm256, 256, _mm256_floor_ps)

/* exp of 8 floats (exp8_clamped: 0 below -87.3, where it would leave float's normal range,
 * and exp(88) above, where 2^n would overflow the exponent's bits). */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    const __m256 below = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
    return _mm256_andnot_ps(below, exp8_clamped(x));
}

#ifdef __AVX512F__
#define FLOOR16(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
DEFINE_EXP_CLAMPED(exp16_clamped, __m512, __m512i, _mm512, 512, FLOOR16)
#undef FLOOR16

/* exp8 on 16 lanes, each lane's bits exp8's */
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    const __mmask16 below = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.0f));
    return _mm512_maskz_mov_ps((__mmask16)~below, exp16_clamped(x));
}
#endif
#undef DEFINE_EXP_CLAMPED

#endif
