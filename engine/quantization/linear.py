"""Quantized linear layers, and the swap that puts them where the model has ``nn.Linear``.

Each layer repacks its weight once, at load, into the layout its device computes with (the
model keeps calling ``layer(x)``):

- 4-bit on the CPU: torch's int4 kernel (``kernels.quant_ops.Int4Packed``), when the groups
  fit its group sizes;
- 8-bit symmetric with channel scales on the CPU: torch's int8 weight-only kernel;
- FP8 on the CPU and on CUDA sm89+: ``torch._scaled_mm`` (W8A8), activations quantized per
  token (or by the static scale) as vLLM does, and as compressed-tensors' own forward does in
  transformers: greedy output matches it token for token on the CPU, which it does not when
  activations are left in float;
- otherwise the weight is kept quantized and dequantized at each call
  (``kernels.quant_reference``): 4-bit weights whose groups fit no kernel size, 8-bit weights
  with zero points or groups, FP8 on CUDA before sm89. CUDA's int weights take this path too:
  no int4 GPU kernel is wired in yet (none could be run here).
"""

import torch
from torch import nn

from engine.quantization.config import QuantConfig, QuantizationError
from engine.quantization.formats import Fp8Weight, IntWeight, read_linear
from kernels import quant_ops, quant_reference


class IntQuantLinear(nn.Module):
    def __init__(self, w: IntWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.out_features, self.in_features = w.qweight.shape
        self.bits = w.bits
        self.register_buffer("bias", None if bias is None else bias.to(device, dtype))
        self.int4 = None
        self.layout = "dequantize"
        if device.type == "cpu" and w.bits == 4:
            self.int4 = quant_ops.pack_int4(w.qweight, w.scales, w.zeros, w.g_idx, dtype)
            self.layout = "int4pack" if self.int4 is not None else self.layout
        elif device.type == "cpu" and w.bits == 8 and w.scales.shape[1] == 1 and bool(
                (w.zeros == 128).all()):
            self.layout = "int8pack"
            self.register_buffer("weight", (w.qweight.to(torch.int16) - 128).to(torch.int8))
            self.register_buffer("scales", w.scales[:, 0].to(dtype))
        if self.layout == "dequantize":
            for name in ("qweight", "scales", "zeros", "g_idx"):
                self.register_buffer(name, getattr(w, name).to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is not None:
            return quant_ops.int4_linear(x, self.int4, self.bias)
        if self.layout == "int8pack":
            return quant_ops.int8_channel_linear(x, self.weight, self.scales, self.bias)
        return quant_reference.int_linear(x, self.qweight, self.scales, self.zeros, self.g_idx,
                                          self.bias)

    def weight_bytes(self) -> int:
        tensors = list(self.int4[:2]) if self.int4 is not None else list(self.buffers())
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, layout={self.layout}")


class Fp8Linear(nn.Module):
    def __init__(self, w: Fp8Weight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.out_features, self.in_features = w.weight.shape
        self.register_buffer("bias", None if bias is None else bias.to(device, dtype))
        self.register_buffer("input_scale", None if w.input_scale is None
                             else w.input_scale.float().reshape(()).to(device))
        self.scaled_mm = device.type == "cpu" or torch.cuda.get_device_capability(
            device) >= (8, 9)
        self.layout = "scaled_mm" if self.scaled_mm else "dequantize"
        weight = w.weight.to(device)
        self.register_buffer("weight", weight.t() if self.scaled_mm else weight)
        scale = w.weight_scale.float().to(device)
        self.register_buffer("weight_scale", scale.view(1, -1) if self.scaled_mm else scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scaled_mm:
            return quant_ops.fp8_scaled_mm(x, self.weight, self.weight_scale, self.input_scale,
                                           self.bias)
        return quant_reference.fp8_weight_linear(x, self.weight, self.weight_scale, self.bias)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers() if t is not None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"layout={self.layout}")


def _concat(parts: list[IntWeight | Fp8Weight], name: str) -> IntWeight | Fp8Weight:
    """One weight for a fused layer (qkv, gate_up): its parts stacked along the outputs."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if any(type(p) is not type(first) for p in parts):
        raise QuantizationError(f"{name}: its parts are quantized differently")
    if isinstance(first, Fp8Weight):
        static = [p.input_scale for p in parts if p.input_scale is not None]
        # vLLM's rule for fused layers: one static scale, the largest, so nothing clips
        return Fp8Weight(torch.cat([p.weight for p in parts]),
                         torch.cat([p.weight_scale for p in parts]),
                         torch.stack([s.reshape(()) for s in static]).max() if static else None)
    if any(p.bits != first.bits or not torch.equal(p.g_idx, first.g_idx) for p in parts):
        raise QuantizationError(f"{name}: its parts differ in bit width or g_idx")
    return IntWeight(*(torch.cat([getattr(p, f) for p in parts])
                       for f in ("qweight", "scales", "zeros")), first.g_idx, first.bits)


def quantize_linears(model: nn.Module, config: QuantConfig, checkpoint: dict[str, torch.Tensor],
                     dtype: torch.dtype, device: torch.device) -> int:
    """Swaps every ``nn.Linear`` the checkpoint holds quantized for a quantized layer, popping
    its tensors (and bias) from ``checkpoint``; returns how many were swapped."""
    packed = getattr(model, "packed_modules", {})
    swapped = 0
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            sources = [f"{parent_name}.{s}" for s in packed.get(child_name, (child_name,))]
            parts = [read_linear(config, checkpoint, s, child.in_features) for s in sources]
            if all(p is None for p in parts):
                continue
            if any(p is None for p in parts):
                raise QuantizationError(f"{name}: the checkpoint quantizes only some of "
                                        f"{sources}")
            biases = [checkpoint.pop(f"{s}.bias") for s in sources if f"{s}.bias" in checkpoint]
            bias = torch.cat(biases) if biases else None
            weight = _concat(parts, name)
            n = (weight.qweight if isinstance(weight, IntWeight) else weight.weight).shape[0]
            if n != child.out_features:
                raise QuantizationError(f"{name}: {n} output features in the checkpoint, the "
                                        f"model expects {child.out_features}")
            cls = Fp8Linear if isinstance(weight, Fp8Weight) else IntQuantLinear
            setattr(parent, child_name, cls(weight, bias, dtype, device))
            swapped += 1
    return swapped
