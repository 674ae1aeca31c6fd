"""The KV pool's element type and, for fp8, its per-layer scales (vLLM's ``kv_cache_dtype``).

``"auto"`` stores KV in the model's dtype. ``"fp8"`` (= ``"fp8_e4m3"``, 3 mantissa bits, range
448) and ``"fp8_e5m2"`` (2 bits, range 57344) store one byte per element: the same memory holds
twice the blocks of bf16 and four times those of fp32. Storing divides by the layer's scale and
saturates to the format's range (never inf/NaN in the pool); attention multiplies back on read.

Each layer has one K scale and one V scale, from the first of these that applies (logged at
start-up as ``kv_scales``):

1. ``"checkpoint"``: ``model.layers.<i>.self_attn.k_scale`` / ``v_scale``, as llm-compressor
   writes a calibrated checkpoint;
2. ``"first prefill"`` (``calculate_kv_scales=True``, our default): vLLM's
   ``calculate_kv_scales``, once, from the first step that prefills: ``amax(|k|) / 200`` and
   ``amax(|v|) / 100``, so a later value up to 2.2x (K) or 4.5x (V) that amax still fits e4m3;
3. ``"1.0"`` (``calculate_kv_scales=False``, vLLM's default).

Ours computes by default because it measured better: on SmolLM2 over the first 1,200 tokens
of the Apache License, e4m3 with every scale 1.0 raised perplexity by 3.5 %, with the first
prefill's scales by 1.8 % (at 1.0 small values fall into e4m3's subnormals, below 2^-6:
layer 0's V never exceeds 0.6 there). The constants stay vLLM's, for their headroom: in a
deployment the first prefill is one short request, and later text exceeds its amax. Measured
on SmolLM2, perplexity of four English texts (1,100 tokens each) against the fp32 cache, e4m3:

- scales from a short chat request: +1.59 % with 200/100 (``tests/test_fp8_quality.py``);
  with 448/448 or 448/224 (amax at the format's top) the same texts lost 3.5-5.5 % after a
  five-token first prompt, against 0.6-2.3 % for 200/100: values past the amax saturate;
- scales from each text's own 2,200-token prefill: 200/100 +2.16 % on average, 448/448
  +1.73 %, 300/300 +1.97 %, 448/224 +1.42 %, with each text moving by ±1 % from one constant to
  the next: rounding noise, not a trend worth giving the headroom up for.

**Centred keys.** With scales from the first prefill, that prefill's mean key (per layer, KV
head and channel) is also taken from every key before it is stored, as SageAttention smooths K:
a query's scores all move by the same ``q . m``, which softmax cancels, so attention is
unchanged but for rounding, while the keys' shared offset no longer spends e4m3's range. The
gain is smaller than the spread between first requests. e4m3, the four texts, SmolLM2 (AMD
EPYC with AVX-512, session 11), plain against centred, by the first request: the chat "Hi, how
are you?" +1.71 / +0.46 %, "The capital of France is" +0.56 / +1.03 %, "def fibonacci(n):"
+1.06 / +0.46 %, a 20-word story request +0.28 / +0.95 %: mean 0.90 / 0.73 %, worst 1.71 /
1.03 %. Centring keeps for the worst case. The same for V (the mean added back after
attention) measured no better (+0.62 % after the chat), so values are stored as they are.
Checkpoint scales were calibrated on raw keys, and scales of 1.0 are vLLM's plain behaviour:
neither centres.

The scale and shift tensors live on the device and kernels read them there, so CUDA graphs
captured at start-up see the values the first prefill writes later.
"""

from typing import TYPE_CHECKING

import structlog
import torch

import kernels

if TYPE_CHECKING:  # engine.models imports this module (through engine.attention)
    from engine.models import LlamaForCausalLM

log = structlog.get_logger()
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}
# vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT: the amax of the first prefill maps to these
SCALE_CONSTANTS = (200.0, 100.0)
# compute capability each format needs on CUDA: Triton converts e4m3 only on sm89+ (Ada,
# Hopper); e5m2 conversions exist from sm80 on
MIN_CAPABILITY = {torch.float8_e4m3fn: (8, 9), torch.float8_e5m2: (8, 0)}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device,
                         capability: tuple[int, int] | None = None) -> torch.dtype:
    """The pool's element type; raises ValueError where the device cannot store it.
    ``capability``: the CUDA device's (read from it when None)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in FP8_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; use 'auto', "
                         f"{', '.join(repr(k) for k in FP8_DTYPES)}")
    dtype = FP8_DTYPES[kv_cache_dtype]
    if device.type == "cuda":
        capability = capability or torch.cuda.get_device_capability(device)
        need = MIN_CAPABILITY[dtype]
        if capability < need:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a GPU of compute "
                             f"capability {need[0]}.{need[1]} or newer; this one is "
                             f"{capability[0]}.{capability[1]}: use 'auto'"
                             + (" or 'fp8_e5m2'" if capability >= (8, 0) else ""))
    elif device.type != "cpu":
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is supported on cpu and cuda, "
                         f"not {device.type}: use 'auto'")
    return dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in kernels.FP8_DTYPES


def bind_kv_cache(model: "LlamaForCausalLM", kv_cache: torch.Tensor,
                  checkpoint_scales: torch.Tensor | None, calculate: bool) -> torch.Tensor:
    """Points each layer's attention at its K/V views of the pool ``[2, layers, ...]`` and its
    scales; returns the scales ``[2, layers]`` (fp32, on the pool's device)."""
    layers = model.model.decoder_layers()
    if checkpoint_scales is not None and not is_fp8(kv_cache.dtype):
        log.info("kv scales in the checkpoint are not used: kv_cache_dtype is auto")
    scales = torch.ones(2, len(layers), dtype=torch.float32, device=kv_cache.device)
    shifts = torch.zeros(len(layers), *kv_cache.shape[-2:], device=kv_cache.device,
                         dtype=next(model.parameters()).dtype)
    source = "1.0"
    if is_fp8(kv_cache.dtype) and checkpoint_scales is not None:
        scales.copy_(checkpoint_scales)
        source = "checkpoint"
    elif is_fp8(kv_cache.dtype) and calculate:
        source = "first prefill"
    for i, layer in enumerate(layers):
        attn = layer.self_attn.attn
        attn.k_cache, attn.v_cache = kv_cache[0, i], kv_cache[1, i]
        attn.k_scale, attn.v_scale = scales[0, i], scales[1, i]
        attn.calculate_kv_scales = source == "first prefill"
        attn.k_shift = shifts[i] if attn.calculate_kv_scales else None
    log.info("kv cache", dtype=str(kv_cache.dtype), bytes_per_token=kv_cache[:, :, 0, 0].nbytes,
             kv_scales=source if is_fp8(kv_cache.dtype) else None,
             keys_centred=source == "first prefill")
    return scales


def calculate_kv_scales(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor,
                        v_scale: torch.Tensor) -> None:
    """vLLM's ``calculate_kv_scales``: the scales that map this step's amax to
    ``SCALE_CONSTANTS``, written in place (1.0 where the amax is 0). ``k`` as it will be stored:
    the attention layer centres it first."""
    for x, scale, constant in ((k, k_scale, SCALE_CONSTANTS[0]), (v, v_scale, SCALE_CONSTANTS[1])):
        amax = x.detach().abs().amax().float()
        scale.copy_(torch.where(amax > 0, amax / constant, 1.0))
