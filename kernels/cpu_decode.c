/* A Llama-family decode step for a batch of sequences in one call, float32 (bfloat16 weights
 * and KV pools in cpu_bf16.c's build, float32 activations either way): every layer's
 * norms, products, rotary, KV store and attention, and the final norm, with no Python between
 * them. Compiled at first use by kernels/cpu_native.py with cpu_rows.c, cpu_gemv.c and the
 * attention's sources; called by engine/cpu_decode.py.
 *
 * Why: at one stream a SmolLM2 step spent ~8 of its 21 ms outside the linear layers, most of
 * it Python and the small ops' calls (15-70 us each, cold: streaming 540 MB of weights evicts
 * the interpreter's working set between them). This is llama.cpp's shape: one native loop.
 *
 * It computes what the model's modules compute, call for call: the same functions of
 * cpu_rows.c, cpu_gemv.c (the probed block of oneDNN's many-row sums) and the attention's
 * pagedq_decode_attention (cpu_attention_tasks.c), so a row's bits are those of any batch the
 * modules run; the tests check that. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

/* dims: the model's shape, in this order (kernels/cpu_decode.py writes it) */
enum { LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, BLOCK_SIZE, QKV_BLOCK, O_BLOCK,
       GATE_UP_BLOCK, DOWN_BLOCK, NUM_DIMS };
/* a layer's tensors, in this order; QKV_BIAS may be NULL */
enum { INPUT_NORM, QKV, QKV_BIAS, O_PROJ, POST_NORM, GATE_UP, DOWN, K_CACHE, V_CACHE,
       NUM_TENSORS };

/* The threads of a split step (pagedq_decode): how many have finished their shares, and how
 * many kernels the others have run since as tasks that those threads could take. */
struct team {
    int idle;
    int64_t helped;
};

/* The `threads` a product or attention of a share runs on: its own, or, once a thread of the
 * split step is idle, TEAM_TASKS (counted in team->helped); `team` NULL where unsplit. */
static int64_t on(struct team *team, int64_t threads) {
    if (!team || !__atomic_load_n(&team->idle, __ATOMIC_RELAXED)) return threads;
    __atomic_fetch_add(&team->helped, 1, __ATOMIC_RELAXED);
    return TEAM_TASKS;
}

/* Every layer and the final norm for `rows` rows on `threads` threads (see pagedq_decode). The
 * row ops take the threads too: cpu_rows.c splits their rows only past PARALLEL_FROM floats,
 * with a row's bits the same on any thread. At 128 rows of SmolLM2 a layer's norms, rotary and
 * SiLU took ~240 us on one thread and ~100 on two (a Xeon with AMX), ~4 ms of a 170 ms step. */
