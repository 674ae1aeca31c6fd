/* A linear layer's product for decode batches (up to engine/cpu_linear.py's GEMV_ROWS rows;
 * any batch, a prefill's too, of float32 weights on AVX-512: cpu_gemv_many.h), float32,
 * AVX-512 or AVX2 + FMA, on torch's OpenMP threads: compiled at first use by
 * kernels/cpu_native.py, called by engine/cpu_linear.py where a probe at load found its sums
 * equal to oneDNN's many-row ones.
 *
 * Why: oneDNN's product of one row (or two) reads the weights at 13.5 GB/s of the 32.7 a
 * 2-core machine streams, the rest lost in its threads' barrier; at batch 1 the linear layers
 * were 71 % of a SmolLM2 decode step. This kernel streams them, and keeps pace with oneDNN or
 * leads at every batch it takes (SmolLM2's 121 layers, cold, 32 rows: 50.6 against 56.2 ms on
 * a Xeon; 19 against 29 on an AMD EPYC, with the prefetch of pagedq_gemv).
 *
 * The order of the sums is the contract: y[m][n] is K cut into blocks of `block` inputs, each
 * block an FMA chain from zero in input order, the blocks' sums added in order, then the bias.
 * That is how oneDNN's many-row kernel sums on AVX-512 (block 512 up to 1,024 inputs, 1,024
 * past them, measured on an AMD EPYC and a Xeon); so a row gets the same bits here as in any
 * batch.
 *
 * Weights are panels of 16 outputs, input-major: w[panel][k][16], outputs padded to 16; float32,
 * or bfloat16 in cpu_bf16.c's build (widened as they load: the same sums of the same values).
 * No probe pairs that build with oneDNN, whose bfloat16 products round the inputs too. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_kernels.h"

#ifdef __AVX512F__
typedef __m512 vec16;
static inline vec16 zero16(void) { return _mm512_setzero_ps(); }
static inline vec16 load16(const float *p) { return _mm512_loadu_ps(p); }
static inline vec16 load16_w(const stored_t *p) { return load16_stored(p); }
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
static inline vec16 load16_w(const stored_t *p) {
    return (vec16){load8_stored(p), load8_stored(p + 8)};
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

/* A tile: TILE rows by PANELS panels, computed together over one pass of the panels' weights.
 * Their block sums sit in registers (TILE * PANELS vectors: 16 of AVX-512's 32 zmm; 12 of
 * AVX2's 16 ymm, 6 pairs), each weight load feeds TILE FMAs and each input PANELS. AVX2's 6
 * rows (BLIS's 6 x 16 shape) keep 12 FMA chains in flight where 4 rows kept 8 (two FMA pipes
 * of 4-cycle latency need 8 at the least) and read a panel from L2 a third fewer times.
 * SmolLM2's 121 layers, cold, 2 threads, an AMD EPYC Zen 3 (AVX2 only), best of 10
 * alternating, 4 -> 6 rows: 8 rows 55.3 -> 48.3 ms, 16 rows 67.2 -> 54.9, 32 rows 114.9 ->
 * 99.8, 64 rows 208 -> 177 (oneDNN 187); random-26m's 32 layers at 32 rows 22.4 -> 18.2 ms
 * (oneDNN 21.7). The inputs in chunks across the tiles (cpu_gemv_chunks.h) lost there past
 * 16 rows. */
#ifdef __AVX512F__
#define TILE 8
#define PANELS 2
#else
#define TILE 6
#define PANELS 1
#endif
/* A few rows take more panels a group (FEW_ROWS_PANELS: AVX2's 12 sums in registers as 1 row by 4
 * panels, 2 by 3, 3 by 2): a panel's 16 outputs are two FMA chains a row (the order of the sums
 * allows no more), so a step waits on the FMA's latency and the loads run only as far ahead as
 * the core's window reaches; four panels are four streams and eight chains. AVX2, an AMD EPYC Zen
 * 3, 2 threads, cold, alternating in one process: SmolLM2's 120 layers at 1 row 17.9 -> 12.8 ms
 * (24 -> 33 GB/s), 2 rows 20.4 -> 17.0, 3 rows level, its 113 MB lm_head 4.1 -> 2.8 ms,
 * random-26m's layers 4.5 -> 3.6 ms; a single stream's step 23.5-25.0 -> 16.9-20.1 ms. AVX-512
 * builds keep their 2 panels: not measured there. */
#ifdef __AVX512F__
#define FEW_ROWS_PANELS(rows) PANELS
#else
#define FEW_ROWS_PANELS(rows) ((rows) == 1 ? 4 : (rows) == 2 ? 3 : (rows) == 3 ? 2 : PANELS)
#endif
/* the most panels a tile takes: AVX2's one row, AVX-512's many rows (cpu_gemv_many.h), the
 * pairs' wide tiles */
