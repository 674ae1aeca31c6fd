/* The CPU paged attention of one query token, float32, AVX2 + FMA: compiled at first use by
 * kernels/cpu_native.py and called by kernels/cpu_ops.py's decode and prefill (numba threads,
 * one token per call, for its KV heads kv_begin to kv_end). Every sum runs in an order fixed
 * here, whatever the batch around the token and whichever heads a call takes (each head's
 * arithmetic is its own), so decode and prefill give a token the same bits.
 *
 * A token's keys are taken in chunks of CHUNK positions, each chunk's softmax partial (its
 * max, its sum of exponentials and its weighted values) by pagedq_attend_part, then combined
 * in chunk order by pagedq_attend_combine. The chunks are fixed by position, not by the
 * threads: the decode step (cpu_decode.c) runs them as parallel tasks, so that one long
 * sequence uses every core (SmolLM2's 3 KV heads had split 2:1 over two), and pagedq_attend
 * runs them in a row, with the same bits.
 *
 * Pool layout [num_blocks][block_size][num_kv_heads][head_dim]; head_dim a multiple of 8. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_kernels.h"

/* keys ahead whose K and V rows the scores' loop asks the memory for (V's for the values'
 * loop after it). One thread on cold keys, SmolLM2's 3 KV heads: 280 ns a key without, 175
 * with 8 keys ahead, 186 with 32 (Xeon, 2 cores) */
#define PREFETCH 8

static inline void prefetch_row(const float *k, const float *v, int64_t head_dim) {
    for (int64_t d = 0; d < head_dim; d += 16) {
        _mm_prefetch((const char *)(k + d), _MM_HINT_T0);
        _mm_prefetch((const char *)(v + d), _MM_HINT_T0);
    }
}

/* Query heads one load of a key's (or value's) row feeds: the sub-group's accumulators (8
 * keys by QGROUP heads) need AVX-512's 32 vector registers; AVX2's 16 hold one head's. */
#ifdef __AVX512F__
#define QGROUP 3
#else
#define QGROUP 1
#endif

/* The scores of 8 keys (rows[k], one KV head's) for the G query heads from g0: per head and
 * key, 8 lanes over head_dim, an FMA chain in d's order, then sum8. Every key row is loaded
 * once for the G heads. */
static inline __attribute__((always_inline)) void score_tile(
        const float *qs, const float *const *rows, int64_t head_dim, const int G, int64_t g0,
        float *scores, int64_t padded, int64_t t0) {
    __m256 a[QGROUP][8];
    for (int g = 0; g < G; g++)
        for (int k = 0; k < 8; k++) a[g][k] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
        __m256 qv[QGROUP];
        for (int g = 0; g < G; g++) qv[g] = _mm256_load_ps(qs + (g0 + g) * head_dim + d);
        for (int k = 0; k < 8; k++) {
            const __m256 kv = _mm256_loadu_ps(rows[k] + d);
            for (int g = 0; g < G; g++) a[g][k] = _mm256_fmadd_ps(qv[g], kv, a[g][k]);
        }
    }
    for (int g = 0; g < G; g++) _mm256_store_ps(scores + (g0 + g) * padded + t0, sum8(a[g]));
}

/* The values' sums run in VW lanes (16 with AVX-512, else 8), SLAB vectors of head_dim at a
 * time: a slab's sums stay in registers over all of a query's keys. */
#ifdef __AVX512F__
#define VW 16
typedef __m512 vsum;
#define VZERO _mm512_setzero_ps
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VFMA _mm512_fmadd_ps
#define VSET1 _mm512_set1_ps
#else
#define VW 8
typedef __m256 vsum;
#define VZERO _mm256_setzero_ps
#define VLOAD _mm256_loadu_ps
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
 * the attention's time in perf, SmolLM2's shapes). */
