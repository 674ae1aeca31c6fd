/* cpu_gemv.c's tiles: a tile's product over one pass of its panels' weights (`tile`), and
 * the dispatch to its instances by rows and panels (`any_tile`). Included there, after the
 * vectors' helpers and the tile constants. */
/* Past TILE rows the pairs take wide tiles, WIDE_TILE rows by WIDE_PANELS panels (the float32
 * many-row shape, cpu_gemv_many.h): 24 sums, each weight load feeding 6 vdpbf16ps and each
 * input 4, where 8 x 2 fed 8 and 2. The groups, now of 4 panels, still split between the
 * threads, so that the weights are read once; split by rows instead (many_rows' way), each
 * thread read all of them, and on 2 threads the wide tiles only drew level with 8 x 2 (on one
 * thread: 0.89-0.91x the time). The sums run as before, so the bits stay. An AMD EPYC Zen 4
 * (AVX-512 BF16, no AMX), SmolLM2's 49,152 x 576 greedy-head copy, 2 threads, medians of 9
 * alternating: 9 rows 2.25 -> 1.94 ms, 16 rows 3.06 -> 2.80, 32 rows 5.57 -> 4.78, 64 rows
 * 10.44 -> 9.32, 128 rows 20.60 -> 18.87 (352 -> 384 GFLOP/s; the instruction's measured peak
 * 466); 8 rows as two 4 x 4 tiles 1.71 -> 1.89, so 8 x 2 up to TILE rows. In the engine,
 * SmolLM2's throughput.py workload, the greedy head's calls alternating between the builds:
 * 0.913-0.928x the time (medians by row count from 9 rows); the head of an 86 s call 3.46 ->
 * 3.17 s (each half's sum doubled). */
#if PAIRED
#define WIDE_TILE 6
#define WIDE_PANELS 4
#define GROUP_PANELS(rows) ((rows) > TILE ? WIDE_PANELS : FEW_ROWS_PANELS(rows))
#define TILE_ROWS(rows) ((rows) > TILE ? WIDE_TILE : TILE)
#else
#define GROUP_PANELS(rows) FEW_ROWS_PANELS(rows)
#define TILE_ROWS(rows) TILE
#endif
/* One panel's sums for `rows` rows (sums[r * stride]), plus its bias (or NULL), into the
 * `lanes` real outputs of y's rows (ldy apart). */
static inline void store_panel(float *y, int64_t ldy, const vec16 *sums, int64_t stride,
                               int64_t rows, const float *bias, int64_t lanes) {
    float b[16] = {0};
    for (int64_t i = 0; bias && i < lanes; i++) b[i] = bias[i];
    for (int64_t r = 0; r < rows; r++)
        store16(y + r * ldy, bias ? add16(sums[r * stride], load16(b)) : sums[r * stride], lanes);
}

/* Whether a tile holds each step's weights in registers (HOLD: an empty asm that takes the
 * vectors in registers, so the compiler cannot fold the loads into the FMAs). Left to itself,
 * GCC 12 folded them on AVX2: each FMA loaded its weights again, 18 loads a step for the 6 x 16
 * tile's 12 FMAs where 8 serve, and the loads, not the FMAs, set the pace. Held where the sums,
 * the weights and a broadcast fit AVX2's 16 registers (rows + 1 by panels, twice, plus one):
 * the tiles of one panel (1 to 6 rows), and the partial groups at a layer's end of 1 row by 2
 * or 3 panels and 2 rows by 2. The few-row tiles of whole groups (1 x 4, 2 x 3, 3 x 2) do not
 * fit: held, they spilled and ran slower (1 to 3 rows: 0.67-0.79x the rate), so they keep the
 * folded loads.
 * One thread, an AMD EPYC Zen 3, rates with the weights in L3 (4 products of 576 x 576, 200
 * passes): 16 rows 55 -> 88 GFLOP/s, 32 rows 54 -> 88, 64 rows 53 -> 93, 16 rows of 576 x
 * 1,536 52 -> 83; in L2 the lone 6-row tile 56 -> 83. AVX-512's 32 registers: left folded.
 * Held there too (every tile fits), an AMD EPYC Zen 5's many-row products took 0.99-1.01x the
 * time (SmolLM2's and random-26m's shapes, 512 and 2,048 rows, 2 threads, medians of 30
 * alternating): the folded loads do not bound a tile there. */
