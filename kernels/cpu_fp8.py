"""The CPU fast path for fp8 KV caches: a paged decode attention compiled by numba that reads
the pool's bytes through a 256-entry lookup table per layer, K and V each (numba has no fp8
type). The table holds every byte's value times the layer's scale, so one load dequantizes.

Each KV row (one token, one KV head: ``head_dim`` bytes) is widened once into a small fp32
buffer, and then every query head of its group reads the buffer with vectorised loops: the
table lookups, which do not vectorise, are paid once per row, not once per query head. Only
the rows within a context are read (never an unwritten slot). The other ops are the torch
reference's, which take the scales themselves.
"""

import numba
import numpy as np
import torch

from kernels.reference import (  # noqa: F401  (re-exported: the dispatch looks names up here)
    copy_blocks,
    paged_attention_prefill,
    rms_norm,
    rotary,
    store_kvcache,
)


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True, error_model="numpy")
def _decode_fp8(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, k_lut: np.ndarray,
                v_lut: np.ndarray, block_tables: np.ndarray, context_lens: np.ndarray,
                scale: float, out: np.ndarray) -> None:  # pragma: no cover
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    for b in numba.prange(batch):
        length = context_lens[b]
        row = np.empty(head_dim, np.float32)
        scores = np.empty((num_heads, length), np.float32)
        for t in range(length):  # scores = scale * q . k
            blk, j = block_tables[b, t // block_size], t % block_size
            for h in range(num_kv_heads):
                for d in range(head_dim):
                    row[d] = k_lut[k_cache[blk, j, h, d]]
                for g in range(h * group, (h + 1) * group):
                    s = np.float32(0.0)
                    for d in range(head_dim):
                        s += q[b, g, d] * row[d]
                    scores[g, t] = s * scale
        total = np.zeros(num_heads, np.float32)
        for g in range(num_heads):  # softmax numerators, max subtracted
            top = np.float32(-np.inf)
            for t in range(length):
                top = max(top, scores[g, t])
            for t in range(length):
                scores[g, t] = np.exp(scores[g, t] - top)
                total[g] += scores[g, t]
        acc = np.zeros((num_heads, head_dim), np.float32)
        for t in range(length):  # acc = p @ v
            blk, j = block_tables[b, t // block_size], t % block_size
            for h in range(num_kv_heads):
                for d in range(head_dim):
                    row[d] = v_lut[v_cache[blk, j, h, d]]
                for g in range(h * group, (h + 1) * group):
                    p = scores[g, t]
                    for d in range(head_dim):
                        acc[g, d] += p * row[d]
        for g in range(num_heads):
            for d in range(head_dim):
                out[b, g, d] = acc[g, d] / total[g]


def lookup_table(dtype: torch.dtype, scale: torch.Tensor) -> np.ndarray:
    """The fp32 value of each of the 256 bytes of ``dtype``, times ``scale``. Bytes that are
    NaN or inf are never stored (stores saturate), so their entries never matter."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    return (values * scale.float()).numpy()


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, *, k_scale: torch.Tensor,
                           v_scale: torch.Tensor) -> torch.Tensor:
    """``kernels.reference.paged_attention_decode``'s contract for fp8 caches, in one pass."""
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    threads = torch.get_num_threads()  # numba's pool follows torch's setting
    if numba.get_num_threads() != threads:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    out = torch.empty(q.shape, dtype=torch.float32)
    _decode_fp8(q.float().contiguous().numpy(), k_cache.view(torch.uint8).numpy(),
                v_cache.view(torch.uint8).numpy(), lookup_table(k_cache.dtype, k_scale),
                lookup_table(v_cache.dtype, v_scale), block_tables.numpy(), context_lens.numpy(),
                scale, out.numpy())
    if torch.get_num_threads() != threads:  # numba's first launch resets torch's count
        torch.set_num_threads(threads)
    return out.to(q.dtype)
