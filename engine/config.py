"""Engine configuration: typed, validated, with vLLM's names."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # a Hugging Face folder; None: the default SmolLM2-135M-Instruct
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"  # auto: fp32 CPU, bf16 CUDA
    # vLLM's --quantization: None reads it from the checkpoint; a name must match the checkpoint
    quantization: Literal["gptq", "awq", "compressed-tensors"] | None = None
    device: str = "auto"  # auto: cuda when available
    block_size: int = Field(16, ge=1, le=256)
    num_kv_blocks: int | None = Field(None, ge=1)  # None: sized from the memory budget
    kv_cache_memory_gib: float = Field(4.0, gt=0)  # the CPU budget for the KV pool
    # CPU: write the whole pool at start-up, in 2 MiB pages, as vLLM's CPU backend does, rather
    # than as calls first reach its blocks. For a host that serves: the memory is held from the
    # start (a host without it fails at start-up, not mid-job), no step waits on first writes,
    # and the attention reads huge pages (fewer page walks). random-26m's 128 requests, Intel
    # Xeon, 5 rounds alternating: 17.26 -> 16.43 s a call; start-up +1.9-5.9 s for 4 GiB, peak
    # RSS 2.5 -> 4.9 GB. Off by default: a library call or a test should not hold 4 GiB.
    reserve_kv_cache: bool = False
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int | None = Field(None, ge=1)  # None: the model's context length
    enable_prefix_caching: bool = True
    # "auto": the model's dtype; "fp8" (= "fp8_e4m3") or "fp8_e5m2": 1-byte KV (engine.kv_cache)
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    # fp8 without scales in the checkpoint: True computes them from the first prefill, False
    # uses 1.0 (vLLM's default; see engine.kv_cache for why ours differs)
    calculate_kv_scales: bool = True
    enforce_eager: bool = False  # CUDA: run decode eagerly instead of replaying CUDA graphs
    # schedule and launch the next step while this one's tokens are on the device
    # (engine.async_step); None: on CUDA only (on the CPU the host and the model share cores)
    async_scheduling: bool | None = None
    seed: int = 0  # the global RNG, for requests without a seed of their own
