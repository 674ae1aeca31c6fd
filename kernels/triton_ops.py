"""The Triton backend: every op of ``kernels.reference`` with the same signature and results.

The attention kernels live in ``triton_attention`` (decode) and ``triton_prefill``, the model's
row-wise ops (RMSNorm, rotary, SwiGLU's activation) in ``triton_rows``; this module adds the
cache writes and copy-on-write. Elementwise math runs in fp32 and is
rounded to the tensor dtype wherever the reference rounds, so results match it bit for bit up to
reduction order (and the interpreter, which cannot do bf16 arithmetic, runs them too).
"""

import math

import torch
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels import reference
from kernels.triton_attention import paged_attention_decode
from kernels.triton_prefill import paged_attention_prefill
from kernels.triton_rows import rms_norm, rotary, silu_and_mul

__all__ = ["copy_blocks", "paged_attention_decode", "paged_attention_prefill",
           "prefill_attention_fresh", "rms_norm", "rotary", "silu_and_mul", "store_kvcache"]


@triton.jit
def _fp8_grid(x, MANT: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr):
    """fp32 ``x`` saturated to +-``FMAX`` and rounded to nearest even on the grid of an fp8
    format (``MANT`` mantissa bits, smallest normal exponent ``EMIN``), still as fp32, so that
    the cast to fp8 that follows is exact. Rounding here, on the bits, instead of in the cast:
    Triton's interpreter casts without carrying a round-up into the exponent (127.9 -> 64), and
    the GPU's cast gives the same bytes for values already on the grid."""
    bits = tl.minimum(tl.maximum(x, -FMAX), FMAX).to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23
    # the bits below the grid: the mantissa's last 23 - MANT, one more per binade under EMIN
    drop = 23 - MANT + tl.maximum(EMIN + 127 - exp, 0)
    step = 1 << tl.minimum(drop, 23)
    # the kept value's last bit; at drop 23 that is the implicit leading one
    lsb = tl.where(drop < 23, (mag >> tl.minimum(drop, 22)) & 1, 1)
    rounded = (mag + (step >> 1) - 1 + lsb) & ~(step - 1)  # a carry moves into the exponent
    # drop 24: the grid's first step is twice the value's binade: up unless exactly half
    first = tl.where((mag & 0x7FFFFF) != 0, (exp + 1) << 23, 0)
    mag = tl.where(drop < 24, rounded, tl.where(drop == 24, first, 0))
    return (mag | (bits ^ (bits & 0x7FFFFFFF))).to(tl.float32, bitcast=True)


@triton.jit
def _quantize(x, scale_ptr, FP8: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
              FMAX: tl.constexpr):
    if FP8:
        x = _fp8_grid(x.to(tl.float32) / tl.load(scale_ptr), MANT, EMIN, FMAX)
    return x


@triton.jit
def _store_kernel(key_ptr, value_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, s_kt, s_kh,
                  s_vt, s_vh, s_cb, s_cs, s_ch, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
                  FP8: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
                  FMAX: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)  # int64
    if slot < 0:
        return
    offs_h, offs_d = tl.arange(0, H_PAD), tl.arange(0, D_PAD)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    dst = (slot // BLOCK_SIZE) * s_cb + (slot % BLOCK_SIZE) * s_cs + offs_h[:, None] * s_ch
    k = tl.load(key_ptr + t * s_kt + offs_h[:, None] * s_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + t * s_vt + offs_h[:, None] * s_vh + offs_d[None, :], mask=mask)
    k = _quantize(k, ks_ptr, FP8, MANT, EMIN, FMAX)
    v = _quantize(v, vs_ptr, FP8, MANT, EMIN, FMAX)
    tl.store(kc_ptr + dst + offs_d[None, :], k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst + offs_d[None, :], v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                  k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> None:
    """As ``reference.store_kvcache``: one program per token. ``key``/``value`` may be strided
    views (the engine's come out of one fused qkv matmul) with a unit last stride."""
    num_tokens, num_heads, head_dim = key.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    fp8 = k_scale is not None
    mant, emin, fmax = _fp8_format(k_cache.dtype) if fp8 else (0, 0, 0.0)
    _store_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale if fp8 else key,
        v_scale if fp8 else key, key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        H_PAD=triton.next_power_of_2(num_heads), D_PAD=triton.next_power_of_2(head_dim),
        FP8=fp8, MANT=mant, EMIN=emin, FMAX=fmax)


def _fp8_format(dtype: torch.dtype) -> tuple[int, int, float]:
    """Mantissa bits, smallest normal exponent and largest finite value of an fp8 dtype."""
    info = torch.finfo(dtype)
    return round(-math.log2(info.eps)), round(math.log2(info.tiny)), info.max


@triton.jit
def _copy_kernel(ptr_table, map_ptr, like_ptr, s_blk, block_numel, CHUNK: tl.constexpr):
    """Program (pair, cache, chunk); cache ``c`` starts at address ``ptr_table[c]``."""
    pair, c, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    src = tl.load(map_ptr + 2 * pair)
    dst = tl.load(map_ptr + 2 * pair + 1)
    base = tl.load(ptr_table + c).to(like_ptr.dtype)  # int64 -> pointer
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    tl.store(base + dst * s_blk + offs, tl.load(base + src * s_blk + offs, mask=mask),
             mask=mask)


def copy_blocks(caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """As ``reference.copy_blocks``, in one launch for all caches (alike in dtype and block
    layout, each block contiguous). The pairs are copied in parallel, so no block may be both a
    source and a destination (copy-on-write never asks for that)."""
    if not caches or block_mapping.shape[0] == 0:
        return
    if caches[0].element_size() == 1:  # fp8: moved as bytes
        caches = [cache.view(torch.uint8) for cache in caches]
    first = caches[0]
    block_numel = first[0].numel()
    for cache in caches:
        assert cache.dtype == first.dtype and cache.stride() == first.stride()
        assert cache[0].is_contiguous() and cache.shape == first.shape
    table = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=first.device)
    chunk = min(1024, triton.next_power_of_2(block_numel))
    _copy_kernel[(block_mapping.shape[0], len(caches), triton.cdiv(block_numel, chunk))](
        table, block_mapping.to(torch.int64).contiguous(), first, first.stride(0), block_numel,
        CHUNK=chunk)


def prefill_attention_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            seq_lens: list[int], scale: float) -> torch.Tensor:
    """As the reference's, through cuDNN's fused attention (bfloat16 and float16 only: it has
    no float32 kernel). On an H100 (session 18; 4 prompts of 2,048 tokens, 32 query and 8 KV
    heads of 128, bf16, one dense batch) it ran in 0.27 ms, 72 % of the matmul rate, against
    0.49 ms (41 %) for the paged Triton kernel and 0.48 for FlashAttention-2. torch offers it on
    dense batches of equal lengths only (as jagged nested tensors it fell to 3 TFLOP/s): one
    call a run of equal lengths, each costing the host ~65 us (session 20), so
    ``kernels.fresh_prefill_pays`` keeps it to long prompts."""
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return reference.prefill_attention_fresh(q, k, v, seq_lens, scale)