#ifdef __AVX512F__
#define HELD(rows, panels) 0
#define HOLD(v) ((void)0)
#else
#define HELD(rows, panels) (((rows) + 1) * (panels) * 2 + 1 <= 16)
#define HOLD(v) __asm__("" : "+x"((v).lo), "+x"((v).hi))
#endif

/* Asks the memory for pf's next line where step i is due one: a tile's pf_lines lines spread
 * evenly over its k steps, one every `every` (1 where they are as many as the steps). */
static inline void ask_spread(const char *pf, int64_t pf_lines, int64_t every, int64_t i,
                              int64_t *done) {
    if (*done < pf_lines && i == *done * every) _mm_prefetch(pf + (*done)++ * 64, _MM_HINT_T0);
}

/* `panels` panels' outputs (16 each, `lanes[j]` of them real) for `rows` rows; both constants
 * where it is inlined. Panel j's weights at w + j * k * STEP_ELEMS, k its steps. The tile also
 * asks the memory for pf_lines lines from pf, spread over its steps (ask_spread), and step i
 * for the line pf2 + i * 64 where i is below pf2_lines (see pagedq_gemv); `ahead` (a constant,
 * float32 steps only): step i asks for each panel's line of step i + ahead into L1 (0: none;
 * cpu_gemv_many.h says where and why). */
static inline __attribute__((always_inline)) void tile(
        const input_t *x, int64_t ldx, const int rows, const int panels, const stored_t *w,
        const float *bias, float *y, int64_t ldy, int64_t k, int64_t block,
        const int64_t *lanes, const char *pf, int64_t pf_lines, const char *pf2,
        int64_t pf2_lines, const int ahead) {
    vec16 total[TILE][MAX_PANELS];
    const int64_t pf_every = pf_lines > 0 && k / pf_lines > 1 ? k / pf_lines : 1;
    int64_t pf_done = 0;
#if PAIRED
    (void)block, (void)ahead;
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < panels; j++) total[r][j] = zero16();
    for (int64_t i = 0; i < k; i++) {
        __m512i wv[MAX_PANELS];
        ask_spread(pf, pf_lines, pf_every, i, &pf_done);
        if (i < pf2_lines) _mm_prefetch(pf2 + i * 64, _MM_HINT_T0);
        for (int j = 0; j < panels; j++) wv[j] = _mm512_loadu_si512(w + (j * k + i) * 32);
        for (int r = 0; r < rows; r++) {
            const __m512bh pair = (__m512bh)_mm512_set1_epi32((int)x[r * ldx + i]);
            for (int j = 0; j < panels; j++)
                total[r][j] = _mm512_dpbf16_ps(total[r][j], pair, (__m512bh)wv[j]);
        }
    }
#else
    vec16 part[TILE][MAX_PANELS];
    for (int64_t k0 = 0; k0 < k; k0 += block) {
        const int64_t k1 = k0 + block < k ? k0 + block : k;
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < panels; j++) part[r][j] = zero16();
        for (int64_t i = k0; i < k1; i++) {
            vec16 wv[MAX_PANELS];
            ask_spread(pf, pf_lines, pf_every, i, &pf_done);
            if (i < pf2_lines) _mm_prefetch(pf2 + i * 64, _MM_HINT_T0);
            for (int j = 0; ahead && j < panels; j++)
                _mm_prefetch((const char *)(w + j * k * 16 + (i + ahead) * 16), _MM_HINT_T0);
            for (int j = 0; j < panels; j++) {
                wv[j] = load16_w(w + j * k * 16 + i * 16);
                if (HELD(rows, panels)) HOLD(wv[j]);
            }
            for (int r = 0; r < rows; r++)
                for (int j = 0; j < panels; j++)
                    part[r][j] = fma16(x[r * ldx + i], wv[j], part[r][j]);
        }
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < panels; j++)
                total[r][j] = k0 == 0 ? part[r][j] : add16(total[r][j], part[r][j]);
    }
