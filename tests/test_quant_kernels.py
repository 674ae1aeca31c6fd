"""Every packed quantized-weight op against its pure-torch reference (kernels.quant_reference):
odd shapes, partial last groups, group runs the kernel must split, g_idx permutations, zero
points; and the unpacking of each checkpoint format's bit layout."""

import pytest
import torch

from engine.quantization.formats import unpack_int32
from kernels import quant_ops, quant_reference


def _int_weight(n: int, k: int, bits: int, group: int, permute: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    size = group if group > 0 else k
    groups = -(-k // size)
    g_idx = torch.arange(k) // size
    if permute:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    qweight = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, groups, generator=gen) * 0.05 + 0.01
    zeros = torch.randint(0, 1 << bits, (n, groups), generator=gen).float()
    return qweight, scales, zeros, g_idx


# (N, K, group, permuted): N not a multiple of 16, a partial last group (K=576, group 128, as
# SmolLM2 with 128-wide groups), channel scales, 256-wide groups, activation order
INT4_CASES = [(33, 64, 32, False), (96, 576, 128, False), (50, 96, -1, False),
              (64, 512, 256, False), (40, 256, 64, True), (17, 128, 32, True),
              (48, 192, 128, False)]


@pytest.mark.parametrize("n,k,group,permute", INT4_CASES)
@pytest.mark.parametrize("tokens", [1, 7])
def test_int4_pack_matches_reference(n: int, k: int, group: int, permute: bool,
                                     tokens: int) -> None:
    qweight, scales, zeros, g_idx = _int_weight(n, k, 4, group, permute)
    packed = quant_ops.pack_int4(qweight, scales, zeros, g_idx, torch.float32)
    assert packed is not None
    x = torch.randn(tokens, k)
    bias = torch.randn(n)
    ref = quant_reference.int_linear(x, qweight, scales, zeros, g_idx, bias)
    out = quant_ops.int4_linear(x, packed, bias)
    assert out.shape == (tokens, n)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_int4_kernel_group_choice() -> None:
    """128-wide groups over 576 columns fit only 64-wide runs; 16-wide groups fit none (those
    weights stay on the dequantizing path)."""
    assert quant_ops.int4_kernel_group(torch.arange(576) // 128, None) == 64
    assert quant_ops.int4_kernel_group(torch.arange(512) // 128, None) == 128
    assert quant_ops.int4_kernel_group(torch.zeros(768, dtype=torch.long), None) == 256
    qweight, scales, zeros, g_idx = _int_weight(32, 64, 4, 16, False)
    assert quant_ops.pack_int4(qweight, scales, zeros, g_idx, torch.float32) is None


@pytest.mark.parametrize("n,k", [(33, 64), (64, 200)])
def test_int8_channel_matches_reference(n: int, k: int) -> None:
    qweight, scales, _, g_idx = _int_weight(n, k, 8, -1, False)
    zeros = torch.full_like(scales, 128.0)  # symmetric
    x = torch.randn(5, k)
    ref = quant_reference.int_linear(x, qweight, scales, zeros, g_idx, None)
    signed = (qweight.to(torch.int16) - 128).to(torch.int8)
    out = quant_ops.int8_channel_linear(x, signed, scales[:, 0], None)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_dequantize_follows_g_idx_and_zeros() -> None:
    """The reference itself on a hand-made 2x4 weight: column k uses group g_idx[k]."""
    qweight = torch.tensor([[0, 1, 2, 3], [15, 14, 13, 12]], dtype=torch.uint8)
    scales = torch.tensor([[1.0, 0.5], [2.0, 0.25]])
    zeros = torch.tensor([[8.0, 0.0], [1.0, 15.0]])
    g_idx = torch.tensor([1, 0, 0, 1])
    expected = torch.tensor([[0 * 0.5, (1 - 8) * 1.0, (2 - 8) * 1.0, 3 * 0.5],
                             [0 * 0.25, 13 * 2.0, 12 * 2.0, -3 * 0.25]])
    torch.testing.assert_close(quant_reference.dequantize_int(qweight, scales, zeros, g_idx),
                               expected)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("n,k", [(48, 64), (30, 100)])
def test_fp8_scaled_mm_matches_reference(n: int, k: int, static: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(n, k, generator=gen) * 50).to(torch.float8_e4m3fn)
    weight_scale = torch.rand(n, generator=gen) * 0.01
    x = torch.randn(6, k, generator=gen) * torch.logspace(-2, 2, 6)[:, None]  # tokens apart
    input_scale = x.abs().max() / 448 if static else None
    bias = torch.randn(n, generator=gen)
    ref = quant_reference.fp8_linear(x, weight, weight_scale, input_scale, bias)
    out = quant_ops.fp8_scaled_mm(x, weight.t(), weight_scale.view(1, -1), input_scale, bias)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_unpack_int32_little_endian() -> None:
    """Code j of a word sits at bits [j * bits, (j + 1) * bits): GPTQ's, AWQ's (before its
    column interleave) and compressed-tensors' pack-quantized layout for 4 and 8 bits."""
    words = torch.tensor([[0x76543210, 0x89ABCDEF - 2**32]], dtype=torch.int32)
    assert unpack_int32(words, 4, 1, 16).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7,
                                                       15, 14, 13, 12, 11, 10, 9, 8]]
    assert unpack_int32(words, 8, 1, 7).tolist() == [[0x10, 0x32, 0x54, 0x76,
                                                      0xEF, 0xCD, 0xAB]]
    assert unpack_int32(words.t(), 4, 0, 10).t().tolist()[0] == list(range(8)) + [15, 14]
