"""Each format's tensors for one linear layer, read into the canonical form of
``kernels.quant_reference`` (``IntWeight``) or as FP8 codes with per-channel scales
(``Fp8Weight``). Every shape is checked against the model's layer; a missing or misshapen
tensor is an error naming it."""

from dataclasses import dataclass
from typing import cast

import torch

from engine.quantization.config import (
    AWQConfig,
    CompressedTensorsConfig,
    GPTQConfig,
    QuantConfig,
    QuantizationError,
)

_AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of 8 sits in nibble _AWQ_ORDER[j] (AutoAWQ)


@dataclass
class IntWeight:
    qweight: torch.Tensor  # [N, K] uint8 codes
    scales: torch.Tensor  # [N, G] float32
    zeros: torch.Tensor  # [N, G] float32, same domain as the codes
    g_idx: torch.Tensor  # [K] int64
    bits: int


@dataclass
class Fp8Weight:
    weight: torch.Tensor  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor  # [N] float32
    input_scale: torch.Tensor | None  # static activation scale; None: dynamic per token


def _get(checkpoint: dict[str, torch.Tensor], name: str, method: str) -> torch.Tensor:
    if name not in checkpoint:
        raise QuantizationError(f"checkpoint lacks {name} (needed by {method})")
    return checkpoint.pop(name)


def _expect(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise QuantizationError(f"{name}: shape {tuple(tensor.shape)}, expected {shape} for "
                                "this layer")


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, size: int) -> torch.Tensor:
    """Codes packed little-endian ``32 // bits`` to an int32 along ``dim``, cut to ``size``."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32).movedim(dim, -1)
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    codes = codes.reshape(*words.shape[:-1], words.shape[-1] * per)[..., :size]
    return codes.movedim(-1, dim).to(torch.uint8)


def _default_g_idx(k: int, group: int) -> torch.Tensor:
    return torch.arange(k) // (group if group > 0 else k)


def _outputs(name: str, tensor: torch.Tensor, dim: int) -> int:
    """The layer's output features, read off a 2-d tensor (q, k and v differ in size)."""
    if tensor.dim() != 2:
        raise QuantizationError(f"{name}: {tensor.dim()}-d, expected 2-d")
    return tensor.shape[dim]


