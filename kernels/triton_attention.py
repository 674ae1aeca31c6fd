"""Triton paged decode (flash-decoding over splits), and the tile step prefill shares with it.

Both read KV through the block table one token at a time (``slot = table[t // bs] * bs + t % bs``),
so the KV tile ``BLOCK_N`` is independent of the cache's block size. Softmax is online, in base 2,
with fp32 accumulation. On the CPU these run under ``TRITON_INTERPRET=1`` with small tiles.

An fp8 cache's tiles are widened to the dot dtype as they are loaded; its scales are applied
once per program, not per element: the K scale joins the softmax scale and the V scale the
final normalisation (``P @ (V * s) = (P @ V) * s``).
"""

import functools

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# A split walks its tiles one after another, each a dependent chain of loads (block table, K,
# V): at batch 1 on an H200, splits of 256 tokens (4 tiles) took 7.7 us a layer for a 530-token
# context whose KV is 0.25 us of bandwidth. So split down to one tile while programs under-fill
# the GPU; the reduce is one more launch whatever the split count.
_MIN_SPLIT_TOKENS = 64
_MAX_SPLITS = 32


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _dot_config(dtype: torch.dtype, device: torch.device) -> tuple[tl.dtype, str]:
    """The dtype the kernels feed ``tl.dot`` and its fp32 precision. The interpreter computes
    bf16 arithmetic on the raw bits, so there bf16 tiles are widened to fp32 (exact products)."""
    if dtype == torch.float16:
        return tl.float16, "tf32"
    if dtype == torch.bfloat16 and device.type == "cuda":
        return tl.bfloat16, "tf32"
    return tl.float32, "ieee"  # fp32 callers want fp32 results, not tf32's 10-bit mantissa


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.stride() == v_cache.stride() and k_cache.shape == v_cache.shape
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert q.shape[1] % k_cache.shape[2] == 0, "query heads must be a multiple of KV heads"


def kv_scale_args(q: torch.Tensor, k_scale: torch.Tensor | None,
                  v_scale: torch.Tensor | None) -> dict:
    """The kernels' scale arguments: an fp8 cache's scale tensors, else any pointer, unread."""
    fp8 = k_scale is not None
    return {"ks_ptr": k_scale if fp8 else q, "vs_ptr": v_scale if fp8 else q, "FP8": fp8}