static int decode_rows(const int64_t *dims, const void *const *layers, const float *final_norm,
                       const float *cos, const float *sin, float eps, float scale, float *x,
                       int64_t rows, const int64_t *positions, const int64_t *slots,
                       const int32_t *tables, int64_t table_stride, const int32_t *context_lens,
                       int64_t threads, struct team *team) {
    const int64_t hidden = dims[HIDDEN], heads = dims[HEADS], kv_heads = dims[KV_HEADS];
    const int64_t head_dim = dims[HEAD_DIM], inter = dims[INTERMEDIATE];
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    float *buffer = malloc(sizeof(float) * (size_t)(rows * (2 * hidden + qkv_size + 2 * q_size +
                                                            kv_size + 3 * inter)));
    if (!buffer) return -1;
    float *residual = buffer, *normed = residual + rows * hidden, *qkv = normed + rows * hidden;
    float *q = qkv + rows * qkv_size, *k = q + rows * q_size, *attn = k + rows * kv_size;
    float *gate_up = attn + rows * q_size, *act = gate_up + rows * 2 * inter;
    for (int64_t l = 0; l < dims[LAYERS]; l++) {
        const void *const *t = layers + l * NUM_TENSORS;
        /* layer 0 norms the embeddings, which are the residual; later layers add the last
         * MLP's output to the residual first, as RMSNorm(x, residual) does */
        if (l == 0) {
            pagedq_rms_norm(x, 0, t[INPUT_NORM], eps, normed, 0, rows, hidden, threads);
            memcpy(residual, x, sizeof(float) * (size_t)(rows * hidden));
        } else {
            pagedq_rms_norm(x, residual, t[INPUT_NORM], eps, normed, residual, rows, hidden,
                            threads);
        }
        if (NAME(pagedq_gemv)(normed, hidden, rows, t[QKV], t[QKV_BIAS], qkv, qkv_size,
                              qkv_size, hidden, dims[QKV_BLOCK], on(team, threads)) != 0)
            goto fail;
        pagedq_rotary(qkv, qkv_size, qkv + q_size, qkv_size, cos, sin, positions, q, k, rows,
                      heads, kv_heads, head_dim, threads);
        NAME(pagedq_store_kv)(k, kv_size, qkv + q_size + kv_size, qkv_size, (stored_t *)t[K_CACHE],
                              (stored_t *)t[V_CACHE], slots, rows, kv_size);
        if (NAME(pagedq_decode_attention)(q, q_size, t[K_CACHE], t[V_CACHE], tables,
                                          table_stride, context_lens, rows, scale, attn, heads,
                                          kv_heads, head_dim, dims[BLOCK_SIZE],
                                          on(team, threads)) != 0 ||
            NAME(pagedq_gemv)(attn, q_size, rows, t[O_PROJ], 0, x, hidden, hidden, q_size,
                              dims[O_BLOCK], on(team, threads)) != 0)
            goto fail;
        pagedq_rms_norm(x, residual, t[POST_NORM], eps, normed, residual, rows, hidden, threads);
        if (NAME(pagedq_gemv)(normed, hidden, rows, t[GATE_UP], 0, gate_up, 2 * inter, 2 * inter,
                              hidden, dims[GATE_UP_BLOCK], on(team, threads)) != 0)
            goto fail;
        pagedq_silu_and_mul(gate_up, act, rows, inter, threads);
        if (NAME(pagedq_gemv)(act, inter, rows, t[DOWN], 0, x, hidden, hidden, inter,
                              dims[DOWN_BLOCK], on(team, threads)) != 0)
            goto fail;
    }
    pagedq_rms_norm(x, residual, final_norm, eps, x, residual, rows, hidden, threads);
    free(buffer);
    return 0;
fail:
    free(buffer);
    return -1;
}

/* Where to cut `rows` into `threads` shares of about equal work (cuts[0] = 0 ... cuts[threads]
 * = rows): a row costs its products (2 FLOPs a weight at ~100 GFLOP/s a core) and its
 * attention (K and V of each of its keys at ~25 GB/s a core), in nanoseconds a layer. */
static void cut_rows(const int64_t *dims, const int32_t *context_lens, int64_t rows,
                     int64_t threads, int64_t *cuts) {
    const int64_t hidden = dims[HIDDEN], q_size = dims[HEADS] * dims[HEAD_DIM];
    const int64_t kv_size = dims[KV_HEADS] * dims[HEAD_DIM];
    const double weights = (double)hidden * (double)(2 * q_size + 2 * kv_size) +
                           3.0 * (double)hidden * (double)dims[INTERMEDIATE];
    const double row_cost = weights * 2 / 100.0, key_cost = (double)kv_size * 8 / 25.0;
    double total = 0, done = 0;
    for (int64_t r = 0; r < rows; r++) total += row_cost + key_cost * context_lens[r];
    int64_t r = 0;
    cuts[0] = 0;
    for (int64_t share = 1; share < threads; share++) {
        /* at least a row a share: rows >= threads where this is called */
        while (r < rows - (threads - share) &&
               (r < cuts[share - 1] + 1 ||
                done + 0.5 * (row_cost + key_cost * context_lens[r]) < total * share / threads))
            done += row_cost + key_cost * context_lens[r++];
        cuts[share] = r;
    }
    cuts[threads] = rows;
}

/* Whether a share of `share` rows would take another of cpu_gemv's paths than the batch of
 * `rows` in some product (the bfloat16 build's AMX tiles past AMX_ROWS rows against its pairs
 * up to them: their sums differ). */
static int leaves_path(const int64_t *dims, int64_t rows, int64_t share) {
    const int64_t inputs[3] = {dims[HIDDEN], dims[HEADS] * dims[HEAD_DIM], dims[INTERMEDIATE]};
    for (int i = 0; i < 3; i++)
        if (NAME(pagedq_gemv_tiles)(share, inputs[i]) != NAME(pagedq_gemv_tiles)(rows, inputs[i]))
            return 1;
    return 0;
}

