/* A greedy step's tokens with the screen inside the bfloat16 copy's product on AMX's tiles
 * (pagedq_gemv_sink_bf16): each tile of sums is screened while it is in L1, and only the few
 * tokens near each row's running best are kept, where cpu_greedy.c's screen reads the logits
 * the product wrote (SmolLM2's 49,152 a row: 25 MB at 128 rows). The tokens, the bound and the
 * float32 logits are cpu_greedy.c's, so are the results: the float32 layer's argmax, bit for
 * bit. Compiled at first use by kernels/cpu_native.py; called by kernels/cpu_greedy.py.
 *
 * Which tokens are kept. A token needs its float32 logit if a + bound(a) reaches the best
 * float32 logit found, and that is at least the approximation's highest, h, less its own bound:
 * with C = (|x| p_max + |x - x'| q_max) 1.001 + 1e-30, a token can matter only if
 * a + |a| 2^-20 >= h - |h| 2^-20 - 2C. Both sides increase with a and h, so a token passed over
 * against the running highest, below h, would have been passed over against h: the screen keeps
 * a + |a| e >= m - |m| e - s, m the row's highest so far, e = 2^-18 and s = 2.02 C (room for
 * the float arithmetic), and the row's settling takes from those the tokens that pass against
 * h. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_greedy.h"

#define SCREEN_E 0x1p-18f

/* a row's screen on one thread: its highest so far and the threshold from it, the tokens
 * kept (at most cap), and whether it met a non-finite value or overflowed */
typedef struct {
    float high, threshold;
    int32_t count, failed;
} screened;

typedef struct {
    int64_t rows, cap;
    const float *slack; /* s of each row */
    screened *state;    /* [threads][rows] */
    int32_t *ids;       /* [threads][rows][cap] */
    float *values;
} screen;

static inline float threshold(float high, float slack) {
    return high - fabsf(high) * SCREEN_E - slack;
}

static inline __mmask16 kept(__m512 v, float at, __mmask16 live) {
    const __m512 lifted = _mm512_fmadd_ps(_mm512_abs_ps(v), _mm512_set1_ps(SCREEN_E), v);
    return _mm512_mask_cmp_ps_mask(live, lifted, _mm512_set1_ps(at), _CMP_GE_OQ);
}

/* Token id (value v) kept for a row: when its list is full, the tokens its threshold now
 * passes over go first; a list still full fails the row */
static void keep(screened *s, int32_t *ids, float *values, int64_t cap, int32_t id, float v) {
    if (s->count == cap) {
        int32_t n = 0;
        for (int32_t i = 0; i < s->count; i++)
            if (values[i] + fabsf(values[i]) * SCREEN_E >= s->threshold)
                ids[n] = ids[i], values[n] = values[i], n++;
        s->count = n;
        if (n == cap) {
            s->failed = 1;
            return;
        }
    }
    ids[s->count] = id, values[s->count] = v, s->count++;
}

/* the gemv_sink: a block of 32 rows by 32 outputs screened */
static void screen_sums(void *ctx, float (*out)[16][16], int64_t r0, int64_t o0, int64_t rows,
                        int64_t n) {
    const screen *c = ctx;
    const int64_t t = omp_get_thread_num();
    const int64_t lanes0 = n - o0 < 16 ? n - o0 : 16, lanes1 = n - o0 - 16;
    const __mmask16 live0 = (__mmask16)((1u << lanes0) - 1u);
    const __mmask16 live1 =
        lanes1 <= 0 ? 0 : (__mmask16)((1u << (lanes1 < 16 ? lanes1 : 16)) - 1u);
    for (int64_t i = 0; i < 2; i++)
        for (int64_t r = 0; r < 16 && r0 + 16 * i + r < rows; r++) {
            const int64_t row = r0 + 16 * i + r;
            screened *s = c->state + t * c->rows + row;
            if (s->failed) continue;
            const __m512 low = _mm512_set1_ps(-INFINITY);
            const __m512 v0 = _mm512_mask_loadu_ps(low, live0, out[2 * i][r]);
            const __m512 v1 = _mm512_mask_loadu_ps(low, live1, out[2 * i + 1][r]);
            /* NaN, +-infinity */
            if (_mm512_mask_fpclass_ps_mask(live0, v0, 0x99) |
                _mm512_mask_fpclass_ps_mask(live1, v1, 0x99)) {
                s->failed = 1;
                continue;
            }
            const float high = _mm512_reduce_max_ps(_mm512_max_ps(v0, v1));
            if (high > s->high) s->high = high, s->threshold = threshold(high, c->slack[row]);
            int32_t *ids = c->ids + (t * c->rows + row) * c->cap;
            float *values = c->values + (t * c->rows + row) * c->cap;
            float lane[16];
            for (int j = 0; j < 2; j++) {
                const __m512 v = j ? v1 : v0;
                __mmask16 mask = kept(v, s->threshold, j ? live1 : live0);
                if (!mask) continue;
                _mm512_storeu_ps(lane, v);
                for (; mask && !s->failed; mask &= mask - 1) {
                    const int b = __builtin_ctz(mask);
                    keep(s, ids, values, c->cap, (int32_t)(o0 + 16 * j + b), lane[b]);
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
    float *norms = malloc(sizeof(float) * (size_t)(3 * rows));
    screened *state = malloc(sizeof(screened) * (size_t)(threads * rows));
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(threads * rows * cap));
    float *values = malloc(sizeof(float) * (size_t)(threads * rows * cap));
    int status = -1;
    if (!norms || !state || !ids || !values) goto done;
    float *nx = norms, *nd = norms + rows, *slack = norms + 2 * rows;
    for (int64_t r = 0; r < rows; r++) {
        nx[r] = norm_up(x + r * ldx, k);
        nd[r] = (float)(bf16_rounding_norm(x + r * ldx, k) * (1.0 + 1e-6));
        slack[r] = 2.02f * ((nx[r] * p_max + nd[r] * q_max) * 1.001f + 1e-30f);
    }
    for (int64_t i = 0; i < threads * rows; i++)
        state[i] = (screened){-INFINITY, -INFINITY, 0, 0};
    screen c = {rows, cap, slack, state, ids, values};
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
        const float at = threshold(high, slack[r]);
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
                if (a + fabsf(a) * SCREEN_E >= at) consider(&s, ids[base + i], a, max_candidates);
            }
        }
        tokens[r] = settled(&s, max_candidates);
    }
    status = 0;
done:
    free(norms), free(state), free(ids), free(values);
    return status;
}
