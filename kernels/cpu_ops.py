"""The CPU fast path: a paged decode attention, the KV store and the row-wise ops (RMSNorm with
its residual add, rotary) compiled by numba; the other ops from ``kernels.reference``.

The reference decode gathers each sequence's blocks into a padded copy and then runs SDPA over
it: three passes over the KV bytes per layer and step, plus the padding. This kernel reads K and
V once, straight from the pool, one sequence per task, so ragged rows cost only their own
length. The row-wise ops are one pass each where torch takes 4-7 (the reference RMSNorm is
add, pow, mean, add, rsqrt, mul, mul; rotary indexes the tables, then mul, neg, cat, mul, add).
Only float32 tensors take these kernels (numba has no bfloat16); others use the reference.
SiLU stays torch's: numba's ``np.exp`` is scalar without Intel's SVML, 6x slower than torch's
vectorised silu at 128 rows. At batch 1 each call's fixed cost is most of it: rows below
``_PARALLEL_GRAIN`` run the serial build without touching the thread counts, and rotary takes
``q`` and ``k`` in one call (SmolLM2, a layer at one token: rotary 29 -> 21 us, RMSNorm 17.7 ->
14.7, the store 29 -> 11).
"""

import numba
import numpy as np
import torch

from kernels import reference
from kernels.numba_common import SERIAL, serial_and_parallel
from kernels.reference import (  # noqa: F401  (re-exported: the dispatch looks names up here)
    copy_blocks,
    paged_attention_prefill,
)

# Row-wise ops below this many elements run on one thread, as torch's elementwise ops do below
# their grain size: waking the second thread cost more than it saved at a decode batch of 128
# (rotary 345 us on two threads against 197 us on one).
_PARALLEL_GRAIN = 1 << 16


def _decode_rows(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
            context_lens: np.ndarray, scale: float, out: np.ndarray) -> None:  # pragma: no cover
    # One task per sequence: it walks each block's rows (every KV head) in memory order.
    # Plain indexing, no array slices in the loops: slices cost a reference count each, and
    # the head_dim loops vectorize only this way.
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    for b in numba.prange(batch):
        length = context_lens[b]
        num_blocks = (length + block_size - 1) // block_size
        qs = np.empty((num_heads, head_dim), np.float32)
        for g in range(num_heads):
            for d in range(head_dim):
                qs[g, d] = q[b, g, d] * scale
        scores = np.empty((num_heads, length), np.float32)
        for i in range(num_blocks):
            blk = block_tables[b, i]
            for j in range(min(block_size, length - i * block_size)):
                for h in range(num_kv_heads):  # each query head g of KV head h, without g // group
                    for g in range(h * group, (h + 1) * group):
                        s = np.float32(0.0)
                        for d in range(head_dim):
                            s += qs[g, d] * k_cache[blk, j, h, d]
                        scores[g, i * block_size + j] = s
        denom = np.zeros(num_heads, np.float32)
        for g in range(num_heads):
            top = scores[g, 0]
            for t in range(length):
                top = max(top, scores[g, t])
            for t in range(length):
                scores[g, t] = np.exp(scores[g, t] - top)
                denom[g] += scores[g, t]
        acc = np.zeros((num_heads, head_dim), np.float32)
        for i in range(num_blocks):
            blk = block_tables[b, i]
            for j in range(min(block_size, length - i * block_size)):
                for h in range(num_kv_heads):
                    for g in range(h * group, (h + 1) * group):
                        p = scores[g, i * block_size + j]
                        for d in range(head_dim):
                            acc[g, d] += p * v_cache[blk, j, h, d]
        for g in range(num_heads):
            for d in range(head_dim):
                out[b, g, d] = acc[g, d] / denom[g]


@numba.njit(**SERIAL)
def _store(key: np.ndarray, value: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
           slots: np.ndarray) -> None:  # pragma: no cover
    block_size = k_cache.shape[1]
    for t in range(key.shape[0]):
        slot = slots[t]
        if slot < 0:
            continue
        blk, row = slot // block_size, slot % block_size
        for h in range(key.shape[1]):
            for d in range(key.shape[2]):
                k_cache[blk, row, h, d] = key[t, h, d]
                v_cache[blk, row, h, d] = value[t, h, d]


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``kernels.reference.store_kvcache``'s contract in one call: the reference's mask, its
    ``.all()`` and two ``index_copy_`` took 29 us for one token (SmolLM2, a layer), this 5."""
    if not _fast(key, value, k_cache, v_cache):
        reference.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
        return
    _store(key.numpy(), value.numpy(), k_cache.numpy(), v_cache.numpy(), slot_mapping.numpy())


_decode = serial_and_parallel(_decode_rows)


def _skinny_rows(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    # Tasks of 8 weight rows; each row is read from memory once and stays in L1 for the
    # (at most a few) rows of x.
    num_out, size = w.shape
    for task in numba.prange((num_out + 7) // 8):
        for n in range(task * 8, min(num_out, task * 8 + 8)):
            for m in range(x.shape[0]):
                s = np.float32(0.0)
                for k in range(size):
                    s += w[n, k] * x[m, k]
                out[m, n] = s


_skinny = serial_and_parallel(_skinny_rows)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``kernels.reference.skinny_linear``'s contract: one pass over the weight rows, split
    over the threads. Measured at one row (2 threads, 30 layers of SmolLM2's weights, so read
    from memory): 13.1-14.4 ms against 17.6-19.0 for oneDNN's product on weights packed for
    batches (24 GB/s), 12.4 against 27.9 at 8 rows: oneDNN wins from 8 rows on. The 113 MB
    lm_head alone: 2.9 ms (40 GB/s) against 4.1."""
    if not _fast(x, weight) or x.dim() != 2:
        return reference.skinny_linear(x, weight)
    x = x.detach().contiguous()  # inference only: no graph through numba
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    threads = _match_torch_threads()
    _skinny[1](x.numpy(), weight.detach().numpy(), out.numpy())
    _restore_torch_threads(threads)
    return out