def _read_gptq(cfg: GPTQConfig, ckpt: dict, prefix: str, k: int) -> IntWeight:
    bits, per = cfg.bits, 32 // cfg.bits
    groups = -(-k // cfg.group_size) if cfg.group_size > 0 else 1
    names = {t: f"{prefix}.{t}" for t in ("qweight", "qzeros", "scales", "g_idx")}
    qweight, qzeros = _get(ckpt, names["qweight"], "gptq"), _get(ckpt, names["qzeros"], "gptq")
    scales = _get(ckpt, names["scales"], "gptq")
    n = _outputs(names["scales"], scales, 1)
    _expect(names["qweight"], qweight, (-(-k // per), n))
    _expect(names["qzeros"], qzeros, (groups, -(-n // per)))
    _expect(names["scales"], scales, (groups, n))
    if names["g_idx"] in ckpt:
        g_idx = ckpt.pop(names["g_idx"]).long()
        _expect(names["g_idx"], g_idx, (k,))
        if g_idx.min() < 0 or g_idx.max() >= groups:
            raise QuantizationError(f"{names['g_idx']}: groups outside [0, {groups})")
    elif cfg.desc_act:
        raise QuantizationError(f"checkpoint lacks {names['g_idx']} (needed by gptq desc_act)")
    else:
        g_idx = _default_g_idx(k, cfg.group_size)
    zeros = unpack_int32(qzeros, bits, 1, n).t().float()
    if cfg.checkpoint_format == "gptq":  # v1 stores zero - 1
        zeros = zeros + 1
    return IntWeight(unpack_int32(qweight, bits, 0, k).t().contiguous(),
                     scales.t().float().contiguous(), zeros.contiguous(), g_idx, bits)


def _read_awq(cfg: AWQConfig, ckpt: dict, prefix: str, k: int) -> IntWeight:
    groups = -(-k // cfg.group_size)
    names = {t: f"{prefix}.{t}" for t in ("qweight", "qzeros", "scales")}
    qweight, qzeros = _get(ckpt, names["qweight"], "awq"), _get(ckpt, names["qzeros"], "awq")
    scales = _get(ckpt, names["scales"], "awq")
    n = _outputs(names["scales"], scales, 1)
    _expect(names["qweight"], qweight, (k, -(-n // 8)))
    _expect(names["qzeros"], qzeros, (groups, -(-n // 8)))
    _expect(names["scales"], scales, (groups, n))
    order = torch.tensor(_AWQ_ORDER)

    def columns(packed: torch.Tensor) -> torch.Tensor:  # AWQ's interleaved nibbles, in order
        codes = unpack_int32(packed, 4, 1, packed.shape[1] * 8)
        return codes.view(packed.shape[0], -1, 8)[..., order].reshape(packed.shape[0], -1)[:, :n]

    return IntWeight(columns(qweight).t().contiguous(), scales.t().float().contiguous(),
                     columns(qzeros).t().float().contiguous(),
                     _default_g_idx(k, cfg.group_size), 4)


def _read_ct(cfg: CompressedTensorsConfig, ckpt: dict, prefix: str,
             k: int) -> IntWeight | Fp8Weight | None:
    scheme = cfg.scheme(prefix)
    if scheme is None:
        return None
    w, method = scheme.weights, "compressed-tensors"
    scale = _get(ckpt, f"{prefix}.weight_scale", method)
    if w.type == "float":
        weight = _get(ckpt, f"{prefix}.weight", method)
        n = _outputs(f"{prefix}.weight", weight, 0)
        _expect(f"{prefix}.weight", weight, (n, k))
        if scale.numel() not in (1, n):
            raise QuantizationError(f"{prefix}.weight_scale: {scale.numel()} scales for {n} "
                                    "output channels (expected 1 or one per channel)")
        if weight.dtype != torch.float8_e4m3fn:
            raise QuantizationError(f"{prefix}.weight: dtype {weight.dtype}, expected "
                                    "float8_e4m3fn")
        act = scheme.input_activations
        static = None if act is None or act.dynamic else _get(ckpt, f"{prefix}.input_scale",
                                                              method)
        return Fp8Weight(weight, scale.float().reshape(-1).expand(n).contiguous(), static)
    # CompressedTensorsConfig.check() refuses "group" without a positive group_size
    groups = -(-k // cast(int, w.group_size)) if w.strategy == "group" else 1
    n = _outputs(f"{prefix}.weight_scale", scale, 0)
    _expect(f"{prefix}.weight_scale", scale, (n, groups))
    if f"{prefix}.weight_packed" in ckpt:
        packed = ckpt.pop(f"{prefix}.weight_packed")
        _expect(f"{prefix}.weight_packed", packed, (n, -(-k * w.num_bits // 32)))
        codes = unpack_int32(packed, w.num_bits, 1, k)
    else:  # int-quantized: signed int8 codes
        weight = _get(ckpt, f"{prefix}.weight", method)
        _expect(f"{prefix}.weight", weight, (n, k))
        codes = (weight.to(torch.int16) + (1 << (w.num_bits - 1))).to(torch.uint8)
    ckpt.pop(f"{prefix}.weight_shape", None)
    mid = float(1 << (w.num_bits - 1))
    if w.symmetric:
        zeros = torch.full((n, groups), mid)
    else:
        zp = _get(ckpt, f"{prefix}.weight_zero_point", method)
        if zp.dtype == torch.int32:  # pack-quantized packs zero points along the rows
            _expect(f"{prefix}.weight_zero_point", zp, (-(-n * w.num_bits // 32), groups))
            zeros = unpack_int32(zp, w.num_bits, 0, n).float()
        else:
            _expect(f"{prefix}.weight_zero_point", zp, (n, groups))
            zeros = zp.float() + mid
    g_idx = ckpt.pop(f"{prefix}.weight_g_idx", None)
    g_idx = _default_g_idx(k, w.group_size or -1) if g_idx is None else g_idx.long()
    return IntWeight(codes.contiguous(), scale.float(), zeros, g_idx, w.num_bits)


def is_quantized(checkpoint: dict[str, torch.Tensor], prefix: str) -> bool:
    """Whether the checkpoint holds ``prefix`` as a quantized layer, in any format."""
    return any(f"{prefix}.{t}" in checkpoint for t in ("qweight", "weight_packed",
                                                       "weight_scale"))


def read_linear(config: QuantConfig, checkpoint: dict[str, torch.Tensor], prefix: str,
                k: int) -> IntWeight | Fp8Weight | None:
    """Pops the tensors of the quantized layer ``prefix`` (``k`` inputs); None when the
    checkpoint holds it in float."""
    if not is_quantized(checkpoint, prefix):
        return None
    if isinstance(config, GPTQConfig):
        return _read_gptq(config, checkpoint, prefix, k)
    if isinstance(config, AWQConfig):
        return _read_awq(config, checkpoint, prefix, k)
    return _read_ct(config, checkpoint, prefix, k)
