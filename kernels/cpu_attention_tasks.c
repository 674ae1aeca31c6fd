/* The CPU paged attention's parallel loops, on torch's OpenMP threads (compiled with
 * kernels/cpu_attention.c, whose per-token body they run): a decode step's rows in chunks of
 * keys, and a prefill's tokens in tiles that share key loads. Over float32 pools, or bfloat16
 * ones in cpu_bf16.c's build. */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_kernels.h"

/* A decode step's attention: `rows` query tokens (q and out rows ldq apart), row r over its
 * first context_lens[r] keys (its blocks at tables + r * table_stride). A task per row and
 * chunk of keys, every KV head (their rows lie side by side: one thread read cold keys of 3
 * heads at 8.8 GB/s, of 1 head at 4.4, a Xeon), or per KV head too where the chunks are too
 * few for the threads, so that one long sequence uses every core; then each row's chunks
 * combined in order. Returns 0, or -1 where scratch memory could not be had. */
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
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t r = 0;
        while (task >= first_task[r + 1]) r++;
        const int64_t c = (task - first_task[r]) / split;
        const int64_t h = (task - first_task[r]) % split * (num_kv_heads / split);
        const int64_t part = first_chunk[r] + c, end = (c + 1) * CHUNK;
        const int64_t t_end = end < context_lens[r] ? end : context_lens[r];
        if (NAME(pagedq_attend_parts)(q + r * ldq, 0, 1, k_cache, v_cache,
                                      tables + r * table_stride, c * CHUNK, &t_end, scale,
                                      num_heads, num_kv_heads, head_dim, block_size, h,
                                      h + num_kv_heads / split, part_m + part * num_heads,
                                      part_s + part * num_heads, part_acc + part * q_size,
                                      0) != 0) {
#pragma omp atomic write
            failed = 1;
        }
    }
    const int64_t group = num_heads / num_kv_heads, combines = failed ? 0 : rows * num_kv_heads;
#pragma omp parallel for num_threads(threads) schedule(static) if (combines > 1)
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

/* A prefill's attention: tiles[4 * i ...] = (first query row, queries, sequence, position of
 * the first), each tile's queries consecutive tokens of one sequence; q and out [rows][heads *
 * head_dim], tables [sequences][table_stride]. A tile's queries share each chunk's key loads
 * (pagedq_attend_parts), then each query's chunks combine in order: the bits
 * pagedq_decode_attention gives each token alone. The tiles run on `threads` threads, largest
 * first as the caller orders them. Returns 0, or -1 where scratch memory could not be had (out
 * is then undefined). */
int NAME(pagedq_prefill)(const float *q, const stored_t *k_cache, const stored_t *v_cache,
                          const int32_t *tables, int64_t table_stride, const int64_t *tiles,
                          int64_t ntiles, float scale, float *out, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                          int64_t threads) {
    const int64_t qsize = num_heads * head_dim;
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
                                     ld_m) == 0;
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
    return failed ? -1 : 0;
}
