/* cpu_gemv.c's product for batches of 9 to CHUNKED_ROWS rows (AVX-512, float32 or widened
 * bfloat16 panels): included there, after `tile`'s helpers. */
#if !PAIRED && defined(__AVX512F__)
/* Batches of 9 to CHUNKED_ROWS rows take the group's weights GEMV_CHUNK inputs at a time
 * across all its row tiles (up to BLOCK_TILES tiles, 64 rows, a pass), each tile's sums kept
 * in memory between chunks, so the chunk is read from the memory once and again from L1 (a
 * group's 2 panels, 72 KB at 576 inputs, fill more than L1: each further tile read them from
 * L2), while the next group's lines are asked into L2, a share in each tile. The sums run in
 * the same order (a block's FMA chain continued from its stored sum), so the bits are those of
 * `tile`. SmolLM2's 121 layers, cold, 2 threads, a Xeon (Emerald Rapids): 16 rows 31.1 -> 27.2
 * ms, 32 rows 42.4 -> 36.9, 64 rows 75.4 -> 67.9, 128 rows 132 -> 129; 256 rows 256 -> 273,
 * where the products are bound by the FMAs and the stored sums only cost; chunks of 16 / 48 /
 * 64 / 128 inputs no better than 32. A 32-request batch of SmolLM2 (128 + 128 tokens): 12.9 ->
 * 11.6 s.
 *
 * AVX-512 without BF16 (Skylake-SP, Cascade Lake; Ice Lake too, unmeasured) takes 64 inputs a
 * chunk and asks for no lines ahead: there the asks slowed the products and the hardware's
 * prefetch serves alone. A Cascade Lake (family 6 model 85), 2 threads, cold, time against
 * oneDNN's packed product in the same run (random-26m's 32 layers / SmolLM2's 120): 64 rows
 * 1.45 / 1.14 -> 1.00-1.04 / 1.02-1.05, 128 rows 1.48 / 1.60 -> 1.05-1.07 / 0.89-1.03 (asks
 * dropped alone: 64 rows 1.00-1.18 / 1.02-1.14, 128 rows 1.19-1.49 / 1.16-1.19). In the engine,
 * random-26m's decode steps of 64 rows (64 requests, 96 tokens each) took 0.89x main's time, of
 * 128 rows 0.90x (medians of 8 and 6 alternating processes, this change ahead in 13 of the 14). */
#ifdef __AVX512BF16__
#define GEMV_CHUNK 32
#define CHUNK_ASKS 1
#else
#define GEMV_CHUNK 64
#define CHUNK_ASKS 0
#endif
#define BLOCK_TILES 8
/* Past CHUNKED_ROWS rows, cpu_gemv_many.h's 6 x 4 tiles. On Intel with AVX-512 BF16, where
 * those tiles ask for their weights ahead (MANY_AHEAD), from 65 rows: a Xeon with AMX (family
 * 6 model 167), 2 threads, the native decode step alternating between two builds step by step
 * (ABBA) over `throughput.py`'s workloads, steps of 65-128 rows took 0.973-0.980x the time
 * (random-26m, four calls; medians of the pairs' ratios) and 0.967x (SmolLM2, one call); from
 * 33 rows, steps of 33-64 rows 1.028-1.031x, and from 17, the batched call's 32-row steps
 * 1.16-1.17x. Elsewhere from 129 rows, as measured before those asks. */
#if defined(PAGEDQ_INTEL) && defined(__AVX512BF16__)
#define CHUNKED_ROWS 64
#else
#define CHUNKED_ROWS 128
#endif

/* Inputs [k0, k1) (within one block) of a tile of `rows` rows and `panels` panels; per row and
 * panel, state holds the block's sum so far and the total of the blocks before. Step i asks for
 * the lines pf + i * 64 and pf2 + i * 64 (i below pf_lines, pf2_lines) into L2. */
