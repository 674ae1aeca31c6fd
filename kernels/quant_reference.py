"""Pure-torch reference ops for quantized linear layers: the ground truth the packed layouts
(``kernels.quant_ops``) are tested against, and the path taken where no packed kernel fits.

Integer weights arrive in one canonical form, whatever the checkpoint format: ``qweight``
``[N, K]`` unsigned codes in ``[0, 2**bits)``, ``scales`` and ``zeros`` ``[N, G]`` (zeros in
the same unsigned domain), and ``g_idx`` ``[K]``, the group of each input column (GPTQ's
activation order permutes it). Weight ``w[n, k] = (qweight[n, k] - zeros[n, g]) * scales[n, g]``
with ``g = g_idx[k]``: GPTQ's, AWQ's and compressed-tensors' dequantization alike.
"""

import torch
import torch.nn.functional as F

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def dequantize_int(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   g_idx: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float ``[N, K]`` weight, computed in float32 (as transformers' dequantizers do)."""
    g = g_idx.long()
    w = (qweight.float() - zeros.float()[:, g]) * scales.float()[:, g]
    return w.to(dtype)


def int_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               g_idx: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, dequantize_int(qweight, scales, zeros, g_idx, x.dtype), bias)


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 codes ``[N, K]`` times their per-channel ``weight_scale`` ``[N]``, in float32."""
    return (weight.float() * weight_scale.float()[:, None]).to(dtype)


def quantize_fp8(x: torch.Tensor,
                 input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[T, K]`` as FP8 codes and their float32 scale: ``input_scale`` (static, one per
    tensor) or one per token from its absolute maximum (dynamic), as vLLM quantizes."""
    if input_scale is None:
        scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    else:
        scale = input_scale.float().reshape(1, 1)
    codes = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def fp8_activation_linear(x: torch.Tensor, weight: torch.Tensor, input_scale: torch.Tensor | None,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` through FP8 (``quantize_fp8`` and back) times a float ``weight``: FP8 W8A8 with the
    weight dequantized beforehand, as compressed-tensors computes it in transformers."""
    codes, scale = quantize_fp8(x, input_scale)
    return F.linear((codes.float() * scale).to(x.dtype), weight.to(x.dtype), bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 FP8: activations quantized as ``quantize_fp8`` does, both operands dequantized,
    the product in float32."""
    out = fp8_activation_linear(x.float(), dequantize_fp8(weight, weight_scale), input_scale,
                                None if bias is None else bias.float())
    return out.to(x.dtype)