#endif
    for (int j = 0; j < panels; j++)
        store_panel(y + j * 16, ldy, &total[0][j], MAX_PANELS, rows, bias ? bias + j * 16 : 0,
                    lanes[j]);
}

/* One tile of `rows` rows (1 to TILE_ROWS) and `panels` panels (1 to GROUP_PANELS(rows)), as
 * constants. */
static void any_tile(const input_t *x, int64_t ldx, int64_t rows, int64_t panels,
                     const stored_t *w, const float *bias, float *y, int64_t ldy, int64_t k,
                     int64_t block, const int64_t *lanes, const char *pf, int64_t pf_lines,
                     const char *pf2, int64_t pf2_lines) {
#if PAIRED /* a wide group's tile; a layer's last group of 3 panels as 2 and 1 */
    if (panels == WIDE_PANELS) {
#define WIDE_CASE(R)                                                                        \
        case R:                                                                             \
            tile(x, ldx, R, WIDE_PANELS, w, bias, y, ldy, k, block, lanes, pf, pf_lines,    \
                 pf2, pf2_lines, 0);                                                        \
            return;
        switch (rows) {
            WIDE_CASE(1) WIDE_CASE(2) WIDE_CASE(3) WIDE_CASE(4) WIDE_CASE(5)
            default: WIDE_CASE(WIDE_TILE)
        }
#undef WIDE_CASE
    }
    if (panels > PANELS) {
        any_tile(x, ldx, rows, PANELS, w, bias, y, ldy, k, block, lanes, pf, pf_lines, pf2,
                 pf2_lines);
        any_tile(x, ldx, rows, panels - PANELS, w + PANELS * k * STEP_ELEMS,
                 bias ? bias + PANELS * 16 : 0, y + PANELS * 16, ldy, k, block, lanes + PANELS,
                 0, 0, 0, 0);
        return;
    }
#endif
#ifndef __AVX512F__ /* FEW_ROWS_PANELS past PANELS */
#define FEW_CASE(R, P)                                                                      \
    if (rows == R && panels == P) {                                                         \
        tile(x, ldx, R, P, w, bias, y, ldy, k, block, lanes, pf, pf_lines, pf2, pf2_lines,  \
             0);                                                                            \
        return;                                                                             \
    }
    FEW_CASE(1, 4) FEW_CASE(1, 3) FEW_CASE(1, 2) FEW_CASE(2, 3) FEW_CASE(2, 2) FEW_CASE(3, 2)
#undef FEW_CASE
#endif
#define TILE_CASE(R)                                                                        \
    case R:                                                                                 \
        if (panels == PANELS)                                                               \
            tile(x, ldx, R, PANELS, w, bias, y, ldy, k, block, lanes, pf, pf_lines, pf2,    \
                 pf2_lines, 0);                                                             \
        else                                                                                \
            tile(x, ldx, R, 1, w, bias, y, ldy, k, block, lanes, pf, pf_lines, pf2,         \
                 pf2_lines, 0);                                                             \
        break;
    switch (rows) {
        TILE_CASE(1)
        TILE_CASE(2)
        TILE_CASE(3)
#if TILE > 4
        TILE_CASE(4)
        TILE_CASE(5)
#endif
#if TILE > 6
        TILE_CASE(6)
        TILE_CASE(7)
#endif
        default: TILE_CASE(TILE)
    }
#undef TILE_CASE
}