static inline __attribute__((always_inline)) void chunk_tile(
        const float *x, int64_t ldx, const int rows, const int panels, const stored_t *w,
        int64_t k, int64_t k0, int64_t k1, int64_t block, __m512 *state, const char *pf,
        int64_t pf_lines, const char *pf2, int64_t pf2_lines) {
    __m512 part[TILE][PANELS];
    const int fresh = k0 % block == 0, ends = k1 % block == 0 || k1 == k, first = k0 < block;
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < panels; j++)
            part[r][j] = fresh ? _mm512_setzero_ps() : state[(r * PANELS + j) * 2];
    for (int64_t i = k0; i < k1; i++) {
        __m512 wv[PANELS];
        if (i - k0 < pf_lines) _mm_prefetch(pf + (i - k0) * 64, _MM_HINT_T1);
        if (i - k0 < pf2_lines) _mm_prefetch(pf2 + (i - k0) * 64, _MM_HINT_T1);
        for (int j = 0; j < panels; j++) wv[j] = load16_w(w + j * k * 16 + i * 16);
        for (int r = 0; r < rows; r++) {
            /* the row's broadcast held in a register (folded, it is a load in each FMA):
             * the figures above were measured so; apart, it was level within the noise */
            __m512 b = _mm512_set1_ps(x[r * ldx + i]);
            __asm__("" : "+v"(b));
            for (int j = 0; j < panels; j++) part[r][j] = _mm512_fmadd_ps(b, wv[j], part[r][j]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < panels; j++) {
            __m512 *sum = state + (r * PANELS + j) * 2;
            if (!ends) sum[0] = part[r][j];
            else sum[1] = first ? part[r][j] : _mm512_add_ps(sum[1], part[r][j]);
        }
}

static void any_chunk_tile(const float *x, int64_t ldx, int64_t rows, int64_t panels,
                           const stored_t *w, int64_t k, int64_t k0, int64_t k1, int64_t block,
                           __m512 *state, const char *pf, int64_t pf_lines, const char *pf2,
                           int64_t pf2_lines) {
#define CHUNK_CASE(R)                                                                       \
    case R:                                                                                 \
        if (panels == PANELS)                                                               \
            chunk_tile(x, ldx, R, PANELS, w, k, k0, k1, block, state, pf, pf_lines, pf2,    \
                       pf2_lines);                                                          \
        else                                                                                \
            chunk_tile(x, ldx, R, 1, w, k, k0, k1, block, state, pf, pf_lines, pf2,         \
                       pf2_lines);                                                          \
        break;
    switch (rows) {
        CHUNK_CASE(1)
        CHUNK_CASE(2)
        CHUNK_CASE(3)
        CHUNK_CASE(4)
        CHUNK_CASE(5)
        CHUNK_CASE(6)
        CHUNK_CASE(7)
        default: CHUNK_CASE(TILE)
    }
#undef CHUNK_CASE
}

/* chunked's group g of PANELS panels */
static void chunked_group(const float *x, int64_t ldx, int64_t rows, const stored_t *w,
                          const float *bias, float *y, int64_t ldy, int64_t n, int64_t k,
                          int64_t block, int64_t g) {
    const int64_t panels = (n + 15) / 16, groups = (panels + PANELS - 1) / PANELS;
    const int64_t step = 16 * (int64_t)sizeof(stored_t);
    __m512 state[BLOCK_TILES * TILE * PANELS * 2];
    const int64_t p0 = g * PANELS, np = panels - p0 < PANELS ? panels - p0 : PANELS;
    const stored_t *wg = w + p0 * k * 16;
    const char *next = (const char *)(w + (p0 + PANELS) * k * 16);
    const int64_t next_panels = g + 1 < groups
        ? (panels - p0 - np < PANELS ? panels - p0 - np : PANELS) : 0;
    for (int64_t rb = 0; rb < rows; rb += BLOCK_TILES * TILE) {
        const int64_t nrb = rows - rb < BLOCK_TILES * TILE ? rows - rb : BLOCK_TILES * TILE;
        const int64_t tiles = (nrb + TILE - 1) / TILE;
        for (int64_t k0 = 0, k1; k0 < k; k0 = k1) {
            k1 = (k0 / block + 1) * block;
            if (k1 > k0 + GEMV_CHUNK) k1 = k0 + GEMV_CHUNK;
            if (k1 > k) k1 = k;
            /* the first row block asks for the next group's lines of this chunk
             * (next_panels runs of c), a share to each tile: [a, a + na) */
            const int64_t c = k1 - k0, lines = CHUNK_ASKS && rb == 0 ? next_panels * c : 0;
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t r0 = rb + t * TILE;
                const int64_t a = lines * t / tiles, na = lines * (t + 1) / tiles - a;
                const int64_t s1 = c ? a / c : 0, o1 = c ? a % c : 0;
                const int64_t n1 = na < c - o1 ? na : c - o1;
                any_chunk_tile(x + r0 * ldx, ldx, rows - r0 < TILE ? rows - r0 : TILE, np,
                               wg, k, k0, k1, block, state + t * TILE * PANELS * 2,
                               next + (s1 * k + k0 + o1) * step, n1 * step / 64,
                               next + ((s1 + 1) * k + k0) * step, (na - n1) * step / 64);
            }
        }
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t r0 = rb + t * TILE, nr = rows - r0 < TILE ? rows - r0 : TILE;
            for (int64_t j = 0; j < np; j++)  /* the totals: every second sum of state */
                store_panel(y + r0 * ldy + (p0 + j) * 16, ldy,
                            state + (t * TILE * PANELS + j) * 2 + 1, PANELS * 2, nr,
                            bias ? bias + (p0 + j) * 16 : 0,
                            n - (p0 + j) * 16 < 16 ? n - (p0 + j) * 16 : 16);
        }
    }
}

/* pagedq_gemv's product for TILE < rows <= CHUNKED_ROWS (see above); returns 0 */
static int chunked(const float *x, int64_t ldx, int64_t rows, const stored_t *w,
                   const float *bias, float *y, int64_t ldy, int64_t n, int64_t k,
                   int64_t block, int64_t threads) {
    const int64_t groups = ((n + 15) / 16 + PANELS - 1) / PANELS;
    if (threads == TEAM_TASKS) {
#pragma omp taskloop num_tasks(TEAM_PARTS)
        for (int64_t g = 0; g < groups; g++)
            chunked_group(x, ldx, rows, w, bias, y, ldy, n, k, block, g);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t g = 0; g < groups; g++)
            chunked_group(x, ldx, rows, w, bias, y, ldy, n, k, block, g);
    }
    return 0;
}
#endif