/* x [rows][hidden]: the tokens' embeddings in, the final norm's output out. positions and
 * slots [rows]; tables [rows][table_stride] block ids; context_lens [rows] (this token
 * included). From split_rows rows a thread on (0: never), each thread runs the whole step on
 * its own share of the rows, alone, with no barrier between the threads, until one finishes:
 * from then on the other shares' products and attention run as tasks (TEAM_TASKS) that the
 * finished thread takes in the loop's barrier. Below split_rows, or where a share would take
 * another product path than the batch (leaves_path), every product and attention is split
 * between the threads. Returns the shares the rows ran in (1, or threads where split: what the
 * tests observe), *helped the kernels run as tasks, or -1 where scratch memory could not be
 * had (x is then undefined).
 *
 * Why split the rows: with every kernel split, both cores stream the attention's keys at once
 * and then both compute the products, so the memory idles while the FMAs work and the two
 * threads share its bandwidth when they read. A thread alone keeps most of it on an AMD EPYC
 * (a 1 GiB sum: 25.3 GB/s on one core of a Zen 4, 31.8 on two), so threads that run apart
 * overlap one's keys with the other's products; each reads the weights itself, the second
 * mostly from the shared L3. Zen 4, 2 threads, float32, a step's median: SmolLM2 at 32 rows
 * of ~192 keys 49.8 -> 47.2 ms, 64 rows of ~340 keys 121.5 -> 110.3, 128 rows 242.1 -> 231.6;
 * random-26m at 128 rows of ~340 keys 66.9 -> 63.8; but 16 rows 24.3 -> 27.6 and 8 rows 19.0
 * -> 22.0 (the weights, read by each thread, are then what bounds the step: hence a floor of
 * rows a thread, though only 2 threads were measured). A Xeon (session 29; one core reads far
 * less of the machine's bandwidth there) lost at 16 and 32 rows and drew level at 64:
 * engine/cpu_decode.py asks for the split on AMD's cores only.
 *
 * Why the tasks: the cut (cut_rows) evens the shares' costs, not the cores' speeds, and a VM's
 * two cores drift apart in runs of tens of steps: timed per share on an AMD EPYC Zen 3,
 * SmolLM2's 32-row steps left the faster thread waiting 4-9 % of the thread-seconds, and cuts
 * made by the last steps' measured speeds only cut that to 6.4 % (session 63). With the tasks,
 * the split steps of six 32-request calls (128 + 128 tokens), steps alternating with and
 * without within each call, two processes: 0.91-0.96x the time (median 0.92). Row ops stay
 * with the share's thread (a few per cent of a step). Each kernel's parts carry the bits of
 * the whole: a task computes whole groups of outputs, or whole chunks of keys. */
int NAME(pagedq_decode)(const int64_t *dims, const void *const *layers,
                        const float *final_norm, const float *cos, const float *sin, float eps,
                        float scale, float *x, int64_t rows, const int64_t *positions,
                        const int64_t *slots, const int32_t *tables, int64_t table_stride,
                        const int32_t *context_lens, int64_t threads, int64_t split_rows,
                        int64_t *helped) {
    int64_t *cuts = 0;
    *helped = 0;
    if (threads >= 2 && split_rows > 0 && rows >= split_rows * threads) {
        cuts = malloc(sizeof(int64_t) * (size_t)(threads + 1));
        if (!cuts) return -1;
        cut_rows(dims, context_lens, rows, threads, cuts);
        int declined = 0;
        for (int64_t share = 0; share < threads; share++)
            declined |= leaves_path(dims, rows, cuts[share + 1] - cuts[share]);
        if (declined) {
            free(cuts);
            cuts = 0;
        }
    }
    if (!cuts)
        return decode_rows(dims, layers, final_norm, cos, sin, eps, scale, x, rows, positions,
                           slots, tables, table_stride, context_lens, threads, 0) == 0 ? 1 : -1;
    int failed = 0;
    struct team team = {0, 0};
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t share = 0; share < threads; share++) {
        const int64_t r0 = cuts[share];
        if (decode_rows(dims, layers, final_norm, cos, sin, eps, scale, x + r0 * dims[HIDDEN],
                        cuts[share + 1] - r0, positions + r0, slots + r0,
                        tables + r0 * table_stride, table_stride, context_lens + r0, 1,
                        &team) != 0) {
#pragma omp atomic write
            failed = 1;
        }
        /* on to the loop's barrier, where the thread runs the tasks of the shares still on */
        __atomic_fetch_add(&team.idle, 1, __ATOMIC_RELAXED);
    }
    free(cuts);
    *helped = team.helped;
    return failed ? -1 : (int)threads;
}
