"""The CPU fast path: the paged attention (decode and prefill over one per-token body) and the
KV store, the row-wise ops of ``kernels.cpu_rows``; the other ops from ``kernels.reference``.

The reference decode gathers each sequence's blocks into a padded copy and then runs SDPA over
it: three passes over the KV bytes per layer and step, plus the padding. These read K and V
once, straight from the pool, so ragged rows cost only their own length. The per-token body
is C (``kernels.cpu_native``: AVX2 / AVX-512 intrinsics, built at first use; its parallel loops
on torch's OpenMP threads) where it builds, else numba's ``_attend`` (a token per task); the
prefill runs the same body as the decode (see ``paged_attention_prefill`` for why). float32
tensors take these kernels; bfloat16 pools only the C ones (numba has no bfloat16), their
queries and outputs in float32 (a bfloat16 model's are widened and rounded back); others use
the reference. The store
is one call where the reference takes a mask, its ``.all()`` and two ``index_copy_`` (SmolLM2,
a layer at one token: 29 -> 11 us).
"""

from collections.abc import Callable
from typing import Any

import numba
import numpy as np
import torch

from kernels import cpu_native, reference
from kernels.cpu_rows import argmax, rms_norm, rotary, silu_and_mul  # noqa: F401  (re-exported:
from kernels.numba_common import (  # the dispatch looks names up here)
    JIT,
    SERIAL,
    cpu_float32,
    on_torch_threads,
)
from kernels.reference import copy_blocks  # noqa: F401


@numba.njit(inline="always")
def _attend(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, table: np.ndarray,
            length: int, scale: float, out: np.ndarray) -> None:  # pragma: no cover
    # One query token ``q`` [H, D] over the first ``length`` KV rows of its blocks ``table``,
    # into ``out`` [H, D]. It walks each block's rows (every KV head) in memory order. Plain
    # indexing, no array slices in the loops: slices cost a reference count each, and the
    # head_dim loops vectorize only this way. Decode and prefill both inline this one body, so a
    # token's attention is the same bits whichever step computes it (see ``_prefill``).
    num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = (length + block_size - 1) // block_size
    qs = np.empty((num_heads, head_dim), np.float32)
    for g in range(num_heads):
        for d in range(head_dim):
            qs[g, d] = q[g, d] * scale
    scores = np.empty((num_heads, length), np.float32)
    for i in range(num_blocks):
        blk = table[i]
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
        blk = table[i]
        for j in range(min(block_size, length - i * block_size)):
            for h in range(num_kv_heads):
                for g in range(h * group, (h + 1) * group):
                    p = scores[g, i * block_size + j]
                    for d in range(head_dim):
                        acc[g, d] += p * v_cache[blk, j, h, d]
    for g in range(num_heads):
        for d in range(head_dim):
            out[g, d] = acc[g, d] / denom[g]


@numba.njit(**JIT)
def _decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
            context_lens: np.ndarray, scale: float, out: np.ndarray) -> None:  # pragma: no cover
    for b in numba.prange(q.shape[0]):  # one task per sequence
        _attend(q[b], k_cache, v_cache, block_tables[b], context_lens[b], scale, out[b])


@numba.njit(**JIT)
def _prefill(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
             rows: np.ndarray, scale: float, out: np.ndarray) -> None:  # pragma: no cover
    # ``rows`` [T, 3]: (query row, its sequence, its position), in the order ``_prefill_rows``
    # balances the causal triangle's work over the threads' equal chunks.
    for r in numba.prange(rows.shape[0]):
        row, seq, pos = rows[r, 0], rows[r, 1], rows[r, 2]
        _attend(q[row], k_cache, v_cache, block_tables[seq], pos + 1, scale, out[row])


NATIVE = True  # the C body where it builds (kernels.cpu_native); False: numba's everywhere


def attention_body(head_dim: int) -> str:
    """The per-token body the decode and prefill run: ``"c"`` where it built and head_dim is a
    multiple of its 8 lanes, ``"numba"`` otherwise."""
    native = (NATIVE and head_dim % 8 == 0
              and cpu_native.function("pagedq_decode_attention") is not None)
    return "c" if native else "numba"


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


def _rows(x: torch.Tensor) -> bool:
    """Each token's [heads, dim] contiguous, tokens at any stride."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``kernels.reference.store_kvcache``'s contract in one call: the reference's mask, its
    ``.all()`` and two ``index_copy_`` took 29 us for one token (SmolLM2, a layer), this 5.
    C's copy of a row where it built (cpu_rows.c, the native decode step's): a 2,048-token
    prefill's rows of random-26m, a layer, took numba's loop 0.29 ms and it 0.12, pool pages
    resident. In a run most of a store is the first write of the pool's pages (1.6 ms a
    layer): the pool is left uninitialised (``ModelRunner``), as it is by design."""
    c_store = (cpu_float32(key, value) and k_cache.dtype == v_cache.dtype
               and k_cache.device.type == "cpu")
    native = cpu_native.typed("pagedq_store_kv", k_cache.dtype) if c_store else None
    if (native is not None and _rows(key) and _rows(value) and k_cache.is_contiguous()
            and v_cache.is_contiguous() and slot_mapping.dtype == torch.int64
            and slot_mapping.is_contiguous()):
        native(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
               k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), key.shape[0],
               key.shape[1] * key.shape[2])
    elif cpu_float32(key, value, k_cache, v_cache):
        _store(key.numpy(), value.numpy(), k_cache.numpy(), v_cache.numpy(),
               slot_mapping.numpy())
    else:
        reference.store_kvcache(key, value, k_cache, v_cache, slot_mapping)


