/* cpu_gemv.c's product for batches past MANY_ROWS rows (a prefill's, and on Intel with AVX-512
 * BF16 a decode step's of 65 rows or more: cpu_gemv_chunks.h; float32 or widened bfloat16
 * panels): included there, after `any_tile`.
 *
 * Each thread takes its share of the rows (whole tiles) and walks them MANY_BLOCK rows at a
 * time, each block through every group of MANY_PANELS panels, so its inputs stay in the
 * thread's L2 while the weights come from the shared cache. Tiles of 6 rows by 4 panels: 24
 * sums in registers, each weight load feeding 6 FMAs and each input 4 (8 x 2 fed 8 and 2:
 * 10 loads to 16 FMAs, here 10 to 24). The sums run as `tile`'s do, so the bits are a batch's.
 * SmolLM2's four shapes, 2 threads, a Xeon with AMX (family 6 model 167), medians of 9
 * alternating passes against oneDNN's packed product (the prefill's before), 30 layers cold:
 * 256 rows 288 -> 307-313 GFLOP/s, 2,048 rows 304 -> 320-329; hot: 256 rows 299 -> 332, 512
 * rows 324 -> 351, 2,048 rows 338 -> 352. The groups split between the threads (as for fewer
 * rows) left one idle at the end of a layer whose group count is odd: 6 x 4 so 316-319 at
 * 2,048 rows, 8 x 2 286-289. One thread, ~2,000 rows: 8 x 2 141-143, 8 x 3 156, 12 x 2 147,
 * 14 x 2 146, 4 x 6 150, 5 x 4 156, 6 x 4 163-165 (oneDNN 160-166). Blocks of 96 or 336
 * rows, or the next group's lines asked for (into L1 or L2): level. The weights taken 64-256
 * inputs at a time across the block's tiles, the sums kept in memory between (cpu_gemv_chunks.h's
 * way): 0.82-0.97x. */
#if !PAIRED
#define MANY_TILE 6
#define MANY_BLOCK 168
#ifdef __AVX512F__
#define MANY_PANELS 4
#define MANY_ROWS CHUNKED_ROWS
/* On Intel each step of a tile asks for its panels' lines MANY_AHEAD steps on into L1 (`tile`'s
 * `ahead`). Every tile after a block's first reads its group's weights (147-393 KB for
 * SmolLM2) from L2, and there the tile ran at ~80 % of the FMAs' peak against 95 % with them
 * in L1 (one thread, a Xeon with AMX, family 6 model 167: 6 x 4 at 128 inputs 222-229 GFLOP/s
 * in L1, 168-189 over 2,016 rows of 576 x 3,072). Time with the asks against without, the same
 * bits, 2 threads, 30 layers cold, medians of 6-8 alternating passes: SmolLM2's shapes at 2,048
 * rows 0.974x (16 steps on: 0.989x), at 256 rows 0.960x; random-26m's at 2,048 rows 0.983x and
 * 0.975x (16 on: 0.955x, 4 on: 0.981x). In the engine, random-26m's `throughput.py` workload,
 * each shape's products alternating between two builds (ABBA), two calls: 0.975x and 0.986x
 * the many-row products' time. The same asks in `chunked`'s first tile of a chunk (decode
 * steps of 9-128 rows): level (0.998-1.011x, step by step). AMD's cores: none (a Zen 4's
 * tiles already ran at 91-94 % of its peak; on a Zen 5 the asks drew level, 0.967-1.021x the
 * time at 512 and 2,048 rows of SmolLM2's and random-26m's shapes, medians of 30). */
#ifdef PAGEDQ_INTEL
#define MANY_AHEAD 8
#else
#define MANY_AHEAD 0
#endif
#else
/* AVX2: `tile`'s 6 x 16 (12 of 16 registers), past the decode batches (GEMV_ROWS, 64), where
 * the groups of one panel had read each panel once for all the rows and left oneDNN ahead.
 * SmolLM2's four shapes, 2 threads, an AMD EPYC Zen 3, best of 7 alternating against oneDNN's
 * packed product: 128 rows 131 against 121 GFLOP/s, 300 rows 172 against 143, 1,024 rows 178
 * against 154, 2,048 rows 180-183 against 155-161; blocks of 252 to 504 rows: level. */
