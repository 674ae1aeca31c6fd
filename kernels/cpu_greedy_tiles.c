/* A greedy step's tokens with the screen inside the bfloat16 copy's product on AMX's tiles
 * (pagedq_gemv_sink_bf16): each tile of sums is screened while it is in L1, and only the few
 * tokens that may beat each row's running best are kept, where cpu_greedy.c's screen reads the
 * logits the product wrote (SmolLM2's 49,152 a row: 25 MB at 128 rows). The tokens, the bound
 * and the float32 logits are cpu_greedy.c's, so are the results: the float32 layer's argmax,
 * bit for bit. Compiled at first use by kernels/cpu_native.py; called by kernels/cpu_greedy.py.
 *
 * Which tokens are kept. Token j needs its float32 logit if a_j + bound_j reaches the best
 * float32 logit found, and that is at least the approximation's highest, h, less its bound,
 * which is below C + |h| 2^-20, C = (|x| p_max + |x - x'| q_max) 1.001 + 1e-30. So j can matter
 * only if a_j + |a_j| 2^-20 + t_j >= h - |h| 2^-20 - C, t_j = (|x| p_j + |x - x'| q_j) 1.001 +
 * 1e-30. The right side increases with h, so a token passed over against the running highest,
 * below h, would have been passed over against h: the screen keeps a_j + |a_j| e + 1.01 t'_j >=
 * m - |m| e - 1.01 C', m the row's highest so far, e = 2^-18, t' and C' with 2e-30 (room for
 * the float arithmetic), and the row's settling takes from those the tokens that pass against
 * h. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_greedy.h"

#ifdef __AVX512F__ /* AMX comes with it; elsewhere pagedq_greedy_tiles declines */
#define SCREEN_E 0x1p-18f

/* a row's screen on one thread: its highest so far and the threshold from it, the tokens
 * kept (at most cap), and whether it met a non-finite value or overflowed */
typedef struct {
    float high, threshold;
    int32_t count, failed;
} screened;

typedef struct {
    int64_t rows, cap;
    const float *nx, *nd; /* each row's |x| and |x - x'| */
    const float *p, *q;   /* each token's terms of the bound */
    float p_max, q_max;
    screened *state;      /* [threads][rows] */
    int32_t *ids;         /* [threads][rows][cap] */
    float *values;
} screen;

/* the threshold of a row whose highest approximation so far is `high` */
static inline float threshold(const screen *c, int64_t row, float high) {
    const float widest = (c->nx[row] * c->p_max + c->nd[row] * c->q_max) * 1.001f + 2e-30f;
    return high - fabsf(high) * SCREEN_E - widest * 1.01f;
}

/* token id's approximation a lifted by its bound (and more), to compare with a threshold */
static inline float lifted(const screen *c, int64_t row, int64_t id, float a) {
    const float own = (c->nx[row] * c->p[id] + c->nd[row] * c->q[id]) * 1.001f + 2e-30f;
    return a + fabsf(a) * SCREEN_E + own * 1.01f;
}

/* Token id (value v) kept for a row: when its list is full, the tokens its threshold now
 * passes over go first; a list still full fails the row */
static void keep(const screen *c, int64_t row, screened *s, int32_t *ids, float *values,
                 int32_t id, float v) {
    if (s->count == c->cap) {
        int32_t n = 0;
        for (int32_t i = 0; i < s->count; i++)
            if (lifted(c, row, ids[i], values[i]) >= s->threshold)
                ids[n] = ids[i], values[n] = values[i], n++;
        s->count = n;
        if (n == c->cap) {
            s->failed = 1;
            return;
        }
    }
    ids[s->count] = id, values[s->count] = v, s->count++;
}

/* the gemv_sink: a block of 32 rows by 32 outputs screened (lifted, 16 lanes at a time) */
static void screen_sums(void *ctx, float (*out)[16][16], int64_t r0, int64_t o0, int64_t rows,
                        int64_t n) {
    const screen *c = ctx;
    const int64_t t = omp_get_thread_num();
    const int64_t lanes0 = n - o0 < 16 ? n - o0 : 16, lanes1 = n - o0 - 16;
    const __mmask16 live[2] = {
        (__mmask16)((1u << lanes0) - 1u),
        lanes1 <= 0 ? 0 : (__mmask16)((1u << (lanes1 < 16 ? lanes1 : 16)) - 1u)};
    const __m512 p[2] = {_mm512_maskz_loadu_ps(live[0], c->p + o0),
                         _mm512_maskz_loadu_ps(live[1], c->p + o0 + 16)};
    const __m512 q[2] = {_mm512_maskz_loadu_ps(live[0], c->q + o0),
                         _mm512_maskz_loadu_ps(live[1], c->q + o0 + 16)};
    const __m512 e = _mm512_set1_ps(SCREEN_E), wide = _mm512_set1_ps(1.001f);
    const __m512 tiny = _mm512_set1_ps(2e-30f), more = _mm512_set1_ps(1.01f);
    for (int64_t i = 0; i < 2; i++)
        for (int64_t r = 0; r < 16 && r0 + 16 * i + r < rows; r++) {
            const int64_t row = r0 + 16 * i + r;
            screened *s = c->state + t * c->rows + row;
            if (s->failed) continue;
            __m512 v[2];
            for (int j = 0; j < 2; j++)
                v[j] = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live[j], out[2 * i + j][r]);
            /* NaN, +-infinity */
            if (_mm512_mask_fpclass_ps_mask(live[0], v[0], 0x99) |
                _mm512_mask_fpclass_ps_mask(live[1], v[1], 0x99)) {
                s->failed = 1;
                continue;
            }
            const float high = _mm512_reduce_max_ps(_mm512_max_ps(v[0], v[1]));
            if (high > s->high) s->high = high, s->threshold = threshold(c, row, high);
            const __m512 nx = _mm512_set1_ps(c->nx[row]), nd = _mm512_set1_ps(c->nd[row]);
            int32_t *ids = c->ids + (t * c->rows + row) * c->cap;
            float *values = c->values + (t * c->rows + row) * c->cap;
            float lane[16];
            for (int j = 0; j < 2; j++) {
                const __m512 own = _mm512_fmadd_ps(_mm512_mul_ps(nx, p[j]), wide,
                                                   _mm512_mul_ps(_mm512_mul_ps(nd, q[j]), wide));
                const __m512 up = _mm512_add_ps(
                    _mm512_fmadd_ps(_mm512_abs_ps(v[j]), e, v[j]),
                    _mm512_mul_ps(_mm512_add_ps(own, tiny), more));
                __mmask16 mask = _mm512_mask_cmp_ps_mask(
                    live[j], up, _mm512_set1_ps(s->threshold), _CMP_GE_OQ);
                if (!mask) continue;
                _mm512_storeu_ps(lane, v[j]);
                for (; mask && !s->failed; mask &= mask - 1) {
                    const int b = __builtin_ctz(mask);
                    keep(c, row, s, ids, values, (int32_t)(o0 + 16 * j + b), lane[b]);
                }
            }
        }
}

