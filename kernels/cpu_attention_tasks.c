/* The CPU paged attention's parallel loops, on torch's OpenMP threads (compiled with
 * kernels/cpu_attention.c, whose per-token body they run): a decode step's rows in chunks of
 * keys, and a prefill's tokens in tiles that share key loads (and, with AVX-512 in float32, its
 * keys laid out as columns once for every tile); then the chunks' partials combined. Over
 * float32 pools, or bfloat16 ones in cpu_bf16.c's build. */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_attention_columns.h"
#include "cpu_kernels.h"

/* pagedq_decode_attention's tasks: a row's chunk of keys, every KV head or one */
struct decode_tasks {
    const float *q;
    int64_t ldq;
    const stored_t *k_cache, *v_cache;
    const int32_t *tables;
    int64_t table_stride;
    const int32_t *context_lens;
    const int64_t *first_chunk, *first_task;
    int64_t split;
    float scale;
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    float *part_m, *part_s, *part_acc;
};

static int attend_task(const struct decode_tasks *d, int64_t task) {
    int64_t r = 0;
    while (task >= d->first_task[r + 1]) r++;
    const int64_t c = (task - d->first_task[r]) / d->split;
    const int64_t h = (task - d->first_task[r]) % d->split * (d->num_kv_heads / d->split);
    const int64_t part = d->first_chunk[r] + c, end = (c + 1) * CHUNK;
    const int64_t t_end = end < d->context_lens[r] ? end : d->context_lens[r];
    const int64_t q_size = d->num_heads * d->head_dim;
    return NAME(pagedq_attend_parts)(d->q + r * d->ldq, 0, 1, d->k_cache, d->v_cache,
                                     d->tables + r * d->table_stride, c * CHUNK, &t_end,
                                     d->scale, d->num_heads, d->num_kv_heads, d->head_dim,
                                     d->block_size, h, h + d->num_kv_heads / d->split,
                                     d->part_m + part * d->num_heads,
                                     d->part_s + part * d->num_heads, d->part_acc + part * q_size,
                                     0, 0);
}

/* A decode step's attention: `rows` query tokens (q and out rows ldq apart), row r over its
 * first context_lens[r] keys (its blocks at tables + r * table_stride). A task per row and
 * chunk of keys, every KV head (their rows lie side by side: one thread read cold keys of 3
 * heads at 8.8 GB/s, of 1 head at 4.4, a Xeon), or per KV head too where the chunks are too
 * few for the threads, so that one long sequence uses every core; then each row's chunks
 * combined in order (on one thread where `threads` is TEAM_TASKS: cpu_kernels.h). Returns 0,
 * or -1 where scratch memory could not be had. */
int NAME(pagedq_decode_attention)(const float *q, int64_t ldq, const stored_t *k_cache,
                                  const stored_t *v_cache, const int32_t *tables,
                                  int64_t table_stride, const int32_t *context_lens,
                                  int64_t rows, float scale, float *out, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                  int64_t threads) {
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
    int failed = 0;
    const struct decode_tasks d = {q, ldq, k_cache, v_cache, tables, table_stride, context_lens,
                                   first_chunk, first_task, split, scale, num_heads,
                                   num_kv_heads, head_dim, block_size, part_m, part_s, part_acc};
    if (threads == TEAM_TASKS) {
#pragma omp taskloop num_tasks(TEAM_PARTS) shared(failed)
        for (int64_t task = 0; task < tasks; task++)
            if (attend_task(&d, task) != 0) {
#pragma omp atomic write
                failed = 1;
            }
    } else {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++)
            if (attend_task(&d, task) != 0) {
#pragma omp atomic write
                failed = 1;
            }
    }
    const int64_t group = num_heads / num_kv_heads, combines = failed ? 0 : rows * num_kv_heads;
#pragma omp parallel for num_threads(threads == TEAM_TASKS ? 1 : threads) schedule(static) \
    if (combines > 1 && threads != TEAM_TASKS)
    for (int64_t task = 0; task < combines; task++) {
        const int64_t r = task / num_kv_heads, h = task % num_kv_heads;
        const int64_t part = first_chunk[r];
        NAME(pagedq_attend_combine)(part_m + part * num_heads, part_s + part * num_heads,
                              part_acc + part * q_size, first_chunk[r + 1] - part, num_heads,
                              head_dim, h * group, (h + 1) * group, out + r * ldq);
    }
    free(first_chunk);
    free(part_m);
    free(part_acc);
    return failed ? -1 : 0;
}

#if COLUMNS
/* A sequence's keys are laid out as columns where the call has at least this many of its
 * queries: laying them out reads every key once, as one query's attention does. */
#define COLUMNS_FROM 16

/* Every sequence's keys that the tiles read (to its last tile's last query), as columns
 * (key_columns), at *cols + (*cols_at)[sequence], or (*cols_at)[sequence] -1 for a sequence of
 * fewer than COLUMNS_FROM queries here: laid out once for all of its tiles; *cols NULL where no
 * sequence has that many. Returns 0, or -1 where the memory could not be had. */
