"""Quantized linear layers, and the swap that puts them where the model has ``nn.Linear``.

Each layer repacks its weight once, at load, into the layout its device and dtype compute
fastest with (the model keeps calling ``layer(x)``). Measured on this Zen4 CPU, one thread, a
1536x576 SmolLM2 MLP weight at one token: torch's weight-only kernels take 0.055 ms (int4) in
bfloat16 against 0.094 ms for the dense bfloat16 product, but their float32 paths are generic
loops (int4 3.6 ms, int8 2.4 ms against 0.075 ms dense), dequantizing at each call costs ~2 ms,
and ``torch._scaled_mm`` on FP8 ~15 ms. Hence:

- ``int4pack`` / ``int8pack``: on the CPU in bfloat16/float16, torch's int4 kernel
  (``kernels.quant_ops.Int4Packed``, when the groups fit its sizes) and int8 kernel (symmetric,
  channel scales): a quarter / half of the bfloat16 weight memory;
- float32 on the CPU (the reference dtype): int weights are dequantized once at load, as
  transformers does, into the model's plain linear layers (which ``engine.cpu_linear`` then
  prepacks): the float model's speed, memory and arithmetic;
- ``dense``: a weight dequantized once at load kept in a quantized layer: FP8 on the CPU in any
  dtype (its activations are still quantized per token, or by the static scale, as
  compressed-tensors computes in transformers), and int weights in bfloat16 whose groups fit no
  kernel;
- ``scaled_mm``: FP8 on CUDA sm89+, ``torch._scaled_mm`` with FP8 activations (vLLM's W8A8);
- ``triton``: int weights (4- and 8-bit) on CUDA, packed for ``kernels.triton_quant``'s GEMM,
  which dequantizes tile by tile in registers (4-bit: a quarter of the bf16 weight's bytes).
  Checked against the reference under Triton's interpreter; not yet run on a GPU;
- ``dequantize``: int weights on CUDA without Triton, kept quantized and dequantized at each
  call (``kernels.quant_reference``).
"""

import importlib.util
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.direct_module import DirectModule
from engine.quantization.config import QuantConfig, QuantizationError
from engine.quantization.formats import Fp8Weight, IntWeight, read_linear
from kernels import quant_ops, quant_reference


