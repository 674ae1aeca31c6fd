"""Worker settings: environment variables (``PAGEDQ_`` prefix) overridden by command-line flags
(``--redis-url``, ``--max-num-seqs``...), one flag per field."""

import argparse
import os
import socket
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.config import EngineConfig

# the unset stream interval where the engine's CPU threads take every core (service.py)
BUSY_STREAM_INTERVAL_MS = 50.0


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PAGEDQ_", extra="ignore")

    redis_url: str = Field("redis://localhost:6379/0",
                           description="redis:// or rediss:// (TLS); the password goes in the URL")
    queue: str = Field("default", min_length=1, description="the queue (job stream) to serve")
    model: str | None = Field(None, description="a Hugging Face folder; unset: SmolLM2-135M")
    device: str = Field("auto", description="cpu, cuda, cuda:1...; auto: cuda when available")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="float32, float16, bfloat16; auto: bfloat16 on CUDA, else float32")
    block_size: int = Field(16, ge=1, le=256, description="tokens per KV block")
    quantization: Literal["gptq", "awq", "compressed-tensors"] | None = Field(
        None, description="the checkpoint's weight quantization; unset: read from config.json")
    num_kv_blocks: int | None = Field(None, ge=1, description="KV pool size in blocks")
    kv_cache_memory_gib: float = Field(4.0, gt=0, description="CPU KV pool budget")
    reserve_kv_cache: bool = Field(False, description="CPU: write the whole KV pool at start-up, "
                                   "in huge pages (a dedicated host: ~5 % faster, memory held "
                                   "from the start)")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="share of GPU memory for weights, activations and KV")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto", description="KV element type; fp8 (= fp8_e4m3), fp8_e5m2: 1 byte, 2-4x the blocks")
    max_num_seqs: int = Field(256, ge=1, description="sequences run side by side")
    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget per step")
    max_model_len: int | None = Field(None, ge=1,
                                      description="context length cap; unset: the model's")
    enable_prefix_caching: bool = Field(True, description="reuse cached prompt blocks")
    enforce_eager: bool = Field(False, description="CUDA: no CUDA graphs for decode")
    async_scheduling: bool | None = Field(
        None, description="launch the next step before this one's tokens are read; unset: on "
        "CUDA only")
    seed: int = Field(0, description="global RNG seed, for jobs without a seed of their own")
    consumer: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
                          min_length=1, description="consumer name in the group; unique")
    reclaim_idle_ms: int = Field(60_000, ge=100,
                                 description="take over jobs whose worker was silent this long")
    max_deliveries: int = Field(3, ge=1, description="deliveries before a job is dead-lettered")
    dead_letter_max_len: int = Field(10_000, ge=1,
                                     description="dead letters kept (about; oldest dropped)")
    result_ttl: int = Field(86_400, ge=1, description="seconds a result stream and the RQ "
                            "record of a finished or canceled job live")
    failure_ttl: int = Field(604_800, ge=1,
                             description="seconds the RQ record of a failed job lives")
    grace_period: float = Field(30.0, ge=0,
                                description="seconds to finish in-flight jobs on SIGTERM")
    threads: int | None = Field(None, ge=1, description="torch threads; unset: torch's default")
    metrics_port: int | None = Field(None, ge=0, le=65535,
                                     description="port of /metrics, /healthz, /readyz; 0: off")
    metrics_host: str = Field("0.0.0.0", description="address the metrics port binds")
    watch_arrivals: bool = Field(True, description="a busy worker notices new jobs (a blocked "
                                 "XREAD) and starts them a step sooner; each job then reaches "
                                 "every watching worker once")
    stream_interval_ms: float | None = Field(
        None, ge=0, description="a running job's chunks are written at most this often (a "
        "job's first chunk and its end at once; 0: every step); unset: "
        f"{BUSY_STREAM_INTERVAL_MS:g} where the engine's CPU threads take every core, else 0 "
        "(worker/service.py `stream_interval_s`)")
    stall_timeout: float = Field(300.0, gt=0,
                                 description="seconds without a loop tick before /healthz fails")

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: str) -> str:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("redis_url must start with redis://, rediss:// or unix://")
        return url

    def engine_config(self) -> EngineConfig:
        """Every EngineConfig field has a setting of the same name (a test checks it)."""
        return EngineConfig(**self.model_dump(include=set(EngineConfig.model_fields)))

    @property
    def claim_refresh_s(self) -> float:
        """How often in-flight jobs are re-claimed (and peers' silent ones looked for): a few
        times per reclaim window, so a live worker's jobs never look idle."""
        return min(5.0, self.reclaim_idle_ms / 4000)


def settings_table() -> str:
    """Every setting as a Markdown table (flag, environment variable, default, meaning): the
    README's copy is checked against it by tests/test_operator_docs.py."""
    rows = ["| flag | environment | default | what |", "| --- | --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        if field.default_factory is not None:
            default = "`<hostname>-<pid>`"
        else:
            default = "unset" if field.default is None else f"`{field.default}`"
        rows.append(f"| `--{name.replace('_', '-')}` | `PAGEDQ_{name.upper()}` | {default} | "
                    f"{field.description} |")
    return "\n".join(rows)


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(prog="pagedq-worker", description="Serve a pagedq queue.")
    for name, field in Settings.model_fields.items():
        env = f"PAGEDQ_{name.upper()}"
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=argparse.SUPPRESS,
                            help=f"{field.description or name} (env {env})")
    return Settings(**vars(parser.parse_args(argv)))  # flags win over the environment
