"""Attention and cache ops behind one dispatch point.

``backend`` is ``"torch"`` (the reference ops), ``"triton"`` or ``None``: pick by device, Triton
on CUDA where a Triton build of the op exists, the torch reference otherwise.
"""

from collections.abc import Callable
from types import ModuleType

import torch

from kernels import reference

_BACKENDS: dict[str, ModuleType] = {"torch": reference}


def _resolve(name: str, device: torch.device, backend: str | None) -> Callable:
    if backend is None:
        backend = "triton" if device.type == "cuda" and "triton" in _BACKENDS else "torch"
    if backend not in _BACKENDS:
        raise ValueError(f"kernel backend {backend!r} is not available; "
                         f"have {sorted(_BACKENDS)}")
    return getattr(_BACKENDS[backend], name)


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