class IntQuantLinear(DirectModule):
    # buffers (register_buffer), each layout its own: nn.Module's __getattr__ types them loosely
    bias: torch.Tensor | None
    weight: torch.Tensor
    scales: torch.Tensor
    qweight: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor

    def __init__(self, w: IntWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.out_features, self.in_features = w.qweight.shape
        self.bits = w.bits
        self.register_buffer("bias", None if bias is None else bias.to(device, dtype))
        self.int4 = None
        kernels = device.type == "cpu" and dtype != torch.float32
        if kernels and w.bits == 4:
            self.int4 = quant_ops.pack_int4(w.qweight, w.scales, w.zeros, w.g_idx, dtype)
        if self.int4 is not None:
            self.layout = "int4pack"
        elif kernels and w.bits == 8 and w.scales.shape[1] == 1 and bool((w.zeros == 128).all()):
            self.layout = "int8pack"
            self.register_buffer("weight", (w.qweight.to(torch.int16) - 128).to(torch.int8))
            self.register_buffer("scales", w.scales[:, 0].to(dtype))
        elif device.type == "cpu":
            self.layout = "dense"
            self.register_buffer("weight", quant_reference.dequantize_int(
                w.qweight, w.scales, w.zeros, w.g_idx, dtype))
        elif importlib.util.find_spec("triton") is not None:
            from kernels import triton_quant  # imports triton: CUDA only

            self.layout = "triton"
            qweight, scales, zeros, g_idx = (t.to(device) for t in (
                w.qweight, w.scales, w.zeros, w.g_idx))
            self.packed = triton_quant.pack(qweight, scales, zeros, g_idx, w.bits)
            self.triton_linear = triton_quant.int_linear
        else:
            self.layout = "dequantize"
            for name in ("qweight", "scales", "zeros", "g_idx"):
                self.register_buffer(name, getattr(w, name).to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is not None:
            return quant_ops.int4_linear(x, self.int4, self.bias)
        if self.layout == "int8pack":
            return quant_ops.int8_channel_linear(x, self.weight, self.scales, self.bias)
        if self.layout == "dense":
            return F.linear(x, self.weight, self.bias)
        if self.layout == "triton":
            return self.triton_linear(x, self.packed, self.bias)
        return quant_reference.int_linear(x, self.qweight, self.scales, self.zeros, self.g_idx,
                                          self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, layout={self.layout}")


class Fp8Linear(DirectModule):
    bias: torch.Tensor | None  # buffers, as IntQuantLinear's
    input_scale: torch.Tensor | None
    weight: torch.Tensor
    weight_scale: torch.Tensor

    def __init__(self, w: Fp8Weight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.out_features, self.in_features = w.weight.shape
        self.register_buffer("bias", None if bias is None else bias.to(device, dtype))
        self.register_buffer("input_scale", None if w.input_scale is None
                             else w.input_scale.float().reshape(()).to(device))
        self.scaled_mm = device.type == "cuda" and torch.cuda.get_device_capability(
            device) >= (8, 9)
        self.layout = "scaled_mm" if self.scaled_mm else "dense"
        if self.scaled_mm:
            self.register_buffer("weight", w.weight.to(device).t())
            self.register_buffer("weight_scale", w.weight_scale.float().to(device).view(1, -1))
        else:
            self.register_buffer("weight", quant_reference.dequantize_fp8(
                w.weight, w.weight_scale, dtype).to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scaled_mm:
            return quant_ops.fp8_scaled_mm(x, self.weight, self.weight_scale, self.input_scale,
                                           self.bias)
        return quant_reference.fp8_activation_linear(x, self.weight, self.input_scale, self.bias)

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
        fp8 = cast(list[Fp8Weight], parts)  # all of first's type, as checked
        static = [p.input_scale for p in fp8 if p.input_scale is not None]
        # vLLM's rule for fused layers: one static scale, the largest, so nothing clips
        return Fp8Weight(torch.cat([p.weight for p in fp8]),
                         torch.cat([p.weight_scale for p in fp8]),
                         torch.stack([s.reshape(()) for s in static]).max() if static else None)
    ints = cast(list[IntWeight], parts)
    if any(p.bits != first.bits or not torch.equal(p.g_idx, first.g_idx) for p in ints):
        raise QuantizationError(f"{name}: its parts differ in bit width or g_idx")
    qweight, scales, zeros = (torch.cat([getattr(p, f) for p in ints])
                              for f in ("qweight", "scales", "zeros"))
    return IntWeight(qweight, scales, zeros, first.g_idx, first.bits)


def quantize_linears(model: nn.Module, config: QuantConfig, checkpoint: dict[str, torch.Tensor],
                     dtype: torch.dtype, device: torch.device) -> None:
    """Swaps every ``nn.Linear`` the checkpoint holds quantized for a quantized layer, popping
    its tensors (and bias) from ``checkpoint``. Int weights computed in float32 on the CPU go
    back into ``checkpoint`` as float weights instead: the layer stays an ``nn.Linear``."""
    packed = getattr(model, "packed_modules", {})
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            name = f"{parent_name}.{child_name}".lstrip(".")
            sources = [f"{parent_name}.{s}".lstrip(".")
                       for s in packed.get(child_name, (child_name,))]
            read = [read_linear(config, checkpoint, s, child.in_features) for s in sources]
            parts = [p for p in read if p is not None]
            if not parts:
                continue
            if len(parts) < len(read):
                raise QuantizationError(f"{name}: the checkpoint quantizes only some of "
                                        f"{sources}")
            weight = _concat(parts, name)
            n = (weight.qweight if isinstance(weight, IntWeight) else weight.weight).shape[0]
            if n != child.out_features:
                raise QuantizationError(f"{name}: {n} output features in the checkpoint, the "
                                        f"model expects {child.out_features}")
            if isinstance(weight, IntWeight) and device.type == "cpu" and dtype == torch.float32:
                ints = cast(list[IntWeight], parts)  # as weight: _concat refuses mixed parts
                for source, part in zip(sources, ints, strict=True):
                    checkpoint[f"{source}.weight"] = quant_reference.dequantize_int(
                        part.qweight, part.scales, part.zeros, part.g_idx)
                continue
            biases = [checkpoint.pop(f"{s}.bias") for s in sources if f"{s}.bias" in checkpoint]
            bias = torch.cat(biases) if biases else None
            layer = (Fp8Linear(weight, bias, dtype, device) if isinstance(weight, Fp8Weight)
                     else IntQuantLinear(weight, bias, dtype, device))
            setattr(parent, child_name, layer)