#define MANY_PANELS 1
#define MANY_ROWS 64
#define MANY_AHEAD 0
#endif

/* A tile of 1 to MANY_TILE rows by 1 to MANY_PANELS panels. */
static void many_tile(const float *x, int64_t ldx, int64_t rows, int64_t panels,
                      const stored_t *w, const float *bias, float *y, int64_t ldy, int64_t k,
                      int64_t block, const int64_t *lanes) {
    if (panels == MANY_PANELS) {
        switch (rows) {
#define MANY_CASE(R)                                                                        \
            case R:                                                                         \
                tile(x, ldx, R, MANY_PANELS, w, bias, y, ldy, k, block, lanes, 0, 0, 0, 0,  \
                     MANY_AHEAD);                                                           \
                return;
            MANY_CASE(1) MANY_CASE(2) MANY_CASE(3) MANY_CASE(4) MANY_CASE(5)
            default: MANY_CASE(MANY_TILE)
#undef MANY_CASE
        }
    }
    for (int64_t j = 0; j < panels; j += PANELS) {  /* a layer's last, partial group */
        any_tile(x, ldx, rows, panels - j < PANELS ? panels - j : PANELS, w + j * k * 16,
                 bias ? bias + j * 16 : 0, y + j * 16, ldy, k, block, lanes + j, 0, 0, 0, 0);
    }
}

/* many_rows' share `part` of `parts`: whole tiles of rows */
static void many_part(const float *x, int64_t ldx, int64_t rows, const stored_t *w,
                      const float *bias, float *y, int64_t ldy, int64_t n, int64_t k,
                      int64_t block, int64_t part, int64_t parts) {
    const int64_t panels = (n + 15) / 16;
    const int64_t groups = (panels + MANY_PANELS - 1) / MANY_PANELS;
    const int64_t tiles = (rows + MANY_TILE - 1) / MANY_TILE;
    const int64_t begin = tiles * part / parts * MANY_TILE;
    const int64_t last = tiles * (part + 1) / parts * MANY_TILE;  /* past its last tile */
    const int64_t end = last < rows ? last : rows;
    for (int64_t r0 = begin; r0 < end; r0 += MANY_BLOCK) {
        const int64_t r1 = end - r0 < MANY_BLOCK ? end : r0 + MANY_BLOCK;
        for (int64_t g = 0; g < groups; g++) {
            const int64_t p0 = g * MANY_PANELS;
            const int64_t np = panels - p0 < MANY_PANELS ? panels - p0 : MANY_PANELS;
            int64_t lanes[MANY_PANELS];
            for (int64_t j = 0; j < np; j++)
                lanes[j] = n - (p0 + j) * 16 < 16 ? n - (p0 + j) * 16 : 16;
            for (int64_t r = r0; r < r1; r += MANY_TILE)
                many_tile(x + r * ldx, ldx, r1 - r < MANY_TILE ? r1 - r : MANY_TILE, np,
                          w + p0 * k * 16, bias ? bias + p0 * 16 : 0, y + r * ldy + p0 * 16,
                          ldy, k, block, lanes);
        }
    }
}

/* pagedq_gemv's product past CHUNKED_ROWS rows (see above); returns 0 */
static int many_rows(const float *x, int64_t ldx, int64_t rows, const stored_t *w,
                     const float *bias, float *y, int64_t ldy, int64_t n, int64_t k,
                     int64_t block, int64_t threads) {
    if (threads == TEAM_TASKS) {
#pragma omp taskloop num_tasks(TEAM_PARTS)
        for (int64_t part = 0; part < TEAM_PARTS; part++)
            many_part(x, ldx, rows, w, bias, y, ldy, n, k, block, part, TEAM_PARTS);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (int64_t part = 0; part < threads; part++)
            many_part(x, ldx, rows, w, bias, y, ldy, n, k, block, part, threads);
    }
    return 0;
}
#endif
