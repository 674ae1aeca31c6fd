"""A Triton GEMM on weight-only quantized weights (W4A16 and W8A16) for CUDA: ``x @ w.T`` with
``w`` dequantized tile by tile in registers, never whole in memory.

The weight comes in ``kernels.quant_reference``'s canonical form (codes ``[N, K]``, ``scales``
and ``zeros`` ``[N, G]``, ``g_idx`` ``[K]``) and is packed once by ``pack``: 4-bit codes two to a
byte along K (``[N, ceil(K / 2)]`` uint8: a quarter of the bf16 weight's bytes, plus the group
scales), 8-bit codes one to a byte. Each K tile looks its columns' groups up in ``g_idx``, so
GPTQ's activation order needs no permutation of ``x``. Products accumulate in float32 and are
rounded to ``x``'s dtype once, at the end.

Checked against the reference under ``TRITON_INTERPRET=1`` on the CPU (small shapes); no GPU
was lent to the session that wrote it, so its CUDA speed is unmeasured.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass
class PackedInt:
    codes: torch.Tensor  # [N, ceil(K / 2)] (4-bit) or [N, K] (8-bit) uint8
    scales: torch.Tensor  # [N, G] float32
    zeros: torch.Tensor  # [N, G] float32, in the codes' unsigned domain
    g_idx: torch.Tensor  # [K] int32
    bits: int
    in_features: int


def pack(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
         bits: int) -> PackedInt:
    """The canonical form (see ``kernels.quant_reference``) in this kernel's layout."""
    if bits not in (4, 8):
        raise ValueError(f"the Triton kernel takes 4- or 8-bit weights, not {bits}-bit")
    n, k = qweight.shape
    codes = qweight.to(torch.uint8)
    if bits == 4:
        codes = torch.nn.functional.pad(codes, (0, k % 2))
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)  # low nibble: the even column
    return PackedInt(codes.contiguous(), scales.float().contiguous(),
                     zeros.float().contiguous(), g_idx.to(torch.int32).contiguous(), bits, k)


@triton.jit
def _int_gemm(x_ptr, codes_ptr, scales_ptr, zeros_ptr, g_idx_ptr, bias_ptr, out_ptr,
              M, N, K, G, stride_xm, stride_cn, stride_om,
              BITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        wk_ok = k_ok[:, None] & n_ok[None, :]
        if BITS == 4:
            byte = tl.load(codes_ptr + offs_n[None, :] * stride_cn + (offs_k // 2)[:, None],
                           mask=wk_ok, other=0).to(tl.int32)
            q = (byte >> ((offs_k % 2) * 4)[:, None]) & 0xF
        else:
            q = tl.load(codes_ptr + offs_n[None, :] * stride_cn + offs_k[:, None],
                        mask=wk_ok, other=0).to(tl.int32)
        g = tl.load(g_idx_ptr + offs_k, mask=k_ok, other=0)
        at = offs_n[None, :] * G + g[:, None]
        scale = tl.load(scales_ptr + at, mask=wk_ok, other=0.0)
        zero = tl.load(zeros_ptr + at, mask=wk_ok, other=0.0)
        w = (q.to(tl.float32) - zero) * scale  # [BLOCK_K, BLOCK_N]; 0 outside the weight
        acc += tl.dot(x, w, allow_tf32=False)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def int_linear(x: torch.Tensor, w: PackedInt, bias: torch.Tensor | None) -> torch.Tensor:
    """``kernels.quant_reference.int_linear``'s contract on a ``pack``ed weight."""
    lead, k = x.shape[:-1], x.shape[-1]
    if k != w.in_features:
        raise ValueError(f"x has {k} features, the weight {w.in_features}")
    x2 = x.reshape(-1, k).contiguous()
    m, n = x2.shape[0], w.scales.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    _int_gemm[grid](x2, w.codes, w.scales, w.zeros, w.g_idx, out if bias is None else bias, out,
                    m, n, k, w.scales.shape[1], x2.stride(0), w.codes.stride(0), out.stride(0),
                    BITS=w.bits, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=64,
                    BLOCK_K=32)
    return out.reshape(*lead, n)