static int key_columns_of(const stored_t *k_cache, const int32_t *tables, int64_t table_stride,
                          const int64_t *tiles, int64_t ntiles, int64_t row, int64_t block_size,
                          int64_t threads, float **cols, int64_t **cols_at) {
    int64_t sequences = 0;
    for (int64_t i = 0; i < ntiles; i++)
        sequences = tiles[4 * i + 2] + 1 > sequences ? tiles[4 * i + 2] + 1 : sequences;
    /* per sequence: its keys, its queries, then its first group's index among all groups */
    int64_t *keys = calloc((size_t)(3 * sequences + 1), sizeof(int64_t));
    if (!keys) return -1;
    int64_t *queries = keys + sequences, *first = queries + sequences;
    for (int64_t i = 0; i < ntiles; i++) {
        const int64_t seq = tiles[4 * i + 2], end = tiles[4 * i + 3] + tiles[4 * i + 1];
        keys[seq] = end > keys[seq] ? end : keys[seq];
        queries[seq] += tiles[4 * i + 1];
    }
    for (int64_t seq = 0; seq < sequences; seq++) {
        if (queries[seq] < COLUMNS_FROM) keys[seq] = 0;
        first[seq + 1] = first[seq] + (keys[seq] + 15) / 16;
    }
    const int64_t groups = first[sequences];
    if (groups == 0) { /* a call of short chunks (a serving step's, say): nothing to lay out */
        free(keys);
        return 0;
    }
    *cols = groups < INT64_MAX / 64 / row ? aligned_alloc(64, sizeof(float) * (size_t)(
        groups * row * 16)) : 0;
    *cols_at = malloc(sizeof(int64_t) * (size_t)sequences);
    if (!*cols || !*cols_at) {
        free(keys);
        free(*cols);
        free(*cols_at);
        return -1;
    }
    for (int64_t seq = 0; seq < sequences; seq++)
        (*cols_at)[seq] = keys[seq] > 0 ? first[seq] * row * 16 : -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t seq = 0;
        while (g >= first[seq + 1]) seq++;
        key_columns(k_cache, tables + seq * table_stride, block_size, row,
                    (g - first[seq]) * 16, keys[seq], *cols + g * row * 16);
    }
    free(keys);
    return 0;
}
#endif

/* A prefill's attention: tiles[4 * i ...] = (first query row, queries, sequence, position of
 * the first), each tile's queries consecutive tokens of one sequence; q and out [rows][heads *
 * head_dim], tables [sequences][table_stride]. A tile's queries share each chunk's key loads
 * (pagedq_attend_parts; where COLUMNS, from the keys laid out once per call by key_columns_of),
 * then each query's chunks combine in order: the bits
 * pagedq_decode_attention gives each token alone. The tiles run on `threads` threads, largest
 * first as the caller orders them. Returns 0, or -1 where scratch memory could not be had (out
 * is then undefined). */
int NAME(pagedq_prefill)(const float *q, const stored_t *k_cache, const stored_t *v_cache,
                          const int32_t *tables, int64_t table_stride, const int64_t *tiles,
                          int64_t ntiles, float scale, float *out, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                          int64_t threads) {
    const int64_t qsize = num_heads * head_dim;
    float *cols = 0;
    int64_t *cols_at = 0;
#if COLUMNS
    if (key_columns_of(k_cache, tables, table_stride, tiles, ntiles, num_kv_heads * head_dim,
                       block_size, threads, &cols, &cols_at) != 0)
        return -1;
#endif
    int failed = 0;
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
        int ok = m && s && acc && t_end;
        for (int64_t c = 0; ok && c < chunks; c++) {
            /* the queries that reach this chunk: query j's keys are 0 to pos0 + j */
            const int64_t first = c * CHUNK - pos0 > 0 ? c * CHUNK - pos0 : 0;
            for (int64_t j = first; j < nq; j++)
                t_end[j] = pos0 + j + 1 < (c + 1) * CHUNK ? pos0 + j + 1 : (c + 1) * CHUNK;
            ok = NAME(pagedq_attend_parts)(q + (row0 + first) * qsize, qsize, nq - first, k_cache,
                                     v_cache, table, c * CHUNK, t_end + first, scale,
                                     num_heads, num_kv_heads, head_dim, block_size, 0,
                                     num_kv_heads, m + first * ld_m + c * num_heads,
                                     s + first * ld_m + c * num_heads,
                                     acc + (first * ld_m + c * num_heads) * head_dim,
                                     ld_m, cols && cols_at[tiles[4 * tile + 2]] >= 0
                                               ? cols + cols_at[tiles[4 * tile + 2]] : 0) == 0;
        }
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t j = 0; ok && j < nq; j++)
            NAME(pagedq_attend_combine)(m + j * ld_m, s + j * ld_m, acc + j * ld_m * head_dim,
                                  (pos0 + j + 1 + CHUNK - 1) / CHUNK, num_heads, head_dim, 0,
                                  num_heads, out + (row0 + j) * qsize);
        free(m);
        free(s);
        free(acc);
        free(t_end);
    }
    free(cols);
    free(cols_at);
    return failed ? -1 : 0;
}

/* out[g] for query heads g_begin to g_end from `chunks` partials of pagedq_attend_parts, chunk
 * c's at m + c * num_heads, s + c * num_heads, acc + c * num_heads * head_dim: each rescaled
 * by exp(its max - the highest), summed in chunk order, divided by the summed s. */
void NAME(pagedq_attend_combine)(const float *m, const float *s, const float *acc,
                                 int64_t chunks, int64_t num_heads, int64_t head_dim,
                                 int64_t g_begin, int64_t g_end, float *out) {
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