static inline __attribute__((always_inline)) void value_slab(
        const float *scores, int64_t stride, const float *v, const int64_t *offsets,
        int64_t length, const int G, const int S, int64_t g0, float *sums, int64_t head_dim,
        int64_t d0) {
    vsum x[QGROUP][SLAB];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < S; j++) x[g][j] = VZERO();
    for (int64_t t = 0; t < length; t++) {
        const float *row = v + offsets[t] + d0;
        vsum vv[SLAB];
        for (int j = 0; j < S; j++) vv[j] = VLOAD(row + j * VW);
        for (int g = 0; g < G; g++) {
            const vsum p = VSET1(scores[(g0 + g) * stride + t]);
            for (int j = 0; j < S; j++) x[g][j] = VFMA(p, vv[j], x[g][j]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < S; j++) VSTORE(sums + (g0 + g) * head_dim + d0 + j * VW, x[g][j]);
}

#ifdef __AVX512F__
/* value_slab for the last 8 lanes of a head_dim that 16 does not divide */
static inline __attribute__((always_inline)) void value_tail8(
        const float *scores, int64_t stride, const float *v, const int64_t *offsets,
        int64_t length, const int G, int64_t g0, float *sums, int64_t head_dim, int64_t d0) {
    __m256 x[QGROUP];
    for (int g = 0; g < G; g++) x[g] = _mm256_setzero_ps();
    for (int64_t t = 0; t < length; t++) {
        const __m256 vv = _mm256_loadu_ps(v + offsets[t] + d0);
        for (int g = 0; g < G; g++)
            x[g] = _mm256_fmadd_ps(_mm256_set1_ps(scores[(g0 + g) * stride + t]), vv, x[g]);
    }
    for (int g = 0; g < G; g++) _mm256_storeu_ps(sums + (g0 + g) * head_dim + d0, x[g]);
}
#endif

/* Every value slab of the G query heads from g0 (KV head h's values at v). */
static inline __attribute__((always_inline)) void value_pass(
        const float *scores, int64_t stride, const float *v, const int64_t *offsets,
        int64_t length, const int G, int64_t g0, float *sums, int64_t head_dim) {
    int64_t d0 = 0;
    for (; d0 + SLAB * VW <= head_dim; d0 += SLAB * VW)
        value_slab(scores, stride, v, offsets, length, G, SLAB, g0, sums, head_dim, d0);
    const int64_t rest = (head_dim - d0) / VW;
    if (rest == 3) value_slab(scores, stride, v, offsets, length, G, 3, g0, sums, head_dim, d0);
    if (rest == 2) value_slab(scores, stride, v, offsets, length, G, 2, g0, sums, head_dim, d0);
    if (rest == 1) value_slab(scores, stride, v, offsets, length, G, 1, g0, sums, head_dim, d0);
    d0 += rest * VW;
#ifdef __AVX512F__
    if (d0 < head_dim)
        value_tail8(scores, stride, v, offsets, length, G, g0, sums, head_dim, d0);
#endif
}

/* The highest of x[0 .. n), n > 0: 8 lanes, then across them (a max is exact in any order;
 * the scalar scan's chain of compares had taken a tenth of the attention's time in perf). */
static inline float max_of(const float *x, int64_t n) {
    __m256 top = _mm256_set1_ps(x[0]);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) top = _mm256_max_ps(_mm256_loadu_ps(x + t), top);
    float lanes[8], best = x[0];
    _mm256_storeu_ps(lanes, top);
    for (int k = 0; k < 8; k++) best = lanes[k] > best ? lanes[k] : best;
    for (; t < n; t++) best = x[t] > best ? x[t] : best;
    return best;
}

/* The chunk partials of nq query tokens of one sequence over the same keys from t_begin, query
 * i's up to t_end[i], for KV heads kv_begin to kv_end: per query head g, m[g] the highest
 * score, s[g] the sum of exp(score - m[g]) and acc[g][:] the sum of exp(score - m[g]) times
 * the key's value; query i's q at q + i * ldq, its m and s at + i * ld_m, its acc at
 * + i * ld_m * head_dim. Each query's arithmetic is the one-query call's: its scores, softmax
 * and values in the same order. Only the loads are shared: each tile of 8 keys' rows serves
 * every query from L1, where one query at a time had read a prefill's keys again per token
 * (random-26m's 128 prompts: 98 GB a run from L2 and L3). */
