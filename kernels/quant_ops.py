"""Packed layouts for quantized linear layers, each checked against ``kernels.quant_reference``.

- ``Int4Packed``: torch's CPU weight-only int4 kernel (``_weight_int4pack_mm_for_cpu``), for
  4-bit weights whose groups fall on runs of 32/64/128/256 input columns once the columns are
  sorted by group (activation order reorders ``x`` instead of the weight);
- ``int8_channel_linear``: torch's ``_weight_int8pack_mm``, for symmetric 8-bit weights with one
  scale per output channel;
- ``fp8_scaled_mm``: ``torch._scaled_mm`` with per-token FP8 activations and per-channel weight
  scales (W8A8), on CUDA (sm89+) and the CPU alike.
"""

from typing import NamedTuple

import torch

from kernels.quant_reference import quantize_fp8

INT4_KERNEL_GROUPS = (256, 128, 64, 32)  # the group sizes the CPU int4 kernel takes
_N_ALIGN = 16  # the int4 packer wants output features in multiples of 16


class Int4Packed(NamedTuple):
    packed: torch.Tensor  # [N_pad, K / 2] uint8, the kernel's tiled layout
    scale_zeros: torch.Tensor  # [K / group, N_pad, 2]: scale, (8 - zero) * scale
    group: int
    perm: torch.Tensor | None  # input columns in group order; None when already in order
    out_features: int


def int4_kernel_group(g_idx: torch.Tensor, perm: torch.Tensor | None) -> int | None:
    """The largest kernel group size whose every run of columns (in ``perm`` order) lies in one
    checkpoint group; None when none does (e.g. 16-column groups)."""
    ordered = g_idx if perm is None else g_idx[perm]
    for group in INT4_KERNEL_GROUPS:
        if ordered.numel() % group == 0:
            runs = ordered.view(-1, group)
            if bool((runs == runs[:, :1]).all()):
                return group
    return None


def group_order(g_idx: torch.Tensor) -> torch.Tensor | None:
    """The permutation that sorts the input columns by group; None when they are sorted."""
    if bool((g_idx[1:] >= g_idx[:-1]).all()):
        return None
    return torch.argsort(g_idx, stable=True)


def pack_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              g_idx: torch.Tensor, dtype: torch.dtype) -> Int4Packed | None:
    """The CPU int4 layout of a 4-bit weight (canonical form, see ``kernels.quant_reference``),
    or None when its groups fit no kernel group size."""
    perm = group_order(g_idx)
    group = int4_kernel_group(g_idx, perm)
    if group is None:
        return None
    n = qweight.shape[0]
    pad = -n % _N_ALIGN
    q = qweight if perm is None else qweight[:, perm]
    q = torch.nn.functional.pad(q.to(torch.int32), (0, 0, 0, pad))
    g = (g_idx if perm is None else g_idx[perm])[::group].long()  # checkpoint group per run
    scale = torch.nn.functional.pad(scales.float()[:, g], (0, 0, 0, pad))
    zero = torch.nn.functional.pad(zeros.float()[:, g], (0, 0, 0, pad))
    scale_zeros = torch.stack([scale, (8 - zero) * scale], dim=-1).transpose(0, 1)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return Int4Packed(packed, scale_zeros.contiguous().to(dtype), group, perm, n)


def int4_linear(x: torch.Tensor, w: Int4Packed, bias: torch.Tensor | None) -> torch.Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), w.packed, w.group,
                                                     w.scale_zeros)[:, :w.out_features]
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, w.out_features)


def int8_channel_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """``weight`` ``[N, K]`` int8 (signed, zero point 0), ``scales`` ``[N]`` in ``x``'s dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, k).contiguous(), weight, scales)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


def fp8_scaled_mm(x: torch.Tensor, weight_t: torch.Tensor, weight_scale: torch.Tensor,
                  input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """``weight_t`` ``[K, N]`` FP8 (column-major, as ``_scaled_mm`` wants), ``weight_scale``
    ``[1, N]`` float32; activations quantized per token (or by the static ``input_scale``)."""
    lead, k = x.shape[:-1], x.shape[-1]
    codes, scale = quantize_fp8(x.reshape(-1, k), input_scale)
    scale = scale.expand(codes.shape[0], 1).contiguous()
    out = torch._scaled_mm(codes, weight_t, scale_a=scale, scale_b=weight_scale,
                           bias=None if bias is None else bias.to(x.dtype), out_dtype=x.dtype)
    return out.reshape(*lead, weight_t.shape[1])
