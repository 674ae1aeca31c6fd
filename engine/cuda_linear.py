"""On CUDA, a decode step's few-row products through ``kernels.triton_gemv`` instead of cuBLAS.

At batch 1 the step is a walk through the weights, and cuBLAS's one-row kernels read the small
ones (random-1b's qkv and o_proj) at under half the memory's rate (session 16, H200). The
GEMV is written to tile them for bandwidth, and the MLP's down projection reads SwiGLU's
activation from the gate/up product as it goes (one launch a layer fewer); whether it beats
cuBLAS is not measured yet (hence ``GEMV_ROWS = 0``). Past a few rows a product is compute's,
and cuBLAS's.
"""

import importlib
import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine.direct_module import DirectModule

# rows a product takes the GEMV up to, read when the model loads; 0: cuBLAS for every product.
# Off until measured on a GPU (session 31 was refused one): ``gpu_profile.py --gemv-rows 0,4``
# and ``gpu_gemv.py`` are the A/B that decides it.
GEMV_ROWS = 0
_DTYPES = (torch.bfloat16, torch.float16)


class GemvLinear(DirectModule):
    """``nn.Linear``'s product, its parameters shared (a tied ``lm_head`` stays tied)."""

    def __init__(self, linear: nn.Linear, max_rows: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.max_rows = max_rows
        # imported here, not with the engine: the kernel tests pick Triton's interpreter first
        self._gemv = importlib.import_module("kernels.triton_gemv").gemv

    def _few(self, x: torch.Tensor) -> bool:
        return x.numel() <= self.max_rows * x.shape[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._few(x):
            return self._gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def forward_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``forward(kernels.silu_and_mul(gate_up))``, fused for few rows."""
        if self._few(gate_up):
            return self._gemv(gate_up, self.weight, self.bias, swiglu_input=True)
        return F.linear(kernels.silu_and_mul(gate_up), self.weight, self.bias)


def use_gemv(model: nn.Module) -> bool:
    param = next(model.parameters())
    return (GEMV_ROWS > 0 and param.device.type == "cuda" and param.dtype in _DTYPES
            and importlib.util.find_spec("triton") is not None)


def gemv_linears(model: nn.Module, max_rows: int | None = None) -> None:
    """Swaps every 16-bit ``nn.Linear`` of ``model`` for a ``GemvLinear``."""
    rows = GEMV_ROWS if max_rows is None else max_rows
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.dtype in _DTYPES:
                setattr(module, name, GemvLinear(child, rows))