static void attend_parts(const float *restrict q, int64_t ldq, int64_t nq,
                         const float *restrict k_cache, const float *restrict v_cache,
                         const int32_t *restrict table, int64_t t_begin,
                         const int64_t *restrict t_end, float scale, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                         int64_t kv_begin, int64_t kv_end, float *restrict m,
                         float *restrict s, float *restrict acc, int64_t ld_m) {
    const int64_t group = num_heads / num_kv_heads, row = num_kv_heads * head_dim;
    const int64_t g_begin = kv_begin * group, g_end = kv_end * group;
    const int64_t qsize = num_heads * head_dim;
    int64_t longest = 0;
    for (int64_t i = 0; i < nq; i++)
        longest = t_end[i] - t_begin > longest ? t_end[i] - t_begin : longest;
    const int64_t stride = (longest + 7) & ~(int64_t)7; /* a head's scores, every query's */
    float *scores = aligned_alloc(64, sizeof(float) * (size_t)(nq * num_heads * stride));
    float *qs = aligned_alloc(64, sizeof(float) * (size_t)(nq * qsize));
    float *sums = aligned_alloc(64, sizeof(float) * (size_t)(nq * qsize));
    int64_t *offsets = malloc(sizeof(int64_t) * (size_t)stride);
    /* each key's row in the pool; the padding repeats the last key (a query's padding past its
     * own keys reads later ones: its scores are masked out of the softmax either way) */
    for (int64_t t = 0; t < longest; t++) {
        const int64_t p = t_begin + t;
        offsets[t] = ((int64_t)table[p / block_size] * block_size + p % block_size) * row;
    }
    for (int64_t t = longest; t < stride; t++) offsets[t] = offsets[longest - 1];
    for (int64_t i = 0; i < nq; i++)
        for (int64_t e = g_begin * head_dim; e < g_end * head_dim; e++) {
            qs[i * qsize + e] = q[i * ldq + e] * scale;
            sums[i * qsize + e] = 0.0f;
        }
    /* scores, a tile of 8 keys for every head, QGROUP query heads at a time */
    for (int64_t t0 = 0; t0 < stride; t0 += 8) {
        if (t0 + PREFETCH < stride)
            for (int k = 0; k < 8; k++)
                for (int64_t h = kv_begin; h < kv_end; h++)
                    prefetch_row(k_cache + offsets[t0 + PREFETCH + k] + h * head_dim,
                                 v_cache + offsets[t0 + PREFETCH + k] + h * head_dim, head_dim);
        for (int64_t h = kv_begin; h < kv_end; h++) {
            const float *rows[8];
            for (int k = 0; k < 8; k++) rows[k] = k_cache + offsets[t0 + k] + h * head_dim;
            for (int64_t i = 0; i < nq; i++) {
                if (t0 >= t_end[i] - t_begin) continue;
                const float *qi = qs + i * qsize;
                float *si = scores + i * num_heads * stride;
                for (int64_t g = h * group; g < (h + 1) * group; g += QGROUP) {
                    const int64_t G = (h + 1) * group - g < QGROUP ? (h + 1) * group - g : QGROUP;
                    if (G == 3) score_tile(qi, rows, head_dim, 3, g, si, stride, t0);
                    else if (G == 2) score_tile(qi, rows, head_dim, 2, g, si, stride, t0);
                    else score_tile(qi, rows, head_dim, 1, g, si, stride, t0);
                }
            }
        }
    }
    /* softmax numerators, the padding's zeroed; each head's total summed in 8 lanes */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t i = 0; i < nq; i++) {
        const int64_t length = t_end[i] - t_begin, padded = (length + 7) & ~(int64_t)7;
        for (int64_t g = g_begin; g < g_end; g++) {
            float *row_s = scores + (i * num_heads + g) * stride;
            const float top = max_of(row_s, length);
            const __m256 tv = _mm256_set1_ps(top);
            __m256 total = _mm256_setzero_ps();
            for (int64_t t0 = 0; t0 < padded; t0 += 8) {
                const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                    _mm256_set1_epi32((int)(length - t0)), lane));
                const __m256 e = _mm256_and_ps(
                    live, exp8(_mm256_sub_ps(_mm256_load_ps(row_s + t0), tv)));
                _mm256_store_ps(row_s + t0, e);
                total = _mm256_add_ps(total, e);
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, total);
            m[i * ld_m + g] = top;
            s[i * ld_m + g] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                              ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
        }
    }
    /* out: each query head's values, its sums over the keys in order (value_pass) */
    for (int64_t i = 0; i < nq; i++) {
        const int64_t length = t_end[i] - t_begin;
        const float *si = scores + i * num_heads * stride;
        float *ai = sums + i * qsize;
        for (int64_t h = kv_begin; h < kv_end; h++)
            for (int64_t g = h * group; g < (h + 1) * group; g += QGROUP) {
                const int64_t G = (h + 1) * group - g < QGROUP ? (h + 1) * group - g : QGROUP;
                const float *vh = v_cache + h * head_dim;
                if (G == 3) value_pass(si, stride, vh, offsets, length, 3, g, ai, head_dim);
                else if (G == 2) value_pass(si, stride, vh, offsets, length, 2, g, ai, head_dim);
                else value_pass(si, stride, vh, offsets, length, 1, g, ai, head_dim);
            }
    }
    for (int64_t i = 0; i < nq; i++)
        for (int64_t e = g_begin * head_dim; e < g_end * head_dim; e++)
            acc[i * ld_m * head_dim + e] = sums[i * qsize + e];
    free(scores);
    free(qs);
    free(sums);
    free(offsets);
}

