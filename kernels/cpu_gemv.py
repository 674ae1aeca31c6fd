"""A linear layer's product in ``cpu_gemv.c`` (built by ``kernels.cpu_native``): the weights
in panels of 16 outputs, each pair of panels streamed once per tile of 8 rows (AVX-512; 6 rows
of one panel on AVX2, one to three rows four to two panels at once), on torch's threads.

The C function sums in one fixed order, K in blocks of ``block`` inputs (see the source); the
engine uses it only where that order is oneDNN's many-row one (``engine.cpu_linear`` probes
for the block at load), so a row's bits stay the same in any batch. Panels of bfloat16
weights take the bfloat16 build (``cpu_bf16.c``): the same sums of the widened weights.
"""

from functools import cache

import torch

from kernels import cpu_native

PANEL = 16
_MANY_ROWS = 1 << 20  # past any few rows' bound (cpu_gemv.c's AMX_ROWS)


def available() -> bool:
    return cpu_native.function("pagedq_gemv") is not None


@cache
def paired() -> bool:
    """Whether the bfloat16 build takes inputs in pairs (AVX-512 BF16's vdpbf16ps: the build
    says, ``cpu_bf16.c``), and so its panels must be packed in pairs."""
    function = cpu_native.function("pagedq_bf16_paired")
    return function is not None and bool(function())


def tiles(in_features: int, dtype: torch.dtype) -> bool:
    """Whether a layer of ``in_features`` inputs and ``dtype`` panels reaches the tiles past a
    few rows (AMX here, and its paired steps a multiple of 16): the C build's own predicate,
    ``pagedq_gemv_tiles``, asked of many rows, so the rule is written once."""
    function = cpu_native.typed("pagedq_gemv_tiles", dtype)
    return function is not None and bool(function(_MANY_ROWS, in_features))


def _paired(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and paired()


def steps(in_features: int, dtype: torch.dtype) -> int:
    """A panel's steps over the inputs: one an input, or one a pair of inputs (``paired``)."""
    return -(-in_features // 2) if _paired(dtype) else in_features


def packed_size(out_features: int, in_features: int, dtype: torch.dtype) -> int:
    """The elements ``pack_panels`` holds for a weight of this shape and type."""
    return -(-out_features // PANEL) * PANEL * steps(in_features, dtype) * (
        2 if _paired(dtype) else 1)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] as [ceil(out / 16), in, 16], outputs past ``out`` zero; paired
    bfloat16 as [ceil(out / 16), ceil(in / 2), 32], each 32 the 16 outputs' weights of inputs
    2i and 2i + 1 side by side (an odd ``in`` padded with a zero input)."""
    out_features, in_features = weight.shape
    panels, width = -(-out_features // PANEL), steps(in_features, weight.dtype)
    if not _paired(weight.dtype):
        padded = weight.new_zeros(panels * PANEL, in_features)
        padded[:out_features] = weight
        return padded.view(panels, PANEL, in_features).transpose(1, 2).contiguous()
    padded = weight.new_zeros(panels * PANEL, 2 * width)
    padded[:out_features, :in_features] = weight
    return (padded.view(panels, PANEL, width, 2).permute(0, 2, 1, 3).contiguous()
            .view(panels, width, 2 * PANEL))


def gemv(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
         out_features: int, block: int) -> torch.Tensor:
    """``x`` [rows, in] (float32, unit stride along in) times the packed weights (float32 or
    bfloat16), plus ``bias`` (float32): [rows, out_features], float32 on the CPU."""
    function = cpu_native.typed("pagedq_gemv", panels.dtype)
    if function is None:
        raise RuntimeError(f"gemv: no C build for {panels.dtype} weights on this machine")
    rows, in_features = x.shape
    if rows == 0 or x.stride(1) != 1 or panels.shape[1] != steps(in_features, panels.dtype):
        raise ValueError(f"gemv takes rows of the panels' inputs with unit stride, got shape "
                         f"{tuple(x.shape)} stride {x.stride()} for panels "
                         f"{tuple(panels.shape)}")
    y = torch.empty(rows, out_features)
    if function(x.data_ptr(), x.stride(0), rows, panels.data_ptr(),
                None if bias is None else bias.data_ptr(), y.data_ptr(), out_features,
                out_features, in_features, block, torch.get_num_threads()) != 0:
        raise MemoryError("gemv could not allocate its paired inputs")
    return y
