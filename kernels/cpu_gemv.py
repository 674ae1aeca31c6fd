"""A linear layer's product in ``cpu_gemv.c`` (built by ``kernels.cpu_native``): the weights
in panels of 16 outputs, each pair of panels streamed once per tile of 8 rows (AVX-512; 4 rows
of one panel on AVX2), on torch's threads.

The C function sums in one fixed order, K in blocks of ``block`` inputs (see the source); the
engine uses it only where that order is oneDNN's many-row one (``engine.cpu_linear`` probes
for the block at load), so a row's bits stay the same in any batch. Panels of bfloat16
weights take the bfloat16 build (``cpu_bf16.c``): the same sums of the widened weights.
"""

import torch

from kernels import cpu_native

PANEL = 16


def available() -> bool:
    return cpu_native.function("pagedq_gemv") is not None


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] as [ceil(out / 16), in, 16], outputs past ``out`` zero."""
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    padded = weight.new_zeros(panels * PANEL, in_features)
    padded[:out_features] = weight
    return padded.view(panels, PANEL, in_features).transpose(1, 2).contiguous()


def gemv(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
         out_features: int, block: int) -> torch.Tensor:
    """``x`` [rows, in] (float32, unit stride along in) times the packed weights (float32 or
    bfloat16), plus ``bias`` (float32): [rows, out_features], float32 on the CPU."""
    function = cpu_native.typed("pagedq_gemv", panels.dtype)
    if function is None:
        raise RuntimeError(f"gemv: no C build for {panels.dtype} weights on this machine")
    rows, in_features = x.shape
    if rows == 0 or x.stride(1) != 1 or panels.shape[1] != in_features:
        raise ValueError(f"gemv takes rows of {panels.shape[1]} inputs with unit "
                         f"stride, got shape {tuple(x.shape)} stride {x.stride()}")
    y = torch.empty(rows, out_features)
    function(x.data_ptr(), x.stride(0), rows, panels.data_ptr(),
             None if bias is None else bias.data_ptr(), y.data_ptr(), out_features,
             out_features, in_features, block, torch.get_num_threads())
    return y