/* Keys t_begin to t_end of one query token, for KV heads kv_begin to kv_end (attend_parts'
 * outputs for one query). */
void pagedq_attend_part(const float *q, const float *k_cache, const float *v_cache,
                        const int32_t *table, int64_t t_begin, int64_t t_end, float scale,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        int64_t block_size, int64_t kv_begin, int64_t kv_end, float *m,
                        float *s, float *acc) {
    attend_parts(q, 0, 1, k_cache, v_cache, table, t_begin, &t_end, scale, num_heads,
                 num_kv_heads, head_dim, block_size, kv_begin, kv_end, m, s, acc, 0);
}

/* out[g] for query heads g_begin to g_end from `chunks` partials of pagedq_attend_part, chunk
 * c's at m + c * num_heads, s + c * num_heads, acc + c * num_heads * head_dim: each rescaled
 * by exp(its max - the highest), summed in chunk order, divided by the summed s. */
void pagedq_attend_combine(const float *m, const float *s, const float *acc, int64_t chunks,
                           int64_t num_heads, int64_t head_dim, int64_t g_begin, int64_t g_end,
                           float *out) {
    for (int64_t g = g_begin; g < g_end; g++) {
        float top = m[g], denom = 0.0f, *o = out + g * head_dim;
        for (int64_t c = 1; c < chunks; c++) {
            const float mc = m[c * num_heads + g];
            top = mc > top ? mc : top;
        }
        for (int64_t d = 0; d < head_dim; d += 8) _mm256_storeu_ps(o + d, _mm256_setzero_ps());
        for (int64_t c = 0; c < chunks; c++) {
            const __m256 w = exp8(_mm256_set1_ps(m[c * num_heads + g] - top));
            denom += s[c * num_heads + g] * _mm256_cvtss_f32(w);
            const float *a = acc + (c * num_heads + g) * head_dim;
            for (int64_t d = 0; d < head_dim; d += 8)
                _mm256_storeu_ps(o + d, _mm256_fmadd_ps(_mm256_loadu_ps(a + d), w,
                                                        _mm256_loadu_ps(o + d)));
        }
        const __m256 dv = _mm256_set1_ps(denom);
        for (int64_t d = 0; d < head_dim; d += 8)
            _mm256_storeu_ps(o + d, _mm256_div_ps(_mm256_loadu_ps(o + d), dv));
    }
}

/* A decode step's attention: `rows` query tokens (q and out rows ldq apart), row r over its
 * first context_lens[r] keys (its blocks at tables + r * table_stride). A task per row and
 * chunk of keys, every KV head (their rows lie side by side: one thread read cold keys of 3
 * heads at 8.8 GB/s, of 1 head at 4.4, a Xeon), or per KV head too where the chunks are too
 * few for the threads, so that one long sequence uses every core; then each row's chunks
 * combined in order. Returns 0, or -1 where scratch memory could not be had. */
