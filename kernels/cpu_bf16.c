/* The bfloat16 build of the products, the attention and the decode step: the same sources
 * compiled again with PAGEDQ_BF16 (cpu_kernels.h: bfloat16 weights and KV pools, widened as
 * they load, float32 arithmetic), their functions named with _bf16. One source for both types,
 * so the two cannot drift: a bfloat16 value gives the float32 build's bits for the float it
 * widens to. */
#define PAGEDQ_BF16
#include "cpu_attention.c"
#include "cpu_attention_tasks.c"
#include "cpu_decode.c"
#include "cpu_gemv.c"

/* Whether this build takes bfloat16 pairs (PAIRED: AVX-512 BF16), so that the Python side
 * packs the products' panels to match. */
int pagedq_bf16_paired(void) { return PAIRED; }
