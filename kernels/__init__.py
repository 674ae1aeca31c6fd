"""Attention, cache, norm and rotary ops behind one dispatch point.

``backend`` is ``"torch"`` (the reference ops), ``"triton"``, ``"cpu"`` (a numba-compiled paged
decode attention, the reference for the rest) or ``None``: pick by device, Triton on CUDA where
Triton is installed, ``"cpu"`` on the CPU where numba is installed, the torch reference
otherwise. On CPU tensors the Triton ops run only under ``TRITON_INTERPRET=1`` (how the tests
check them without a GPU).

fp8 KV caches (``torch.float8_e4m3fn`` / ``float8_e5m2``) come with per-layer ``k_scale`` and
``v_scale``; the reference and Triton ops take them as keywords, and the ``"cpu"`` backend
sends them to ``kernels.cpu_fp8``. Other caches call each op's plain signature.
"""

import importlib
import importlib.util
import itertools
from collections.abc import Callable
from functools import cache

import torch

# backend -> module, imported on first use. Not even triton is imported here: its own
# ``@triton.jit`` library functions pick the interpreter (TRITON_INTERPRET) when triton is
# imported, and the kernel tests set that after the engine (and so ``kernels``) is imported.
_BACKENDS: dict[str, str] = {"torch": "kernels.reference"}
if importlib.util.find_spec("triton") is not None:  # CPU-only installs may lack it
    _BACKENDS["triton"] = "kernels.triton_ops"
if importlib.util.find_spec("numba") is not None:
    _BACKENDS["cpu"] = "kernels.cpu_ops"


# fp8 caches on the "cpu" backend: this module's ops (a numba decode that widens the bytes
# itself), the torch reference's for the ops it lacks
_FP8_CPU = "kernels.cpu_fp8"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def default_backend(device: torch.device) -> str:
    fast = "triton" if device.type == "cuda" else "cpu"
    return fast if fast in _BACKENDS else "torch"


def cpu_attention_body(head_dim: int) -> str:
    """The per-token attention body the ``"cpu"`` backend runs in float32 for this head_dim:
    ``"c"`` (built by ``kernels.cpu_native``), ``"numba"``, or ``"torch"`` (the reference)
    without numba."""
    if "cpu" not in _BACKENDS:
        return "torch"
    from kernels import cpu_ops

    return cpu_ops.attention_body(head_dim)


def _resolve(name: str, device: torch.device, backend: str | None,
             fp8: bool = False) -> Callable:
    """The backend's op; a backend that has none of its own leaves it to the reference. An fp8
    cache on the CPU takes ``kernels.cpu_fp8``'s op where it has one, else the reference's."""
    if backend is None:
        backend = default_backend(device)
    if backend not in _BACKENDS:
        raise ValueError(f"kernel backend {backend!r} is not available; "
                         f"have {sorted(_BACKENDS)}")
    if fp8 and backend == "cpu":
        return _op(name, (_FP8_CPU, _BACKENDS["torch"]))
    return _op(name, (_BACKENDS[backend],))


@cache
def _op(name: str, modules: tuple[str, ...]) -> Callable:
    """``name`` from the first of ``modules`` that has it, else the reference's; once per op:
    the imports and lookups were a tenth of a one-row kernel call's 10 us (SmolLM2 decodes a
    token with some 300 of these calls)."""
    for module in modules:
        op = getattr(importlib.import_module(module), name, None)
        if op is not None:
            return op
    return getattr(importlib.import_module("kernels.reference"), name)


def _kv_op(name: str, device: torch.device, backend: str | None, cache: torch.Tensor,
           k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> Callable:
    """The op for this cache: an fp8 one gets the layer's scales (``[]`` fp32 tensors: a K or
    V element is its byte's value times the scale), the others the op's plain signature."""
    op = _resolve(name, device, backend, cache.dtype in FP8_DTYPES)
    if cache.dtype not in FP8_DTYPES:
        return op
    assert k_scale is not None and v_scale is not None, "an fp8 KV cache needs its scales"
    return lambda *args: op(*args, k_scale=k_scale, v_scale=v_scale)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                  backend: str | None = None) -> None:
    _kv_op("store_kvcache", key.device, backend, k_cache, k_scale, v_scale)(
        key, value, k_cache, v_cache, slot_mapping)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           backend: str | None = None) -> torch.Tensor:
    return _kv_op("paged_attention_decode", q.device, backend, k_cache, k_scale, v_scale)(
        q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, scale: float,
                            k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None,
                            backend: str | None = None) -> torch.Tensor:
    return _kv_op("paged_attention_prefill", q.device, backend, k_cache, k_scale, v_scale)(
        q, k_cache, v_cache, cu_seqlens_q, block_tables, context_lens, scale)


# The fewest tokens a run of consecutive equal-length prompts must total for fresh prefills to
# take ``prefill_attention_fresh`` on CUDA: one cuDNN call a run costs the host ~65 us against
# the paged kernel's one call a layer. H100, bf16, 32/8 heads of 128 (session 20, ms): prompts
# of distinct lengths near 2,048 0.38 against 0.49 paged, near 1,024 0.22 against 0.16; runs of
# 4 x 1,024, 8 x 512, 16 x 256, 32 x 128 0.09 / 0.06 / 0.04 / 0.04 against 0.16 / 0.11 / 0.08 /
# 0.07; 4 x 2,048 0.28 (69 % of the matmul rate) against 0.49.
FRESH_PREFILL_MIN_TOKENS = 2048


def fresh_prefill_pays(dtype: torch.dtype, k_cache: torch.Tensor, seq_lens: list[int],
                       backend: str | None = None) -> bool:
    """Whether prompts with nothing cached (``seq_lens`` tokens each, queries of ``dtype``) are
    attended by ``prefill_attention_fresh`` rather than the paged kernel: on the CUDA backend,
    in bfloat16 or float16 with a pool of the same dtype (an fp8 pool's attention reads the
    quantized KV), each run of equal lengths at least ``FRESH_PREFILL_MIN_TOKENS`` in all."""
    device = k_cache.device
    if (backend or default_backend(device)) != "triton" or device.type != "cuda":
        return False
    return (dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == dtype
            and all(n * len(list(run)) >= FRESH_PREFILL_MIN_TOKENS
                    for n, run in itertools.groupby(seq_lens)))


def prefill_attention_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            seq_lens: list[int], scale: float,
                            backend: str | None = None) -> torch.Tensor:
    return _resolve("prefill_attention_fresh", q.device, backend)(q, k, v, seq_lens, scale)


def copy_blocks(caches: list[torch.Tensor], block_mapping: torch.Tensor,
                backend: str | None = None) -> None:
    """Copies bytes: fp8 caches need no scales."""
    _resolve("copy_blocks", block_mapping.device, backend,
             bool(caches) and caches[0].dtype in FP8_DTYPES)(caches, block_mapping)


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


def argmax(logits: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    return _resolve("argmax", logits.device, backend)(logits)