int pagedq_decode_attention(const float *q, int64_t ldq, const float *k_cache,
                            const float *v_cache, const int32_t *tables, int64_t table_stride,
                            const int32_t *context_lens, int64_t rows, float scale, float *out,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t threads) {
    /* row r's chunks are first_chunk[r] to first_chunk[r + 1], its tasks first_task[r] to
     * first_task[r + 1] */
    int64_t *first_chunk = malloc(sizeof(int64_t) * (size_t)(2 * rows + 2));
    if (!first_chunk) return -1;
    int64_t *first_task = first_chunk + rows + 1;
    first_chunk[0] = 0;
    for (int64_t r = 0; r < rows; r++)
        first_chunk[r + 1] = first_chunk[r] + (context_lens[r] + CHUNK - 1) / CHUNK;
    const int64_t chunks = first_chunk[rows];
    const int64_t split = chunks < 2 * threads ? num_kv_heads : 1;
    for (int64_t r = 0; r <= rows; r++) first_task[r] = first_chunk[r] * split;
    const int64_t tasks = first_task[rows], q_size = num_heads * head_dim;
    float *part_m = malloc(sizeof(float) * (size_t)(chunks * num_heads * 2));
    float *part_acc = malloc(sizeof(float) * (size_t)(chunks * q_size));
    if (!part_m || !part_acc) {
        free(first_chunk);
        free(part_m);
        free(part_acc);
        return -1;
    }
    float *part_s = part_m + chunks * num_heads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t r = 0;
        while (task >= first_task[r + 1]) r++;
        const int64_t c = (task - first_task[r]) / split;
        const int64_t h = (task - first_task[r]) % split * (num_kv_heads / split);
        const int64_t part = first_chunk[r] + c, end = (c + 1) * CHUNK;
        pagedq_attend_part(q + r * ldq, k_cache, v_cache, tables + r * table_stride, c * CHUNK,
                           end < context_lens[r] ? end : context_lens[r], scale, num_heads,
                           num_kv_heads, head_dim, block_size, h, h + num_kv_heads / split,
                           part_m + part * num_heads, part_s + part * num_heads,
                           part_acc + part * q_size);
    }
    const int64_t group = num_heads / num_kv_heads;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * num_kv_heads > 1)
    for (int64_t task = 0; task < rows * num_kv_heads; task++) {
        const int64_t r = task / num_kv_heads, h = task % num_kv_heads;
        const int64_t part = first_chunk[r];
        pagedq_attend_combine(part_m + part * num_heads, part_s + part * num_heads,
                              part_acc + part * q_size, first_chunk[r + 1] - part, num_heads,
                              head_dim, h * group, (h + 1) * group, out + r * ldq);
    }
    free(first_chunk);
    free(part_m);
    free(part_acc);
    return 0;
}

/* A prefill's attention: tiles[4 * i ...] = (first query row, queries, sequence, position of
 * the first), each tile's queries consecutive tokens of one sequence; q and out [rows][heads *
 * head_dim], tables [sequences][table_stride]. A tile's queries share each chunk's key loads
 * (attend_parts), then each query's chunks combine in order: the bits pagedq_decode_attention
 * gives each token alone. The tiles run on `threads` threads, largest first as the caller
 * orders them. */
void pagedq_prefill(const float *q, const float *k_cache, const float *v_cache,
                    const int32_t *tables, int64_t table_stride, const int64_t *tiles,
                    int64_t ntiles, float scale, float *out, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                    int64_t threads) {
    const int64_t qsize = num_heads * head_dim;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t tile = 0; tile < ntiles; tile++) {
        const int64_t row0 = tiles[4 * tile], nq = tiles[4 * tile + 1];
        const int64_t pos0 = tiles[4 * tile + 3];
        const int32_t *table = tables + tiles[4 * tile + 2] * table_stride;
        const int64_t chunks = (pos0 + nq + CHUNK - 1) / CHUNK, ld_m = chunks * num_heads;
        float *m = malloc(sizeof(float) * (size_t)(nq * ld_m));
        float *s = malloc(sizeof(float) * (size_t)(nq * ld_m));
        float *acc = malloc(sizeof(float) * (size_t)(nq * ld_m * head_dim));
        int64_t *t_end = malloc(sizeof(int64_t) * (size_t)nq);
        for (int64_t c = 0; c < chunks; c++) {
            /* the queries that reach this chunk: query j's keys are 0 to pos0 + j */
            const int64_t first = c * CHUNK - pos0 > 0 ? c * CHUNK - pos0 : 0;
            for (int64_t j = first; j < nq; j++)
                t_end[j] = pos0 + j + 1 < (c + 1) * CHUNK ? pos0 + j + 1 : (c + 1) * CHUNK;
            attend_parts(q + (row0 + first) * qsize, qsize, nq - first, k_cache, v_cache, table,
                         c * CHUNK, t_end + first, scale, num_heads, num_kv_heads, head_dim,
                         block_size, 0, num_kv_heads, m + first * ld_m + c * num_heads,
                         s + first * ld_m + c * num_heads,
                         acc + (first * ld_m + c * num_heads) * head_dim, ld_m);
        }
        for (int64_t j = 0; j < nq; j++)
            pagedq_attend_combine(m + j * ld_m, s + j * ld_m, acc + j * ld_m * head_dim,
                                  (pos0 + j + 1 + CHUNK - 1) / CHUNK, num_heads, head_dim, 0,
                                  num_heads, out + (row0 + j) * qsize);
        free(m);
        free(s);
        free(acc);
        free(t_end);
    }
}
