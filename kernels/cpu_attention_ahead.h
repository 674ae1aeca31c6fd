/* What the attention's scores loop asks the memory for ahead of its keys (kernels/cpu_attention.c):
 * the K and V rows (every KV head of the call's) of the tile of 8 keys PREFETCH keys on, V's
 * for the values' loop after it. A tile's lines are spread evenly over its steps (a step: 8
 * or 32 of head_dim, one KV head's), a few beside each step's FMAs.
 *
 * Why spread: asked all at once at the tile's start (256 lines for random-26m's 4 KV heads),
 * the requests outran what the core keeps in flight, and the tile waited on the memory before
 * computing; spread, the memory and the FMAs overlap. random-26m's decode attention, 128 rows
 * x 340 keys from memory (block tables scattered), float32, AMD EPYC Zen 4, 2 threads: 20.6
 * GB/s (8 keys ahead into L1, all at once) -> 26.4 (into L2, a KV head's share at each head)
 * -> 32.9 (into L2, spread over the steps; the machine's sum of 1 GiB reads 31.8); one thread
 * 206 -> 116 ns a key. Into L1 the spread lost (221 ns): L1's misses in flight are fewer.
 * 4, 8 or 12 keys ahead measured alike, 16 and 32 worse (160, 180 ns on 2 threads). Intel
 * kept 8 float32 keys into L1 (a Xeon with AMX, 110 rows x 400 keys: 4-12 keys into L1
 * 47.7-50.3 ns a key, 16 into L2 55.3-60.5; measured before the spread). bfloat16 rows, half
 * the bytes, take the same bytes ahead. */
#ifndef PAGEDQ_CPU_ATTENTION_AHEAD_H
#define PAGEDQ_CPU_ATTENTION_AHEAD_H
#include <immintrin.h>
#include <stdint.h>

#include "cpu_kernels.h"

#define PREFETCH (8 * 4 / (int)sizeof(stored_t))
#ifdef PAGEDQ_INTEL
#define PREFETCH_HINT _MM_HINT_T0
#else
#define PREFETCH_HINT _MM_HINT_T1
#endif

/* A tile's rows to ask for (K's then V's of each key) and the next line: row r, line l. */
typedef struct {
    const char *row[16];
    int64_t rows, lines, per_step, r, l;
} ahead_t;

/* The rows of keys t0 + PREFETCH to t0 + PREFETCH + 7 (their offsets[] in the pools, which run
 * to stride), KV heads kv_begin to kv_end, spread over `steps` steps; none past stride. */
static inline void ahead_start(ahead_t *a, const stored_t *k_cache, const stored_t *v_cache,
                               const int64_t *offsets, int64_t t0, int64_t stride,
                               int64_t kv_begin, int64_t kv_end, int64_t head_dim,
                               int64_t steps) {
    a->rows = a->r = a->l = 0;
    a->lines = ((kv_end - kv_begin) * head_dim * (int64_t)sizeof(stored_t) + 63) / 64;
    for (int64_t k = 0; k < 8 && t0 + PREFETCH + k < stride; k++) {
        const int64_t at = offsets[t0 + PREFETCH + k] + kv_begin * head_dim;
        a->row[a->rows++] = (const char *)(k_cache + at);
        a->row[a->rows++] = (const char *)(v_cache + at);
    }
    a->per_step = (a->rows * a->lines + steps - 1) / steps;
}

/* One step's share of the lines (none where a is NULL: a tile asks once, at the first query
 * that computes it). */
static inline void ahead_ask(ahead_t *a) {
    if (!a) return;
    for (int64_t n = a->per_step; n > 0 && a->r < a->rows; n--) {
        _mm_prefetch(a->row[a->r] + a->l * 64, PREFETCH_HINT);
        if (++a->l == a->lines) a->l = 0, a->r++;
    }
}

#endif
