"""The few-row Triton GEMV (``kernels.triton_gemv``) against ``F.linear`` in float64, and its
fused SwiGLU input against the unfused ops bit for bit; the engine's swap of 16-bit linears.
Under the interpreter without a GPU, as ``test_kernels`` sets up."""

import pytest
import torch
import torch.nn.functional as F
from test_kernels import CUDA, DEVICE  # first: it sets up the interpreter without a GPU
from torch import nn

from engine.cuda_linear import GemvLinear, gemv_linears
from kernels import triton_gemv, triton_rows

DTYPE = torch.bfloat16


def _data(n: int, k: int, rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(DTYPE)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DTYPE)
    b = torch.randn(n, generator=gen).to(DTYPE)
    return x, w, b


# (N, K, launch shape or None): odd shapes take the masked loads, even ones the unmasked
@pytest.mark.parametrize("case", [(48, 64, None), (37, 75, None), (64, 256, (8, 64, 4)),
                                  (50, 200, (4, 64, 2)), (16, 1024, (16, 128, 4))])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(case: tuple, rows: int, bias: bool) -> None:
    n, k, shape = case
    x, w, b = _data(n, k, rows, seed=n + k + rows)
    expected = F.linear(x.double(), w.double(), b.double() if bias else None)
    out = triton_gemv.gemv(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE) if bias else None,
                           shape=shape)
    assert out.dtype == DTYPE and out.shape == (rows, n)
    # float32 sums, then bf16's rounding of the output: 2 ** -8 of it
    torch.testing.assert_close(out.double().cpu(), expected, atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("case", [(32, 128, None), (21, 45, (4, 32, 2))])
def test_swiglu_input_is_silu_and_mul_then_gemv(case: tuple) -> None:
    """The activation computed as the product reads it has the bits ``silu_and_mul`` stores:
    the fused product equals the two ops' exactly."""
    n, k, shape = case
    gate_up, w, _ = _data(n, 2 * k, 2, seed=k)
    gate_up, w = gate_up.to(DEVICE) * 3, w[:, :k].contiguous().to(DEVICE)
    fused = triton_gemv.gemv(gate_up, w, swiglu_input=True, shape=shape)
    two_ops = triton_gemv.gemv(triton_rows.silu_and_mul(gate_up), w, shape=shape)
    assert torch.equal(fused, two_ops)
    expected = F.linear(triton_rows.silu_and_mul(gate_up).double(), w.double())
    torch.testing.assert_close(fused.double(), expected, atol=1e-2, rtol=8e-3)


def test_gemv_linears_swaps_16_bit_linears_keeping_ties() -> None:
    embed = nn.Embedding(40, 16).to(DTYPE)
    model = nn.ModuleDict({"head": nn.Linear(16, 40, bias=False).to(DTYPE),
                           "proj": nn.Linear(16, 24).to(DTYPE),
                           "fp32": nn.Linear(16, 8), "embed": embed})
    model["head"].weight = embed.weight
    gemv_linears(model, max_rows=2)
    head, proj = model["head"], model["proj"]
    assert isinstance(head, GemvLinear) and isinstance(proj, GemvLinear)
    assert type(model["fp32"]) is nn.Linear  # float32 stays with torch's product
    assert head.weight is embed.weight
    x = torch.randn(3, 16).to(DTYPE).to(DEVICE)
    proj = proj.to(DEVICE)
    # 2 rows through the GEMV, 3 through F.linear: both the linear's product
    for rows in (x[:2], x):
        torch.testing.assert_close(proj(rows).double(), F.linear(
            rows.double(), proj.weight.double(), proj.bias.double()), atol=1e-2, rtol=8e-3)
    assert not CUDA or proj(x[:2]).is_cuda