#define MAX_PANELS 4

/* Where the CPU has AVX-512 BF16, the bfloat16 build takes its inputs in pairs: the rows
 * rounded to bfloat16 once per call (input_t: inputs 2i and 2i + 1, the first in the low
 * half), the panels as w[panel][k / 2][16][2] (inputs padded to even), and each vdpbf16ps
 * adds both inputs' products to a lane's sum, twice the multiply-adds of an FMA a cycle. Its
 * one sum per output runs over the pairs in order (block is not used); it rounds like
 * oneDNN's bfloat16 products, not like the float32 build. A STEP is an input (a pair) of
 * every panel: STEP_ELEMS weights. */
#if PAIRED
#define STEP_ELEMS 32
typedef uint32_t input_t;

/* x's rows as pairs (to_pairs), `padded` rows (>= rows) of (k + 1) / 2, those past `rows`
 * zero (AMX's tiles take rows in blocks of 32); NULL where the memory could not be had */
static input_t *paired_rows(const float *x, int64_t ldx, int64_t rows, int64_t k,
                            int64_t padded) {
    const int64_t steps = (k + 1) / 2;
    input_t *in = malloc(sizeof(input_t) * (size_t)(padded * steps));
    if (!in) return NULL;
    for (int64_t r = 0; r < rows; r++) to_pairs(x + r * ldx, k, in + r * steps);
    memset(in + rows * steps, 0, sizeof(input_t) * (size_t)((padded - rows) * steps));
    return in;
}
#else
#define STEP_ELEMS 16
typedef float input_t;
#endif

#include "cpu_gemv_tile.h"
#include "cpu_gemv_chunks.h"
#include "cpu_gemv_amx.h"
#include "cpu_gemv_many.h"

/* Whether a product of `rows` rows of k inputs takes AMX's tiles (the bfloat16 build, where the
 * CPU has AMX): its sums then differ from the pairs' below AMX_ROWS rows, so a row's bits
 * depend on the side of AMX_ROWS its batch lies on. 0 in every other build. */
int NAME(pagedq_gemv_tiles)(int64_t rows, int64_t k) {
#if AMX
    return rows > AMX_ROWS && (k + 1) / 2 % 16 == 0 && amx_ready();
#else
    (void)rows, (void)k;
    return 0;
#endif
}

/* pagedq_gemv's group g of `group` panels (see there) */
static inline __attribute__((always_inline)) void gemv_group(
        const input_t *in, int64_t ldin, int64_t rows, const stored_t *w, const float *bias,
        float *y, int64_t ldy, int64_t n, int64_t steps, int64_t block, int64_t group,
        int64_t panels, int64_t groups, int64_t g) {
    const int64_t p0 = g * group, np = panels - p0 < group ? panels - p0 : group;
    int64_t lanes[MAX_PANELS];
    for (int64_t j = 0; j < np; j++)
        lanes[j] = n - (p0 + j) * 16 < 16 ? n - (p0 + j) * 16 : 16;
    /* The next group's weights are asked of the memory while this group's FMAs run, a
     * line of 64 bytes an input: with 1 tile, its first two panels in that tile (AVX2's
     * groups of 3 for 2 rows leave the third to the hardware's prefetch); with 2, half
     * in each; from 3 on, shared evenly by the tiles after the first, which compute on
     * this group's weights from the cache; each tile spreads its share over its steps.
     * Without it the memory and the FMAs had taken turns (SmolLM2's 121 layers, cold, 2
     * threads, AMD EPYC Zen 5: 8 rows 16.3 -> 12.7-13.8 ms, 16 rows 17.1 -> 12.7, 32 rows
     * 26.0 -> 18.5-21, 64 rows 41.8 -> 36.5; one row, which computes too little to wait on
     * the memory, gained nothing and is left out). Spread, not asked a line a step in one
     * tile (AVX2's group of one panel had given a whole panel to tile 1, at the rate of
     * its FMAs' reading from L1: ~32 GB/s a core); SmolLM2's 120 layers, cold, an AMD
     * EPYC Zen 3, medians of 20 alternating in one process: 8 rows on 2 threads 37.2 ->
     * 33.5 ms (ahead 20 of 20), 16 rows on 1 thread 88.0 -> 84.1 (20/20), on 2 49.3 ->
     * 46.1 (17/20), 32 rows on 2 91.6 -> 90.5 (14/20). AVX-512's float32 products of
     * more than TILE rows are chunked(); its bfloat16 build's 4 tiles or more now share
     * too (not measured), and where a tile's share is more lines than its steps (a lone
     * tile; the pairs' wide groups in 2 or 3 tiles) it asks a line a step from a second
     * run too. */
    const char *next = (const char *)(w + (p0 + group) * steps * STEP_ELEMS);
    const int64_t next_panels = panels - p0 - np < group ? panels - p0 - np : group;
    const int64_t lines = g + 1 < groups && rows > 1
        ? next_panels * steps * STEP_ELEMS * (int64_t)sizeof(stored_t) / 64 : 0;
    const int64_t tiles = (rows + TILE_ROWS(rows) - 1) / TILE_ROWS(rows);
    for (int64_t t = 0; t < tiles; t++) {
        /* this tile's `count` lines of the next group's from a: [a, a + na) and [b, b + nb) */
        int64_t a = 0, count = 0;
        if (tiles == 1) {
            count = lines;
        } else if (tiles == 2 || t > 0) {
            const int64_t first = tiles == 2 ? 0 : 1, share = tiles - first;
            const int64_t per = (lines + share - 1) / share;
            a = (t - first) * per;
            count = lines - a < per ? lines - a : per;
        }
        const int64_t na = count < steps ? count : steps, b = a + na, nb = count - na;
        /* the rows dealt evenly over the tiles (16 rows: 6 + 5 + 5, not 6 + 6 + 4; 8 rows: 4 +
         * 4, not 6 + 2): a tile of few rows keeps too few FMA chains in flight to hide their
         * latency (AVX2, a lone tile from L3, one thread, an AMD EPYC Zen 3: 2 rows 45
         * GFLOP/s, 3 rows 64-70, 4 rows 77-84, 5 and 6 rows 87-91). A row's sums are its own
         * in any tile, so the bits stay. SmolLM2's 120 layers, cold, one thread, the time
         * against 6-first tiles: 8 rows 0.82x, 13 rows 0.81-0.88x, 16 rows 0.78-0.90x, 32
         * rows 0.93-0.98x; in the engine, batched.py's workload, the split decode step
         * (2 x 16 rows) step by step alternating: 0.952x (median of 248 pairs). */
        const int64_t base = rows / tiles, extra = rows % tiles;
        const int64_t r0 = t * base + (t < extra ? t : extra);
        any_tile(in + r0 * ldin, ldin, base + (t < extra), np,
                 w + p0 * steps * STEP_ELEMS, bias ? bias + p0 * 16 : 0,
                 y + r0 * ldy + p0 * 16, ldy, steps, block, lanes, next + a * 64,
                 na > 0 ? na : 0, next + b * 64, nb > 0 ? nb : 0);
    }
}

