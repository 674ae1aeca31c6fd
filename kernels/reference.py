"""Pure-torch reference ops for the paged KV cache.

Shapes follow vLLM: caches are ``[num_blocks, block_size, num_kv_heads, head_dim]``, a block
table row lists a sequence's blocks in order, and slot ``s`` is row ``s % block_size`` of block
``s // block_size``. These ops are the ground truth the Triton kernels are tested against, and
the path the engine takes on the CPU.

An fp8 cache (``torch.float8_e4m3fn`` / ``float8_e5m2``) holds ``x / scale`` saturated to the
format's range, so the pool never holds inf or NaN; a read widens the bytes to the query's dtype
and multiplies by the layer's ``k_scale`` / ``v_scale`` (``[]`` fp32 tensors, vLLM's meaning).

The pool is allocated uninitialised: slots past a context (the last block's tail, padding
entries of a block table) may hold any bits, NaN included. Decode masks them out of K and V
themselves (a masked score is dropped, but ``0 * NaN`` in ``P @ V`` is not); prefill slices
them off before attention.
"""

import itertools

import torch
import torch.nn.functional as F


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` as the cache's ``dtype``: for fp8, ``x / scale`` rounded to nearest even and
    saturated to the format's largest finite value (a plain cast gives NaN or inf there)."""
    if scale is None:
        return x.to(dtype)
    top = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-top, top).to(dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache elements as ``dtype``: an fp8 byte's value times ``scale`` (in fp32, rounded
    once)."""
    return x if scale is None else (x.float() * scale).to(dtype)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                  k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> None:
    """Write ``key``/``value`` ``[T, H_kv, D]`` into the slots named by ``slot_mapping`` ``[T]``;
    slot -1 means skip."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    # index_copy_ has no fp8 kernel: fp8 caches are written as their bytes
    flat_k = _bytes(k_cache).view(-1, *k_cache.shape[2:])
    flat_v = _bytes(v_cache).view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, slot_mapping, _bytes(quantize(key, k_cache.dtype, k_scale)))
    flat_v.index_copy_(0, slot_mapping, _bytes(quantize(value, v_cache.dtype, v_scale)))


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.element_size() == 1 else x


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The blocks of ``block_table`` (any leading shape) as one run of slots per row."""
    # index_select is 2-3x faster than advanced indexing with an int32 index on the CPU.
    gathered = cache.index_select(0, block_table.reshape(-1).long())
    return gathered.view(*block_table.shape[:-1], -1, *cache.shape[2:])


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, *, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence, ``q`` ``[B, H_q, D]``, attending to the first
    ``context_lens[b]`` tokens of its paged KV (the query's own key included)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k = _gather(k_cache, block_tables)  # [B, L, H_kv, D]
    valid = torch.arange(k.shape[1], device=q.device)[None, :] < context_lens[:, None]
    keep = valid[:, :, None, None]  # never-written slots may hold NaN
    k = torch.where(keep, dequantize(k, q.dtype, k_scale), 0).transpose(1, 2)  # [B, H_kv, L, D]
    v = torch.where(keep, dequantize(_gather(v_cache, block_tables), q.dtype, v_scale),
                    0).transpose(1, 2)
    # The query heads sharing a KV head act as that head's queries: no KV is repeated.
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=valid[:, None, None, :],
                                         scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, scale: float, *,
                            k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Packed queries ``[T_q, H_q, D]``: sequence ``i`` owns rows ``cu_seqlens_q[i]:[i+1]``,
    which are the last tokens of its first ``context_lens[i]`` tokens (a cached prefix before
    them). Causal within each sequence."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    bounds = cu_seqlens_q.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        start, end = bounds[i], bounds[i + 1]
        num_q = end - start
        blocks = block_tables[i, : (ctx + block_size - 1) // block_size]
        # 4-D [1, H, L, D]: torch's fast CPU attention kernels take only 4-D inputs.
        # only this sequence's blocks are read (and, for fp8, widened)
        k = dequantize(_gather(k_cache, blocks)[:ctx], q.dtype, k_scale).transpose(0, 1)[None]
        v = dequantize(_gather(v_cache, blocks)[:ctx], q.dtype, v_scale).transpose(0, 1)[None]
        mask = None
        if num_q < ctx:  # a cached prefix: query j sits at position ctx - num_q + j
            q_pos = torch.arange(ctx - num_q, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=mask is None,
            scale=scale, enable_gqa=True)[0].transpose(0, 1)
    return out


def prefill_attention_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            seq_lens: list[int], scale: float) -> torch.Tensor:
    """Prompts with nothing cached: ``q`` ``[T, H_q, D]``, ``k``/``v`` ``[T, H_kv, D]`` their
    new rows (strided views allowed), prompt ``i`` the next ``seq_lens[i]`` rows (at least 2:
    cuDNN's route has no kernel for one key), each attending causally to itself alone. What
    ``paged_attention_prefill`` gives for such prompts once their KV is stored (an fp8 pool
    aside: this reads K and V unquantized). Consecutive prompts of one length are one batch:
    their packed rows viewed as ``[B, H, L, D]``, no copies in."""
    parts, start = [], 0
    for length, run in itertools.groupby(seq_lens):
        rows = slice(start, start + len(list(run)) * length)
        qh, kh, vh = (t[rows].unflatten(0, (-1, length)).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                             enable_gqa=True)
        parts.append(out.transpose(1, 2).reshape(-1, *q.shape[1:]))
        start = rows.stop
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def copy_blocks(caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Copy-on-write: for each ``(src, dst)`` row of ``block_mapping``, copy block ``src`` to
    ``dst`` in every cache (each ``[num_blocks, ...]``)."""
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for cache in caches:
        cache = _bytes(cache)  # fp8 has no indexing kernels; the copy is of bytes anyway
        cache[dst] = cache[src]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x + residual`` (when given) over the last dim; returns the normed value and
    the new residual. The arithmetic is transformers' LlamaRMSNorm's."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``q`` ``[T, H_q, D]`` and ``k`` ``[T, H_kv, D]`` at ``positions``
    ``[T]``, with ``cos``/``sin`` tables ``[max_positions, D]``, as transformers' Llama applies
    it (in the activation dtype)."""
    cos = cos[positions].unsqueeze(1).to(q.dtype)
    sin = sin[positions].unsqueeze(1).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation on the fused gate/up output ``[T, 2 * I]``: ``silu(gate) * up``.

    Its bits in any batch: torch's vectorised SiLU and its scalar tail can differ by an ulp,
    and with two threads a work chunk may end mid-row unless ``I`` is a multiple of 32 (width
    1000: 1-3 elements of 3,000 rows differed between batch sizes; 128, 688, 1536: none). So
    a token's bits are batch-independent (exact resumes) for such widths, as every released
    Llama's is, or on one thread."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # in place: one [T, I] buffer fewer per layer


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The greedy tokens of ``logits`` [rows, vocab]: each row's first maximum, its first NaN
    where it has one (int64)."""
    return logits.argmax(dim=-1)