def _fast(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def _match_torch_threads() -> int:
    threads = torch.get_num_threads()  # numba's pool follows torch's setting
    if numba.get_num_threads() != threads:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    return threads


def _restore_torch_threads(threads: int) -> None:
    if torch.get_num_threads() != threads:
        # numba's first launch starts OpenMP with every core, and torch reads its thread
        # count back from OpenMP: without this, torch.set_num_threads(1) would quietly become
        # "every core" for the rest of the thread.
        torch.set_num_threads(threads)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """``kernels.reference.paged_attention_decode``'s contract, computed in one pass."""
    if k_cache.dtype != torch.float32 or q.shape[0] == 0:
        return reference.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens,
                                                scale)
    out = torch.empty(q.shape, dtype=torch.float32)
    args = (q.contiguous().numpy(), k_cache.numpy(), v_cache.numpy(), block_tables.numpy(),
            context_lens.numpy(), scale, out.numpy())
    if q.shape[0] == 1:  # one task: the serial build, without a parallel region's launch
        _decode[0](*args)
    else:
        threads = _match_torch_threads()
        _decode[1](*args)
        _restore_torch_threads(threads)
    return out.to(q.dtype)


def _rms_norm_rows(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float,
                   add: bool, out: np.ndarray, res_out: np.ndarray) -> None:  # pragma: no cover
    rows, size = x.shape
    for r in numba.prange(rows):
        total = np.float32(0.0)
        for i in range(size):
            v = x[r, i] + residual[r, i] if add else x[r, i]
            res_out[r, i] = v
            total += v * v
        inv = np.float32(1.0) / np.sqrt(total / np.float32(size) + np.float32(eps))
        for i in range(size):
            out[r, i] = weight[i] * (res_out[r, i] * inv)


_rms_norm = serial_and_parallel(_rms_norm_rows)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.reference.rms_norm``'s contract in one pass over each row: the residual add,
    the sum of squares and the scaling."""
    if not _fast(x, weight) or (residual is not None and not _fast(residual)) or x.dim() != 2:
        return reference.rms_norm(x, weight, eps, residual)
    x = x.contiguous()
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    res_in = residual.contiguous() if residual is not None else x
    args = (x.numpy(), res_in.numpy(), weight.detach().numpy(), eps, residual is not None,
            out.numpy(), res_out.numpy())
    if x.numel() < _PARALLEL_GRAIN:
        _rms_norm[0](*args)
    else:
        threads = _match_torch_threads()
        _rms_norm[1](*args)
        _restore_torch_threads(threads)
    return out, res_out


def _rotary_rows(q: np.ndarray, k: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                 positions: np.ndarray, out_q: np.ndarray,
                 out_k: np.ndarray) -> None:  # pragma: no cover
    half = q.shape[2] // 2
    for t in numba.prange(q.shape[0]):
        p = positions[t]
        for h in range(q.shape[1]):
            for d in range(half):
                x1, x2 = q[t, h, d], q[t, h, d + half]
                out_q[t, h, d] = x1 * cos[p, d] - x2 * sin[p, d]
                out_q[t, h, d + half] = x2 * cos[p, d + half] + x1 * sin[p, d + half]
        for h in range(k.shape[1]):
            for d in range(half):
                x1, x2 = k[t, h, d], k[t, h, d + half]
                out_k[t, h, d] = x1 * cos[p, d] - x2 * sin[p, d]
                out_k[t, h, d + half] = x2 * cos[p, d + half] + x1 * sin[p, d + half]


_rotary = serial_and_parallel(_rotary_rows)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.reference.rotary``'s contract in one pass over ``q`` and ``k``, reading the
    tables at each token's position in place of gathering them first."""
    if not _fast(q, k, cos, sin):
        return reference.rotary(q, k, cos, sin, positions)
    out_q = torch.empty(q.shape, dtype=q.dtype)
    out_k = torch.empty(k.shape, dtype=k.dtype)
    args = (q.numpy(), k.numpy(), cos.numpy(), sin.numpy(), positions.numpy(), out_q.numpy(),
            out_k.numpy())  # strided views of the fused qkv output are read as they are
    if q.numel() + k.numel() < _PARALLEL_GRAIN:
        _rotary[0](*args)
    else:
        threads = _match_torch_threads()
        _rotary[1](*args)
        _restore_torch_threads(threads)
    return out_q, out_k
