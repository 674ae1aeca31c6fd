"""The model's row-wise ops on the Triton backend (re-exported by ``triton_ops``): RMSNorm with
the residual add fused in, rotary for q and k at once, and SwiGLU's activation. Each replaces
several torch launches with one: in a batch-1 decode step these ops are launches, not bytes.
Elementwise math runs in fp32 and is rounded wherever the reference rounds."""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _rms_norm_kernel(x_ptr, res_in_ptr, w_ptr, out_ptr, res_out_ptr, eps, s_x, s_ri, s_o, s_ro,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # the sum is rounded to the activation dtype, as the reference's add
        x += tl.load(res_in_ptr + row * s_ri + offs, mask=mask, other=0.0).to(tl.float32)
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * s_ro + offs, x, mask=mask)
        x = x.to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``reference.rms_norm``, the residual add fused in: one program per row."""
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype),
                      device=x.device)
    if residual is None:  # the kernel reads no residual: any row view fills the slots
        new_res, res_in, res_out = x, rows, rows
    else:
        new_res = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        res_in, res_out = residual.reshape(-1, hidden), new_res.view(-1, hidden)
    assert rows.stride(-1) == 1 and res_in.stride(-1) == 1 and weight.is_contiguous()
    out_rows = out.view(-1, hidden)
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, res_in, weight, out_rows, res_out, eps, rows.stride(0), res_in.stride(0),
        out_rows.stride(0), res_out.stride(0), N=hidden, BLOCK=block,
        HAS_RESIDUAL=residual is not None, num_warps=min(max(block // 256, 1), 8))
    return out, new_res


@triton.jit
def _rotate_heads(src, dst, s_src, s_dst, num_heads, c1, c2, s1, s2, offs_h, offs_d, d_mask,
                  HALF: tl.constexpr):
    """``x * cos + rotate_half(x) * sin`` for one token's heads, each product and the sum
    rounded to the tensor dtype as the reference's ops are."""
    dt = dst.dtype.element_ty
    mask = (offs_h < num_heads)[:, None] & d_mask[None, :]
    at = src + offs_h[:, None] * s_src + offs_d[None, :]
    x1 = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(at + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    to = dst + offs_h[:, None] * s_dst + offs_d[None, :]
    tl.store(to, o1.to(dt), mask=mask)
    tl.store(to + HALF, o2.to(dt), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, pos_ptr, s_qt, s_qh, s_kt,
                   s_kh, s_qot, s_qoh, s_kot, s_koh, s_cos, s_sin, NUM_Q: tl.constexpr,
                   NUM_K: tl.constexpr, HALF: tl.constexpr, H_PAD: tl.constexpr,
                   HALF_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    offs_h, offs_d = tl.arange(0, H_PAD), tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    dt = qo_ptr.dtype.element_ty
    # The reference casts the fp32 tables to the activation dtype first.
    c = cos_ptr + pos * s_cos + offs_d
    s = sin_ptr + pos * s_sin + offs_d
    c1 = tl.load(c, mask=d_mask).to(dt).to(tl.float32)[None, :]
    c2 = tl.load(c + HALF, mask=d_mask).to(dt).to(tl.float32)[None, :]
    s1 = tl.load(s, mask=d_mask).to(dt).to(tl.float32)[None, :]
    s2 = tl.load(s + HALF, mask=d_mask).to(dt).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + t * s_qt, qo_ptr + t * s_qot, s_qh, s_qoh, NUM_Q, c1, c2, s1, s2,
                  offs_h, offs_d, d_mask, HALF)
    _rotate_heads(k_ptr + t * s_kt, ko_ptr + t * s_kot, s_kh, s_koh, NUM_K, c1, c2, s1, s2,
                  offs_h, offs_d, d_mask, HALF)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``reference.rotary``: q and k of a token in one program; new tensors come back."""
    num_tokens, num_q, head_dim = q.shape
    num_k = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1
    assert sin.stride(-1) == 1 and q.dtype == k.dtype
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, q_out, k_out, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), sin.stride(0), NUM_Q=num_q, NUM_K=num_k, HALF=half,
        H_PAD=triton.next_power_of_2(max(num_q, num_k)),
        HALF_PAD=triton.next_power_of_2(half),
        enable_fp_fusion=False)  # an fma would round once where the reference rounds twice
    return q_out, k_out


@triton.jit
def swiglu(gate, up, dtype: tl.constexpr, LIBDEVICE: tl.constexpr):
    """``silu(gate) * up`` of fp32 values, rounded to ``dtype`` where torch's two ops round.
    torch's silu: x / (1 + exp(-x)) with an IEEE division and expf (tl.exp is ex2.approx on a
    GPU, some ulps off; the interpreter has no libdevice but its tl.exp is numpy's)."""
    if LIBDEVICE:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    act = tl.math.div_rn(gate, 1.0 + e).to(dtype)
    return (act.to(tl.float32) * up).to(dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, s_x, s_o, N: tl.constexpr, BLOCK: tl.constexpr,
                         LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * s_x + N + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_o + offs, swiglu(gate, up, out_ptr.dtype.element_ty, LIBDEVICE),
             mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """As ``reference.silu_and_mul``, in one launch where torch takes two (SiLU, then the
    product): in a batch-1 decode step the MLP's elementwise work is launches, not bytes."""
    width = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * width)
    assert rows.stride(-1) == 1
    out = torch.empty(*x.shape[:-1], width, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(width))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(width, block))](
        rows, out, rows.stride(0), width, N=width, BLOCK=block, LIBDEVICE=x.is_cuda)
    return out
