"""Triton ragged causal prefill over the paged pool, all sequences in one launch.

Programs are (query tile, KV head). Sequence ``s`` owns the tile ids
``cu_seqlens_q[s] // BLOCK_Q + s`` onwards (at least as many as its tiles need), so a program
finds its sequence by binary search on ``cu_seqlens_q`` on the device, with no host sync; the
grid is ``T_q // BLOCK_Q + B`` and spare tiles exit at once. A tile holds ``BLOCK_Q`` query
tokens times the ``GROUP`` query heads of its KV head, so each KV tile is read once per group.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton_attention import (
    _LOG2E,
    _attend_tile,
    _check,
    _dot_config,
    _scales,
    kv_scale_args,
)


class PrefillTiles(NamedTuple):
    """A launch shape: query rows (tokens x group heads) and KV tokens per tile, warps, and
    software-pipeline stages."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def default_tiles(device: torch.device) -> PrefillTiles:
    """Small tiles for the interpreter (speed); on CUDA the shape of the first H100 figures."""
    return PrefillTiles(64, 64, 4, 3) if device.type == "cuda" else PrefillTiles(32, 32, 4, 1)


@triton.jit
def _find_seq(cu_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence ``s`` with ``cu[s] // BLOCK_Q + s <= tile``."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs"])  # a constexpr 1 would break _find_seq's loop types
def _prefill_kernel(q_ptr, k_ptr, v_ptr, cu_ptr, bt_ptr, ctx_ptr, out_ptr, qk_scale, ks_ptr,
                    vs_ptr, num_seqs, s_qt, s_qh, s_kb, s_ks, s_kh, s_bt, s_ot, s_oh,
                    FP8: tl.constexpr, GROUP: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
                    DOT_DTYPE: tl.constexpr, PREC: tl.constexpr):
    tile, kvh = tl.program_id(0), tl.program_id(1)
    seq = _find_seq(cu_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    first = (tile - q_start // BLOCK_Q - seq) * BLOCK_Q  # the tile's first query, in the seq
    if first >= q_len:
        return
    ctx = tl.load(ctx_ptr + seq)
    qk_scale, v_scale = _scales(qk_scale, ks_ptr, vs_ptr, FP8)
    offs_m, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, D_PAD)
    q_idx = first + offs_m // GROUP  # row m: query token m // GROUP, head m % GROUP
    heads = kvh * GROUP + offs_m % GROUP
    row_mask = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    d_mask = offs_d < HEAD_DIM
    mask = row_mask[:, None] & d_mask[None, :]
    rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * s_qt + heads[:, None] * s_qh + offs_d[None, :],
                mask=mask, other=0.0).to(DOT_DTYPE)
    q_pos = ctx - q_len + q_idx  # the cached prefix comes first
    kv_end = tl.minimum(ctx, ctx - q_len + first + BLOCK_Q)  # past the tile's last query
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # KV tiles before the tile's first query position are seen by every row: no causal mask
    full_end = tl.minimum((ctx - q_len + first + 1) // BLOCK_N * BLOCK_N, kv_end)
    for n0 in range(0, full_end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        in_ctx = tok < kv_end
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, bt_ptr + seq * s_bt,
                                     kvh * s_kh, tok, in_ctx, in_ctx[None, :], s_kb, s_ks,
                                     qk_scale, offs_d, d_mask, BLOCK_SIZE, DOT_DTYPE, PREC)
    for n0 in range(full_end, kv_end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        in_ctx = tok < kv_end
        visible = in_ctx[None, :] & (tok[None, :] <= q_pos[:, None])
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, bt_ptr + seq * s_bt,
                                     kvh * s_kh, tok, in_ctx, visible, s_kb, s_ks, qk_scale,
                                     offs_d, d_mask, BLOCK_SIZE, DOT_DTYPE, PREC)
    out = acc * v_scale / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * s_ot + heads[:, None] * s_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, scale: float, *,
                            k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None,
                            out: torch.Tensor | None = None,
                            tiles: PrefillTiles | None = None) -> torch.Tensor:
    """As ``reference.paged_attention_prefill``; ``out`` receives the result, ``tiles`` overrides
    the launch shape (``benchmarks/gpu_profile.py`` sweeps it)."""
    _check(q, k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    tiles = tiles or default_tiles(q.device)
    block_m = max(tiles.block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    num_seqs = context_lens.shape[0]
    dot_dtype, prec = _dot_config(q.dtype, q.device)
    _prefill_kernel[(num_tokens // block_q + num_seqs, num_kv_heads)](
        q, k_cache, v_cache, cu_seqlens_q, block_tables, context_lens, out, scale * _LOG2E,
        num_seqs=num_seqs, s_qt=q.stride(0), s_qh=q.stride(1), s_kb=k_cache.stride(0),
        s_ks=k_cache.stride(1), s_kh=k_cache.stride(2), s_bt=block_tables.stride(0),
        s_ot=out.stride(0), s_oh=out.stride(1), GROUP=group, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=tiles.block_n,
        D_PAD=max(16, triton.next_power_of_2(head_dim)), DOT_DTYPE=dot_dtype, PREC=prec,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **kv_scale_args(q, k_scale, v_scale))
    return out
