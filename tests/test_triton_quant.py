"""The Triton weight-only GEMM (W4A16, W8A16) against ``kernels.quant_reference.int_linear``:
odd N and K, partial last groups, channel scales, activation-order ``g_idx``, zero points, bias,
one row and several; under the interpreter without a GPU, as ``test_kernels`` sets up."""

import pytest
import torch
from test_kernels import CUDA, DEVICE  # first: it sets up the interpreter without a GPU
from test_quant_kernels import _int_weight

from kernels import quant_reference, triton_quant

# (N, K, group, permuted)
CASES = [(33, 64, 32, False), (50, 96, -1, False), (40, 128, 64, True), (17, 75, 32, True)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_int_gemm_matches_reference(bits: int, case: tuple, rows: int) -> None:
    n, k, group, permute = case
    qweight, scales, zeros, g_idx = _int_weight(n, k, bits, group, permute, seed=rows)
    gen = torch.Generator().manual_seed(k)
    dtype = torch.bfloat16 if CUDA else torch.float32
    # the reference on the activations as the kernel gets them: rounding x to bf16 moved 8-bit
    # outputs (|w| up to ~15) by up to 0.3 on an H200, beyond any tolerance near zero
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if rows % 2 else None
    expected = quant_reference.int_linear(x.float(), qweight, scales, zeros, g_idx,
                                          None if bias is None else bias.float())
    packed = triton_quant.pack(*(t.to(DEVICE) for t in (qweight, scales, zeros, g_idx)), bits)
    out = triton_quant.int_linear(x.to(DEVICE), packed,
                                  None if bias is None else bias.to(DEVICE))
    tol = 1e-2 if CUDA else 1e-4  # bf16's rounding of the output: 2 ** -8 of it at most
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)


def test_pack_refuses_other_widths() -> None:
    qweight, scales, zeros, g_idx = _int_weight(8, 32, 4, 32, False)
    with pytest.raises(ValueError, match="4- or 8-bit"):
        triton_quant.pack(qweight, scales, zeros, g_idx, 3)
