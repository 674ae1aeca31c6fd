/* cpu_gemv.c's products past AMX_ROWS rows through AMX's tile unit (the bfloat16 build, paired
 * inputs, where the CPU has AMX): included by cpu_gemv.c after input_t. AMX is 1 where it
 * compiles, else 0. */
#ifndef PAGEDQ_CPU_GEMV_AMX_H
#define PAGEDQ_CPU_GEMV_AMX_H
#if PAIRED && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMX 1
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Past AMX_ROWS rows, where the CPU has AMX: the paired panels are AMX's B tiles as they lie
 * (a step, 64 bytes, is a tile row: 16 outputs' pair of inputs; 16 steps a tile), the paired
 * inputs its A tiles (16 rows by 16 pairs), and a tdpbf16ps adds 16 x 16 x 32 products. Each
 * output's pairs are summed in fp32 by the tile unit in its own order, one row's as any
 * other's, so a row's bits do not depend on the rows beside it past AMX_ROWS (nor below it,
 * on the pairs' path). Why: the pairs' vdpbf16ps took 60.7 ms for 256 rows of random-26m's 32
 * products, oneDNN's AMX kernels 10.3 (a Xeon with AMX, 2 threads, cold weights); the decode
 * step can call this one. */
#define AMX_ROWS 8

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Whether this process may use the tile registers (Linux grants them on request). */
static int amx_ready(void) {
    static int ready = -1;
    if (ready < 0) ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                   18 /* XFEATURE_XTILEDATA */) == 0;
    return ready;
}

/* The product of `rows` (> AMX_ROWS) rows through the tiles, its sums handed to `sink`: `in`
 * the paired inputs, rows padded to 32 with zeros, `steps` a multiple of 16. A thread takes
 * two panels at a time, in one run of the outputs (`dealt` 0) or dealt in turn (1: every
 * thread meets the first outputs first), and runs every row block pair over them: C tiles 0-3
 * (row block i, panel j at 2i + j), A in 4 and 5, B in 6 and 7, so that each tile loaded
 * feeds two products. Dealt, SmolLM2's 120 layers in bfloat16 took 1.05-1.19x the time (2
 * threads, 16-256 rows, a Xeon with AMX); the greedy screen's is dealt, so that each thread's
 * running best starts from the most frequent tokens (cpu_greedy_tiles.c). */
static void amx_pass(const input_t *in, int64_t ldin, int64_t rows, const stored_t *w,
                     int64_t n, int64_t steps, int64_t threads, int dealt, gemv_sink sink,
                     void *ctx) {
    const int64_t panels = (n + 15) / 16, pairs = (panels + 1) / 2, blocks = (rows + 31) / 32;
#pragma omp parallel num_threads(threads)
    {
        tile_config cfg = {0};
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
        _tile_loadconfig(&cfg);
        float out[4][16][16];
        const int64_t team = omp_get_num_threads();
        const int64_t run = dealt ? 1 : (pairs + team - 1) / team;
#pragma omp for schedule(static, run)
        for (int64_t g = 0; g < pairs; g++) {
            const int two = 2 * g + 1 < panels;
            const stored_t *w0 = w + 2 * g * steps * 32, *w1 = w0 + steps * 32;
            for (int64_t b = 0; b < blocks; b++) {
                const input_t *a0 = in + b * 32 * ldin, *a1 = a0 + 16 * ldin;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t s = 0; s < steps; s += 16) {
                    _tile_loadd(4, a0 + s, ldin * 4);
                    _tile_loadd(5, a1 + s, ldin * 4);
                    _tile_loadd(6, w0 + s * 32, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two) {
                        _tile_loadd(7, w1 + s * 32, 64);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, out[0], 64);
                _tile_stored(1, out[1], 64);
                _tile_stored(2, out[2], 64);
                _tile_stored(3, out[3], 64);
                sink(ctx, out, b * 32, 2 * g * 16, rows, n);
            }
        }
        _tile_release();
    }
}

typedef struct {
    const float *bias;
    float *y;
    int64_t ldy;
} amx_store;

/* amx_gemv's sink: the sums plus the bias into y */
static void amx_store_sums(void *ctx, float (*out)[16][16], int64_t r0, int64_t o0, int64_t rows,
                           int64_t n) {
    const amx_store *to = ctx;
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2 && o0 + 16 * j < n; j++) {
            const int64_t o = o0 + 16 * j, lanes = n - o < 16 ? n - o : 16;
            const __mmask16 live = (__mmask16)((1u << lanes) - 1u);
            const __m512 bv = to->bias ? _mm512_maskz_loadu_ps(live, to->bias + o)
                                       : _mm512_setzero_ps();
            const int64_t r1 = r0 + i * 16;
            for (int64_t r = 0; r < 16 && r1 + r < rows; r++)
                _mm512_mask_storeu_ps(to->y + (r1 + r) * to->ldy + o, live,
                                      _mm512_add_ps(_mm512_loadu_ps(out[2 * i + j][r]), bv));
        }
}

/* The pagedq_gemv of `rows` (> AMX_ROWS) rows through the tiles (amx_pass) */
static void amx_gemv(const input_t *in, int64_t ldin, int64_t rows, const stored_t *w,
                     const float *bias, float *y, int64_t ldy, int64_t n, int64_t steps,
                     int64_t threads) {
    amx_store to = {bias, y, ldy};
    amx_pass(in, ldin, rows, w, n, steps, threads, 0, amx_store_sums, &to);
}
#else
#define AMX 0
#endif

#ifdef PAGEDQ_BF16
/* pagedq_gemv's product past AMX_ROWS rows through the tiles, its sums handed to `sink` (on the
 * thread that computed them) rather than stored, the outputs dealt to the threads in turn
 * (amx_pass): returns 0, or -1 where the tiles do not take these rows here (pagedq_gemv_tiles)
 * or the paired inputs' memory could not be had. */
int NAME(pagedq_gemv_sink)(const float *x, int64_t ldx, int64_t rows, const stored_t *w,
                           int64_t n, int64_t k, gemv_sink sink, void *ctx, int64_t threads) {
#if AMX
    const int64_t steps = (k + 1) / 2;
    input_t *in = NAME(pagedq_gemv_tiles)(rows, k)
        ? paired_rows(x, ldx, rows, k, (rows + 31) / 32 * 32) : NULL;
    if (!in) return -1;
    amx_pass(in, steps, rows, w, n, steps, threads, 1, sink, ctx);
    free(in);
    return 0;
#else
    (void)x, (void)ldx, (void)rows, (void)w, (void)n, (void)k, (void)sink, (void)ctx;
    (void)threads;
    return -1;
#endif
}
#endif

#endif