@triton.jit
def _scales(qk_scale, ks_ptr, vs_ptr, FP8: tl.constexpr):
    """The score scale (softmax's times K's) and the output scale (V's)."""
    if FP8:
        return qk_scale * tl.load(ks_ptr), tl.load(vs_ptr)
    return qk_scale, 1.0


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, bt_row, kvh_off, tok, in_ctx, visible, s_kb,
                 s_ks, qk_scale, offs_d, d_mask, BLOCK_SIZE: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, PREC: tl.constexpr):
    """One online-softmax step over the KV tokens ``tok``: those outside ``in_ctx`` [N] are
    never read (their block-table entry may be padding); ``visible`` [M or 1, N] masks scores."""
    blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
    row = blk * s_kb + (tok % BLOCK_SIZE) * s_ks + kvh_off
    kv_mask = in_ctx[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PREC) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    # Every row sees the first tile's first token, so m_new is finite from then on (no NaN).
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PREC)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, part_acc, part_m, part_l,
                   qk_scale, ks_ptr, vs_ptr, split_len, num_splits, s_qb, s_qh, s_kb, s_ks,
                   s_kh, s_bt, s_ob, s_oh, FP8: tl.constexpr, GROUP: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   G_PAD: tl.constexpr, D_PAD: tl.constexpr, SPLIT: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, PREC: tl.constexpr):
    """Program (sequence, KV head, split): all ``GROUP`` query heads of the KV head at once, so
    each KV tile is read once per group; rows are padded to ``G_PAD`` >= 16 for ``tl.dot``."""
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    qk_scale, v_scale = _scales(qk_scale, ks_ptr, vs_ptr, FP8)
    ctx = tl.load(ctx_ptr + b)
    start = split * split_len
    end = tl.minimum(ctx, start + split_len)
    offs_g, offs_d = tl.arange(0, G_PAD), tl.arange(0, D_PAD)
    heads = kvh * GROUP + offs_g
    g_mask, d_mask = offs_g < GROUP, offs_d < HEAD_DIM
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + heads[:, None] * s_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        in_ctx = tok < end
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, bt_ptr + b * s_bt,
                                     kvh * s_kh, tok, in_ctx, in_ctx[None, :], s_kb, s_ks,
                                     qk_scale, offs_d, d_mask, BLOCK_SIZE, DOT_DTYPE, PREC)
    mask = g_mask[:, None] & d_mask[None, :]
    acc = acc * v_scale
    if SPLIT:  # unnormalised partials [B, H_q, S(, D)]; an empty split leaves m=-inf, l=0
        idx = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split
        tl.store(part_m + idx, m_i, mask=g_mask)
        tl.store(part_l + idx, l_i, mask=g_mask)
        tl.store(part_acc + idx[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask)
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + b.to(tl.int64) * s_ob + heads[:, None] * s_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_reduce_kernel(part_acc, part_m, part_l, out_ptr, num_splits, s_ob, s_oh,
                          HEAD_DIM: tl.constexpr, S_PAD: tl.constexpr, D_PAD: tl.constexpr):
    """Program (sequence, query head): rescales each split's partials to the global max."""
    b, h = tl.program_id(0), tl.program_id(1)
    offs_s, offs_d = tl.arange(0, S_PAD), tl.arange(0, D_PAD)
    s_mask, d_mask = offs_s < num_splits, offs_d < HEAD_DIM
    idx = (b * tl.num_programs(1) + h) * num_splits + offs_s
    m = tl.load(part_m + idx, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_l + idx, mask=s_mask, other=0.0)
    w = tl.exp2(m - tl.max(m, 0))  # split 0 is never empty, so the max is finite
    acc = tl.load(part_acc + idx[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(out_ptr + b.to(tl.int64) * s_ob + h * s_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _choose_splits(programs: int, max_len: int, device: torch.device) -> int:
    """Split the context only while (sequence, KV head) programs under-fill the GPU."""
    if device.type != "cuda":
        return 1
    fill = 2 * _num_sms(device.index or 0) // programs
    return max(1, min(fill, max_len // _MIN_SPLIT_TOKENS, _MAX_SPLITS))


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           *, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, num_splits: int | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """As ``reference.paged_attention_decode``. The split count comes from the block table's
    width (no device sync); ``num_splits`` forces one, ``out`` receives the result."""
    _check(q, k_cache, v_cache)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    block_n = 64 if q.device.type == "cuda" else 32
    max_len = block_tables.shape[1] * block_size
    splits = num_splits or _choose_splits(batch * num_kv_heads, max_len, q.device)
    split_len = triton.cdiv(triton.cdiv(max_len, splits), block_n) * block_n
    splits = triton.cdiv(max_len, split_len)
    part = (batch, num_heads, splits)
    part_acc = q.new_empty(*part, head_dim, dtype=torch.float32) if splits > 1 else out
    part_m = q.new_empty(part, dtype=torch.float32) if splits > 1 else out
    part_l = q.new_empty(part, dtype=torch.float32) if splits > 1 else out
    dot_dtype, prec = _dot_config(q.dtype, q.device)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    _decode_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_m, part_l,
        scale * _LOG2E, split_len=split_len, num_splits=splits, s_qb=q.stride(0),
        s_qh=q.stride(1), s_kb=k_cache.stride(0), s_ks=k_cache.stride(1),
        s_kh=k_cache.stride(2), s_bt=block_tables.stride(0), s_ob=out.stride(0),
        s_oh=out.stride(1), GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, G_PAD=max(16, triton.next_power_of_2(group)), D_PAD=d_pad,
        SPLIT=splits > 1, DOT_DTYPE=dot_dtype, PREC=prec, **kv_scale_args(q, k_scale, v_scale))
    if splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part_acc, part_m, part_l, out, splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, S_PAD=triton.next_power_of_2(splits), D_PAD=d_pad)
    return out