/* y[rows][n] (row stride ldy) = x[rows][k] (row stride ldx) times the panels' weights, plus
 * bias (or NULL); rows > 0, k > 0. A thread takes whole groups of GROUP_PANELS(rows) panels,
 * and each group's rows in tiles of at most TILE_ROWS(rows), dealt evenly (its weights read
 * again per tile, from the cache); `threads` TEAM_TASKS (cpu_kernels.h) makes the groups
 * tasks, or the rows' parts past MANY_ROWS, or runs AMX's tiles on the calling thread.
 * Returns 0, or -1 where the paired inputs' memory could not be had (y is then undefined). */
int NAME(pagedq_gemv)(const float *x, int64_t ldx, int64_t rows, const stored_t *w,
                      const float *bias, float *y, int64_t ldy, int64_t n, int64_t k,
                      int64_t block, int64_t threads) {
    const int64_t group = GROUP_PANELS(rows);
    const int64_t panels = (n + 15) / 16, groups = (panels + group - 1) / group;
#if PAIRED
    const int64_t steps = (k + 1) / 2, ldin = steps;
#if AMX
    const int tiles = NAME(pagedq_gemv_tiles)(rows, k);
    const int64_t padded = tiles ? (rows + 31) / 32 * 32 : rows;
#else
    const int64_t padded = rows;
#endif
    input_t *in = paired_rows(x, ldx, rows, k, padded);
    if (!in) return -1;
#if AMX
    if (tiles) {
        amx_gemv(in, ldin, rows, w, bias, y, ldy, n, steps,
                 threads == TEAM_TASKS ? 1 : threads);
        free(in);
        return 0;
    }
#endif
#else
    const int64_t steps = k, ldin = ldx;
    const input_t *in = x;
    if (rows > MANY_ROWS)
        return many_rows(x, ldx, rows, w, bias, y, ldy, n, k, block, threads);
#ifdef __AVX512F__
    if (rows > TILE) return chunked(x, ldx, rows, w, bias, y, ldy, n, k, block, threads);
#endif
#endif
    if (threads == TEAM_TASKS) {
#pragma omp taskloop num_tasks(TEAM_PARTS)
        for (int64_t g = 0; g < groups; g++)
            gemv_group(in, ldin, rows, w, bias, y, ldy, n, steps, block, group, panels, groups, g);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t g = 0; g < groups; g++)
            gemv_group(in, ldin, rows, w, bias, y, ldy, n, steps, block, group, panels, groups, g);
    }
#if PAIRED
    free(in);
#endif
    return 0;
}
