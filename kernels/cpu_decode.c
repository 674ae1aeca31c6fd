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

/* x [rows][hidden]: the tokens' embeddings in, the final norm's output out. positions and
 * slots [rows]; tables [rows][table_stride] block ids; context_lens [rows] (this token
 * included). Returns 0, or -1 where scratch memory could not be had (x is then undefined). */
int NAME(pagedq_decode)(const int64_t *dims, const void *const *layers,
                        const float *final_norm, const float *cos, const float *sin, float eps,
                        float scale, float *x, int64_t rows, const int64_t *positions,
                        const int64_t *slots, const int32_t *tables, int64_t table_stride,
                        const int32_t *context_lens, int64_t threads) {
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
            pagedq_rms_norm(x, 0, t[INPUT_NORM], eps, normed, 0, rows, hidden, 1);
            memcpy(residual, x, sizeof(float) * (size_t)(rows * hidden));
        } else {
            pagedq_rms_norm(x, residual, t[INPUT_NORM], eps, normed, residual, rows, hidden, 1);
        }
        if (NAME(pagedq_gemv)(normed, hidden, rows, t[QKV], t[QKV_BIAS], qkv, qkv_size,
                              qkv_size, hidden, dims[QKV_BLOCK], threads) != 0)
            goto fail;
        pagedq_rotary(qkv, qkv_size, qkv + q_size, qkv_size, cos, sin, positions, q, k, rows,
                      heads, kv_heads, head_dim, 1);
        NAME(pagedq_store_kv)(k, kv_size, qkv + q_size + kv_size, qkv_size, (stored_t *)t[K_CACHE],
                              (stored_t *)t[V_CACHE], slots, rows, kv_size);
        if (NAME(pagedq_decode_attention)(q, q_size, t[K_CACHE], t[V_CACHE], tables,
                                          table_stride, context_lens, rows, scale, attn, heads,
                                          kv_heads, head_dim, dims[BLOCK_SIZE], threads) != 0 ||
            NAME(pagedq_gemv)(attn, q_size, rows, t[O_PROJ], 0, x, hidden, hidden, q_size,
                              dims[O_BLOCK], threads) != 0)
            goto fail;
        pagedq_rms_norm(x, residual, t[POST_NORM], eps, normed, residual, rows, hidden, 1);
        if (NAME(pagedq_gemv)(normed, hidden, rows, t[GATE_UP], 0, gate_up, 2 * inter,
                              2 * inter, hidden, dims[GATE_UP_BLOCK], threads) != 0)
            goto fail;
        pagedq_silu_and_mul(gate_up, act, rows, inter, 1);
        if (NAME(pagedq_gemv)(act, inter, rows, t[DOWN], 0, x, hidden, hidden, inter,
                              dims[DOWN_BLOCK], threads) != 0)
            goto fail;
    }
    pagedq_rms_norm(x, residual, final_norm, eps, x, residual, rows, hidden, 1);
    free(buffer);
    return 0;
fail:
    free(buffer);
    return -1;
}
