"""Attention, cache, norm and rotary ops behind one dispatch point.

``backend`` is ``"torch"`` (the reference ops), ``"triton"``, ``"cpu"`` (a numba-compiled paged
decode attention, the reference for the rest) or ``None``: pick by device, Triton on CUDA where
Triton is installed, ``"cpu"`` on the CPU where numba is installed, the torch reference
otherwise. On CPU tensors the Triton ops run only under ``TRITON_INTERPRET=1`` (how the tests
check them without a GPU).
"""

import importlib
import importlib.util
from collections.abc import Callable

import torch

# backend -> module, imported on first use. Not even triton is imported here: its own
# ``@triton.jit`` library functions pick the interpreter (TRITON_INTERPRET) when triton is
# imported, and the kernel tests set that after the engine (and so ``kernels``) is imported.
_BACKENDS: dict[str, str] = {"torch": "kernels.reference"}
if importlib.util.find_spec("triton") is not None:  # CPU-only installs may lack it
    _BACKENDS["triton"] = "kernels.triton_ops"
if importlib.util.find_spec("numba") is not None:
    _BACKENDS["cpu"] = "kernels.cpu_ops"


def default_backend(device: torch.device) -> str:
    fast = "triton" if device.type == "cuda" else "cpu"
    return fast if fast in _BACKENDS else "torch"


def _resolve(name: str, device: torch.device, backend: str | None) -> Callable:
    """The backend's op; a backend that has none of its own leaves it to the reference."""
    if backend is None:
        backend = default_backend(device)
    if backend not in _BACKENDS:
        raise ValueError(f"kernel backend {backend!r} is not available; "
                         f"have {sorted(_BACKENDS)}")
    module = importlib.import_module(_BACKENDS[backend])
    op = getattr(module, name, None)
    return op if op is not None else getattr(importlib.import_module("kernels.reference"), name)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  backend: str | None = None) -> None:
    _resolve("store_kvcache", key.device, backend)(key, value, k_cache, v_cache, slot_mapping)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           backend: str | None = None) -> torch.Tensor:
    return _resolve("paged_attention_decode", q.device, backend)(
        q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, scale: float,
                            backend: str | None = None) -> torch.Tensor:
    return _resolve("paged_attention_prefill", q.device, backend)(
        q, k_cache, v_cache, cu_seqlens_q, block_tables, context_lens, scale)


def copy_blocks(caches: list[torch.Tensor], block_mapping: torch.Tensor,
                backend: str | None = None) -> None:
    _resolve("copy_blocks", block_mapping.device, backend)(caches, block_mapping)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None,
             backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _resolve("rms_norm", x.device, backend)(x, weight, eps, residual)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           positions: torch.Tensor,
           backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _resolve("rotary", q.device, backend)(q, k, cos, sin, positions)


def silu_and_mul(x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    return _resolve("silu_and_mul", x.device, backend)(x)
