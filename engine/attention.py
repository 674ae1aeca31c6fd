"""The paged attention layer: store this step's KV into the pool, then attend over it."""

import torch

import kernels
from engine.context import get_context
from engine.direct_module import DirectModule
from engine.kv_cache import calculate_kv_scales


class PagedAttention(DirectModule):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        # Views into the engine's one KV pool and its fp8 scales, bound by engine.kv_cache.
        self.k_cache = self.v_cache = torch.empty(0)
        self.k_scale = self.v_scale = torch.ones(())
        self.calculate_kv_scales = False  # True until the first prefill sets the fp8 scales
        # fp8 with scales from the first prefill: its mean key, taken from every key stored
        self.k_shift: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``[T, H_q, D]``, ``k``/``v`` ``[T, H_kv, D]`` for the batch's new tokens, the
        single-token (decode) steps first."""
        ctx = get_context()
        num_decode = ctx.num_decode_tokens
        first_prefill = self.calculate_kv_scales and num_decode < q.shape[0]  # never a capture
        if self.k_shift is not None:  # softmax(q.(k - m)) = softmax(q.k): see kv_cache.py
            if first_prefill:
                self.k_shift.copy_(k.float().mean(0))
            k = k - self.k_shift
        if first_prefill:  # K's scale from the keys as stored, centred or not
            calculate_kv_scales(k, v, self.k_scale, self.v_scale)
            self.calculate_kv_scales = False
        kv_scales = self.k_scale, self.v_scale
        kernels.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping, *kv_scales)
        parts = [kernels.paged_attention_decode(q[g.start:g.end], self.k_cache, self.v_cache,
                                                g.block_tables, g.context_lens, self.scale,
                                                *kv_scales)
                 for g in ctx.decode_groups]
        fresh = ctx.prefill_fresh_lens
        if fresh is not None:
            parts.append(kernels.prefill_attention_fresh(
                q[num_decode:], k[num_decode:], v[num_decode:], fresh, self.scale))
        elif num_decode < q.shape[0]:
            cu_seqlens_q, tables, lens = (ctx.prefill_cu_seqlens_q, ctx.prefill_block_tables,
                                          ctx.prefill_context_lens)
            assert cu_seqlens_q is not None and tables is not None and lens is not None
            parts.append(kernels.paged_attention_prefill(
                q[num_decode:], self.k_cache, self.v_cache, cu_seqlens_q, tables, lens,
                self.scale, *kv_scales))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