def _c_attention(name: str, q: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> Callable[..., Any] | None:
    """The C attention ``name`` built for these pools, or None where numba's body or the
    reference serves them."""
    if (q.device.type != "cpu" or k_cache.dtype != v_cache.dtype
            or attention_body(q.shape[2]) != "c"):
        return None
    return cpu_native.typed(name, k_cache.dtype)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """``kernels.reference.paged_attention_decode``'s contract, computed in one pass."""
    native = _c_attention("pagedq_decode_attention", q, k_cache, v_cache)
    if q.shape[0] == 0 or (native is None and k_cache.dtype != torch.float32):
        return reference.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens,
                                                scale)
    out = torch.empty(q.shape, dtype=torch.float32)
    if native is not None:
        q32, tables = q.float().contiguous(), block_tables.contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        if native(
                q32.data_ptr(), q.shape[1] * q.shape[2], k_cache.data_ptr(), v_cache.data_ptr(),
                tables.data_ptr(), tables.shape[1], lens.data_ptr(), q.shape[0], scale,
                out.data_ptr(), q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1],
                torch.get_num_threads()) != 0:
            raise MemoryError("no scratch memory for the decode attention")
        return out.to(q.dtype)
    on_torch_threads(_decode, q.contiguous().numpy(), k_cache.numpy(), v_cache.numpy(),
                     block_tables.contiguous().numpy(), context_lens.numpy(), scale, out.numpy())
    return out.to(q.dtype)


def _prefill_rows(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor) -> np.ndarray:
    """(query row, sequence, position) per query token, folded longest, shortest, second
    longest, ...: numba splits a prange into equal contiguous chunks, one per thread, and a
    token's work grows with its position."""
    bounds, lens = cu_seqlens_q.numpy().astype(np.int64), context_lens.numpy().astype(np.int64)
    counts = np.diff(bounds)
    seqs = np.repeat(np.arange(len(counts)), counts)
    positions = np.arange(bounds[-1]) - np.repeat(bounds[:-1], counts) + np.repeat(
        lens - counts, counts)
    order = np.argsort(positions, kind="stable")
    folded = np.empty_like(order)
    folded[0::2], folded[1::2] = order[::-1][:(len(order) + 1) // 2], order[:len(order) // 2]
    return np.stack([folded, seqs[folded], positions[folded]], axis=1)


QUERY_TILE = 8  # prefill queries of one sequence that share each key's loads (cpu_attention.c)


def _query_tiles(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor) -> np.ndarray:
    """(first query row, queries, sequence, position of the first) per tile of up to
    ``QUERY_TILE`` consecutive query tokens of a sequence, the most work (queries times keys)
    first, for the C loop's dynamic schedule."""
    bounds, lens = cu_seqlens_q.numpy().astype(np.int64), context_lens.numpy().astype(np.int64)
    tiles = [(row, min(QUERY_TILE, end - row), seq, lens[seq] - (end - row))
             for seq, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
             for row in range(start, end, QUERY_TILE)]
    out = np.array(tiles, dtype=np.int64).reshape(-1, 4)
    return np.ascontiguousarray(out[np.argsort(-out[:, 1] * (out[:, 3] + out[:, 1]),
                                               kind="stable")])


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``kernels.reference.paged_attention_prefill``'s contract, each query token computed by
    the decode kernel's own arithmetic. SDPA's blocked softmax gave a token's logits other last
    bits than the decode steps that first produced it (up to 6e-6 on the test Llama), so a job
    resumed on another worker, or preempted and recomputed, or a prompt chunked another way,
    could sample another token where two were that close (the chaos test caught one: a seeded
    top-p draw, two logits 1.4e-6 apart). With one arithmetic for every token, a resumed stream
    is the uninterrupted one, bit for bit. The C body takes a sequence's tokens
    ``QUERY_TILE`` at a time over shared key loads (random-26m's 128 prompts: 1.31 -> 0.90 s);
    numba's, one token per task."""
    native = _c_attention("pagedq_prefill", q, k_cache, v_cache)
    if q.shape[0] == 0 or (native is None and k_cache.dtype != torch.float32):
        return reference.paged_attention_prefill(q, k_cache, v_cache, cu_seqlens_q,
                                                 block_tables, context_lens, scale)
    out = torch.empty(q.shape, dtype=torch.float32)
    if native is not None:
        q32, tables = q.float().contiguous(), block_tables.contiguous()
        tiles = _query_tiles(cu_seqlens_q, context_lens)
        if native(
                q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                tables.shape[1], tiles.ctypes.data, tiles.shape[0], scale, out.data_ptr(),
                q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1],
                torch.get_num_threads()) != 0:
            raise MemoryError("no scratch memory for the prefill attention")
        return out.to(q.dtype)
    rows = _prefill_rows(cu_seqlens_q, context_lens)
    on_torch_threads(_prefill, q.contiguous().numpy(), k_cache.numpy(), v_cache.numpy(),
                     block_tables.contiguous().numpy(), rows, scale, out.numpy())
    return out.to(q.dtype)