/* pagedq_greedy's tokens (see there) from the bfloat16 copy's paired panels on AMX's tiles,
 * screened as they are summed; `cap` tokens kept a row a thread before the row is left to the
 * caller. Returns 0, or -1 where the tiles do not serve these rows or no memory was had
 * (tokens then undefined). */
int pagedq_greedy_tiles(const float *x, int64_t ldx, int64_t rows, const uint16_t *panels,
                        int64_t vocab, const float *w, const int64_t *strides, int64_t k,
                        int64_t block, const float *p, const float *q, float p_max, float q_max,
                        int64_t cap, int64_t max_candidates, int64_t *tokens, int64_t threads) {
    if (!pagedq_gemv_tiles_bf16(rows, k)) return -1;
    float *norms = malloc(sizeof(float) * (size_t)(2 * rows));
    screened *state = malloc(sizeof(screened) * (size_t)(threads * rows));
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(threads * rows * cap));
    float *values = malloc(sizeof(float) * (size_t)(threads * rows * cap));
    int status = -1;
    if (!norms || !state || !ids || !values) goto done;
    float *nx = norms, *nd = norms + rows;
    for (int64_t r = 0; r < rows; r++) nx[r] = norm_up(x + r * ldx, k);
    pagedq_bf16_rounding(x, ldx, rows, k, nd);
    for (int64_t i = 0; i < threads * rows; i++)
        state[i] = (screened){-INFINITY, -INFINITY, 0, 0};
    screen c = {rows, cap, nx, nd, p, q, p_max, q_max, state, ids, values};
    if (pagedq_gemv_sink_bf16(x, ldx, rows, panels, vocab, k, screen_sums, &c, threads) != 0)
        goto done;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        tokens[r] = -1;
        float high = -INFINITY;
        int failed = !isfinite(nx[r]) || !isfinite(nd[r]);
        for (int64_t t = 0; t < threads; t++) {
            const screened *s = state + t * rows + r;
            failed |= s->failed;
            high = s->high > high ? s->high : high;
        }
        if (failed || !isfinite(high)) continue;
        /* the lowest id of the highest approximation (the threads' pairs interleave) */
        const float at = threshold(&c, r, high);
        int64_t best = -1;
        for (int64_t t = 0; t < threads; t++) {
            const int64_t base = (t * rows + r) * cap;
            for (int32_t i = 0; i < state[t * rows + r].count; i++)
                if (values[base + i] == high && (best < 0 || ids[base + i] < best))
                    best = ids[base + i];
        }
        if (best < 0) continue;
        settling s = settle_from(x + r * ldx, w, strides, k, block, p, q, nx[r], nd[r], best);
        for (int64_t t = 0; t < threads && s.seen <= max_candidates && isfinite(s.top); t++) {
            const int64_t base = (t * rows + r) * cap;
            for (int32_t i = 0; i < state[t * rows + r].count; i++) {
                const float a = values[base + i];
                if (lifted(&c, r, ids[base + i], a) >= at)
                    consider(&s, ids[base + i], a, max_candidates);
            }
        }
        tokens[r] = settled(&s, max_candidates);
    }
    status = 0;
done:
    free(norms), free(state), free(ids), free(values);
    return status;
}
#else
int pagedq_greedy_tiles(const float *x, int64_t ldx, int64_t rows, const uint16_t *panels,
                        int64_t vocab, const float *w, const int64_t *strides, int64_t k,
                        int64_t block, const float *p, const float *q, float p_max, float q_max,
                        int64_t cap, int64_t max_candidates, int64_t *tokens, int64_t threads) {
    (void)x, (void)ldx, (void)rows, (void)panels, (void)vocab, (void)w, (void)strides, (void)k;
    (void)block, (void)p, (void)q, (void)p_max, (void)q_max, (void)cap, (void)max_candidates;
    (void)tokens, (void)threads;
    return -1;
}
#endif
