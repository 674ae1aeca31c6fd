"""The CPU's row-wise ops: RMSNorm with its residual add, rotary, SiLU-and-mul.

The row-wise ops are one pass each where torch takes 4-7 (the reference RMSNorm is add, pow,
mean, add, rsqrt, mul, mul; rotary indexes the tables, then mul, neg, cat, mul, add). Rotary
takes ``q`` and ``k`` in one call (SmolLM2, a layer at one token: 29 -> 21 us).

C (``cpu_rows.c``, built by ``kernels.cpu_native``) where it builds: the decode step of
``cpu_decode.c`` calls the same C functions, so a row gets one set of bits from either path.
Else numba's builds below, and torch's SiLU (numba's ``np.exp`` is scalar without Intel's
SVML, 6x slower than torch's vectorised silu at 128 rows).

One serial build each, for every batch: a parallel build for big batches rounds differently
(fastmath lets each build vectorize its reductions its own way), so a row's bits, and then a
seeded sample, would depend on the batch around it; the recovery and chaos tests, which check
streams token for token against a fault-free run, failed that way. (Until session 5 the
parallel builds had in fact run serially: numba's cache keyed both builds alike.)
"""

import numba
import numpy as np
import torch

from kernels import cpu_native, reference
from kernels.numba_common import SERIAL, cpu_float32


@numba.njit(**SERIAL)
def _rms_norm(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float,
              add: bool, out: np.ndarray, res_out: np.ndarray) -> None:  # pragma: no cover
    rows, size = x.shape
    for r in range(rows):
        total = np.float32(0.0)
        for i in range(size):
            v = x[r, i] + residual[r, i] if add else x[r, i]
            res_out[r, i] = v
            total += v * v
        inv = np.float32(1.0) / np.sqrt(total / np.float32(size) + np.float32(eps))
        for i in range(size):
            out[r, i] = weight[i] * (res_out[r, i] * inv)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.reference.rms_norm``'s contract in one pass over each row: the residual add,
    the sum of squares and the scaling."""
    fast = cpu_float32(x, weight, *([] if residual is None else [residual]))
    if not fast or x.dim() != 2 or not weight.is_contiguous():
        return reference.rms_norm(x, weight, eps, residual)
    x = x.contiguous()
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    res_in = residual.contiguous() if residual is not None else x
    native = cpu_native.function("pagedq_rms_norm")
    if native is not None:
        add = residual is not None
        native(x.data_ptr(), res_in.data_ptr() if add else None, weight.data_ptr(), eps,
               out.data_ptr(), res_out.data_ptr() if add else None, x.shape[0], x.shape[1],
               torch.get_num_threads())
        return out, res_out
    _rms_norm(x.numpy(), res_in.numpy(), weight.detach().numpy(), eps, residual is not None,
              out.numpy(), res_out.numpy())
    return out, res_out


@numba.njit(**SERIAL)
def _rotary(q: np.ndarray, k: np.ndarray, cos: np.ndarray, sin: np.ndarray,
            positions: np.ndarray, out_q: np.ndarray,
            out_k: np.ndarray) -> None:  # pragma: no cover
    half = q.shape[2] // 2
    for t in range(q.shape[0]):
        p = positions[t]
        for h in range(q.shape[1]):
            for d in range(half):
                x1, x2 = q[t, h, d], q[t, h, d + half]
                out_q[t, h, d] = x1 * cos[p, d] - x2 * sin[p, d]
                out_q[t, h, d + half] = x2 * cos[p, d + half] + x1 * sin[p, d + half]
        for h in range(k.shape[1]):
            for d in range(half):
                x1, x2 = k[t, h, d], k[t, h, d + half]
                out_k[t, h, d] = x1 * cos[p, d] - x2 * sin[p, d]
                out_k[t, h, d + half] = x2 * cos[p, d + half] + x1 * sin[p, d + half]


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.reference.rotary``'s contract in one pass over ``q`` and ``k``, reading the
    tables at each token's position in place of gathering them first."""
    if not cpu_float32(q, k, cos, sin):
        return reference.rotary(q, k, cos, sin, positions)
    out_q = torch.empty(q.shape, dtype=q.dtype)
    out_k = torch.empty(k.shape, dtype=k.dtype)
    native = cpu_native.function("pagedq_rotary")
    if (native is not None and q.stride()[1:] == (q.shape[2], 1)
            and k.stride()[1:] == (k.shape[2], 1)):  # rows strided, heads contiguous
        where = positions.to(torch.int64).contiguous()  # held until the call returns
        native(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), cos.data_ptr(),
               sin.data_ptr(), where.data_ptr(), out_q.data_ptr(), out_k.data_ptr(),
               q.shape[0], q.shape[1], k.shape[1], q.shape[2], torch.get_num_threads())
        return out_q, out_k
    _rotary(q.numpy(), k.numpy(), cos.numpy(), sin.numpy(), positions.numpy(), out_q.numpy(),
            out_k.numpy())  # strided views of the fused qkv output are read as they are
    return out_q, out_k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``kernels.reference.silu_and_mul``'s contract, ``silu(gate) * up`` on ``x`` [T, 2 * I],
    in C where it builds: one pass, and each element's bits its own at any width and batch
    (the reference's can differ by an ulp between batches, see there)."""
    native = cpu_native.function("pagedq_silu_and_mul")
    if native is None or not cpu_float32(x) or x.dim() != 2:
        return reference.silu_and_mul(x)
    x = x.contiguous()
    out = torch.empty(x.shape[0], x.shape[1] // 2)
    native(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1] // 2, torch.get_num_threads())
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``kernels.reference.argmax``'s contract, in C where it builds (torch's took 1.4 ms on
    SmolLM2's 32 x 49,152 logits, one thread; see cpu_rows.c)."""
    native = cpu_native.function("pagedq_argmax")
    if (native is None or not cpu_float32(logits) or logits.dim() != 2
            or logits.stride(1) != 1 or logits.shape[1] == 0):
        return reference.argmax(logits)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    native(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1],
           out.data_ptr(), torch.get_num_threads())
    return out
