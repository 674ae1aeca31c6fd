"""The CPU fast path: a paged decode attention and the KV store compiled by numba, the row-wise
ops of ``kernels.cpu_rows``; the other ops from ``kernels.reference``.

The reference decode gathers each sequence's blocks into a padded copy and then runs SDPA over
it: three passes over the KV bytes per layer and step, plus the padding. This kernel reads K and
V once, straight from the pool, one sequence per task, so ragged rows cost only their own
length. Only float32 tensors take these kernels (numba has no bfloat16); others use the
reference. The store is one call where the reference takes a mask, its ``.all()`` and two
``index_copy_`` (SmolLM2, a layer at one token: 29 -> 11 us).
"""

import numba
import numpy as np
import torch

from kernels import reference
from kernels.cpu_rows import rms_norm, rotary  # noqa: F401  (re-exported:
from kernels.numba_common import (  # the dispatch looks names up here)
    SERIAL,
    cpu_float32,
    numba_follows_torch,
    serial_and_parallel,
)
from kernels.reference import copy_blocks, paged_attention_prefill  # noqa: F401

# A sequence is split into parts of at most this many tokens, computed in parallel and merged.
# The split depends on the sequence's length only, never on the batch around it or the thread
# count: a sequence's attention, and so its tokens, are the same in any batch (splitting only
# batches smaller than the threads made a test's greedy tokens depend on the batch).
_PART_TOKENS = 1024
_NO_PARTS = np.zeros(0, np.int64)


def _decode_rows(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                 block_tables: np.ndarray, context_lens: np.ndarray, scale: float,
                 task_seq: np.ndarray, parts_of: np.ndarray, first_part: np.ndarray,
                 tops: np.ndarray, denoms: np.ndarray, accs: np.ndarray,
                 out: np.ndarray) -> None:  # pragma: no cover
    # One task per part of a sequence's blocks (``_PART_TOKENS``): it walks each block's rows (every
    # KV head) in memory order; a sequence in one part writes ``out``, else each part leaves
    # its softmax max, denominator and unnormalised output in row ``first_part[b] + part`` for
    # ``_merge`` (flash decoding; SmolLM2, one sequence of 2,000 tokens: 270 us a layer in one
    # part on one thread, 160-210 in two on two).
    # Plain indexing, no array slices in the loops: slices cost a reference count each, and
    # the head_dim loops vectorize only this way.
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    for index in numba.prange(tops.shape[0]):
        task = np.int64(index)  # prange's index is unsigned: mixed with int64 it gives floats
        b, part, parts = task, np.int64(0), np.int64(1)  # no parts given: one per sequence
        if task_seq.shape[0]:
            b = task_seq[task]
            part, parts = task - first_part[b], parts_of[b]
        length = context_lens[b]
        num_blocks = (length + block_size - 1) // block_size
        first = part * num_blocks // parts
        last = (part + 1) * num_blocks // parts
        start = first * block_size
        span = min(length, last * block_size) - start
        if span <= 0:
            for g in range(num_heads):
                tops[task, g] = -np.inf
            continue
        qs = np.empty((num_heads, head_dim), np.float32)
        for g in range(num_heads):
            for d in range(head_dim):
                qs[g, d] = q[b, g, d] * scale
        scores = np.empty((num_heads, span), np.float32)
        for i in range(first, last):
            blk = block_tables[b, i]
            for j in range(min(block_size, length - i * block_size)):
                for h in range(num_kv_heads):  # each query head g of KV head h, without g // group
                    for g in range(h * group, (h + 1) * group):
                        s = np.float32(0.0)
                        for d in range(head_dim):
                            s += qs[g, d] * k_cache[blk, j, h, d]
                        scores[g, i * block_size + j - start] = s
        for g in range(num_heads):
            top = scores[g, 0]
            for t in range(span):
                top = max(top, scores[g, t])
            total = np.float32(0.0)
            for t in range(span):
                scores[g, t] = np.exp(scores[g, t] - top)
                total += scores[g, t]
            tops[task, g], denoms[task, g] = top, total
        acc = np.zeros((num_heads, head_dim), np.float32)
        for i in range(first, last):
            blk = block_tables[b, i]
            for j in range(min(block_size, length - i * block_size)):
                for h in range(num_kv_heads):
                    for g in range(h * group, (h + 1) * group):
                        p = scores[g, i * block_size + j - start]
                        for d in range(head_dim):
                            acc[g, d] += p * v_cache[blk, j, h, d]
        for g in range(num_heads):
            for d in range(head_dim):
                if parts == 1:  # the whole sequence: no merge
                    out[b, g, d] = acc[g, d] / denoms[task, g]
                else:
                    accs[task, g, d] = acc[g, d]


@numba.njit(**SERIAL)
def _merge(parts_of: np.ndarray, first_part: np.ndarray, tops: np.ndarray, denoms: np.ndarray,
           accs: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    num_heads, head_dim = accs.shape[1], accs.shape[2]
    for b in range(parts_of.shape[0]):
        if parts_of[b] == 1:
            continue
        lo, hi = first_part[b], first_part[b] + parts_of[b]
        for g in range(num_heads):
            top = -np.inf
            for r in range(lo, hi):
                top = max(top, tops[r, g])
            total = np.float32(0.0)
            for d in range(head_dim):
                out[b, g, d] = 0.0
            for r in range(lo, hi):
                if tops[r, g] == -np.inf:
                    continue
                w = np.exp(tops[r, g] - top)
                total += w * denoms[r, g]
                for d in range(head_dim):
                    out[b, g, d] += w * accs[r, g, d]
            for d in range(head_dim):
                out[b, g, d] /= total


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
    if not cpu_float32(key, value, k_cache, v_cache):
        reference.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
        return
    _store(key.numpy(), value.numpy(), k_cache.numpy(), v_cache.numpy(), slot_mapping.numpy())


_decode = serial_and_parallel(_decode_rows)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """``kernels.reference.paged_attention_decode``'s contract, computed in one pass."""
    if k_cache.dtype != torch.float32 or q.shape[0] == 0:
        return reference.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens,
                                                scale)
    batch, num_heads, head_dim = q.shape
    lens = context_lens.numpy()
    task_seq = parts_of = first_part = _NO_PARTS  # the common case: one part per sequence
    tasks = batch
    if lens.max() > _PART_TOKENS:
        parts_of = np.maximum(1, -(-lens.astype(np.int64) // _PART_TOKENS))
        first_part = np.concatenate(([0], np.cumsum(parts_of)[:-1]))
        task_seq = np.repeat(np.arange(batch), parts_of)
        tasks = len(task_seq)
    tops = np.empty((tasks, num_heads), np.float32)
    denoms = np.empty((tasks, num_heads), np.float32)
    accs = np.empty((tasks if tasks > batch else 0, num_heads, head_dim), np.float32)
    out = torch.empty(q.shape, dtype=torch.float32)
    args = (q.contiguous().numpy(), k_cache.numpy(), v_cache.numpy(), block_tables.numpy(),
            lens, scale, task_seq, parts_of, first_part, tops, denoms, accs, out.numpy())
    if tasks == 1:  # one task: the serial build, without a parallel region's launch
        _decode[0](*args)
    else:
        with numba_follows_torch():
            _decode[1](*args)
    if tasks > batch:
        _merge(parts_of, first_part, tops, denoms, accs, out.numpy())
    return out.to(q.dtype)
