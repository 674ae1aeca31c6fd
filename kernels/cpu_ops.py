"""The CPU fast path: a paged decode attention compiled by numba, the other ops from
``kernels.reference``.

The reference decode gathers each sequence's blocks into a padded copy and then runs SDPA over
it: three passes over the KV bytes per layer and step, plus the padding. This kernel reads K and
V once, straight from the pool, one (sequence, KV head) per task, so ragged rows cost only their
own length. Only float32 caches take it (numba has no bfloat16); others use the reference.
"""

import numba
import numpy as np
import torch

from kernels import reference
from kernels.reference import (  # noqa: F401  (re-exported: the dispatch looks names up here)
    copy_blocks,
    paged_attention_prefill,
    rms_norm,
    rotary,
    store_kvcache,
)


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
            context_lens: np.ndarray, scale: float, out: np.ndarray) -> None:  # pragma: no cover
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    for task in numba.prange(batch * num_kv_heads):
        b, h = task // num_kv_heads, task % num_kv_heads
        length = context_lens[b]
        qs = q[b, h * group:(h + 1) * group].astype(np.float32) * np.float32(scale)
        scores = np.empty((group, length), np.float32)
        for t in range(length):
            k = k_cache[block_tables[b, t // block_size], t % block_size, h]
            for g in range(group):
                s = np.float32(0.0)
                for d in range(head_dim):
                    s += qs[g, d] * k[d]
                scores[g, t] = s
        for g in range(group):
            scores[g] = np.exp(scores[g] - scores[g].max())
        acc = np.zeros((group, head_dim), np.float32)
        for t in range(length):
            v = v_cache[block_tables[b, t // block_size], t % block_size, h]
            for g in range(group):
                p = scores[g, t]
                for d in range(head_dim):
                    acc[g, d] += p * v[d]
        for g in range(group):
            out[b, h * group + g] = acc[g] / scores[g].sum()


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """``kernels.reference.paged_attention_decode``'s contract, computed in one pass."""
    if k_cache.dtype != torch.float32 or q.shape[0] == 0:
        return reference.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens,
                                                scale)
    threads = torch.get_num_threads()  # numba's pool follows torch's setting
    if numba.get_num_threads() != threads:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    out = torch.empty(q.shape, dtype=torch.float32)
    _decode(q.contiguous().numpy(), k_cache.numpy(), v_cache.numpy(),
            block_tables.numpy(), context_lens.numpy(), scale, out.numpy())
    return out.to(q.dtype)
