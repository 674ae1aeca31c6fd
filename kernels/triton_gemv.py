"""Few-row products on CUDA: ``x @ W.T (+ bias)`` for a decode step's handful of rows, 16-bit
weights, float32 sums; optionally SwiGLU's activation computed from the gate/up product as the
input is read, so that the MLP's down projection takes the gate/up output itself.

Why: at batch 1 a decode step is a walk through the weights, and cuBLAS's one-row kernels
streamed random-1b's qkv and o_proj (12.6 and 8.4 MB) at 1.8 TB/s of the H200's 4.25 (session
16): the step's kernels took 1.70x the weights' floor on the H100 (session 20). Here each
program reads ``BLOCK_N`` whole weight rows, tile by tile along K, and keeps one partial sum a
lane; a row's programs run side by side along grid axis 0 so that a weight tile read for one
row serves the next from L2. Fusing the activation into the down projection saves a launch and
a round trip of the activation a layer (launches, not bytes, at batch 1).
"""

import torch
import triton
import triton.language as tl

from kernels.triton_rows import swiglu


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, s_x, s_w, s_y, HAS_BIAS: tl.constexpr,
                 SWIGLU: tl.constexpr, LIBDEVICE: tl.constexpr, EVEN: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * s_w
    x_row = x_ptr + row * s_x
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN:  # no masks: the shapes of every model's layers
            w = tl.load(w_rows + offs_k[None, :])
            x = tl.load(x_row + offs_k).to(tl.float32)
            if SWIGLU:  # x is the gate half, the up half K further on
                up = tl.load(x_row + K + offs_k).to(tl.float32)
        else:
            k_mask = offs_k < K
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                        other=0.0)
            x = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            if SWIGLU:
                up = tl.load(x_row + K + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if SWIGLU:  # the bits ``kernels.silu_and_mul`` would have stored
            x = swiglu(x, up, y_ptr.dtype.element_ty, LIBDEVICE).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * s_y + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def launch_shape(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a weight of ``n`` rows of ``k``: tiles of 8 KB (4
    rows of 1,024), enough programs in flight a multiprocessor to cover the memory's latency.
    ``benchmarks/gpu_gemv.py`` sweeps the alternatives on the model's shapes."""
    block_k = min(1024, triton.next_power_of_2(k))
    return max(1, min(16, 4096 // block_k)), block_k, 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         swiglu_input: bool = False,
         shape: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, or ``F.linear(silu_and_mul(x), weight, bias)`` where
    ``swiglu_input``; ``shape`` overrides ``launch_shape``'s pick (the sweep)."""
    n, k = weight.shape
    rows = x.reshape(-1, x.shape[-1])
    assert rows.shape[1] == (2 * k if swiglu_input else k), (tuple(x.shape), (n, k))
    assert rows.stride(-1) == 1 and weight.stride(-1) == 1
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = shape or launch_shape(n, k)
    _gemv_kernel[(rows.shape[0], triton.cdiv(n, block_n))](
        rows, weight, weight if bias is None else bias, out.view(-1, n), n, k, rows.stride(0),
        weight.stride(0), n, HAS_BIAS=bias is not None, SWIGLU=swiglu_input,
        LIBDEVICE=x.is_cuda, EVEN=n % block_n == 0 and k % block_k == 0, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps)
    return out
