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


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PAGEDQ_", extra="ignore")

    redis_url: str = Field("redis://localhost:6379/0",
                           description="redis:// or rediss:// (TLS); the password goes in the URL")
    queue: str = Field("default", min_length=1, description="the queue (job stream) to serve")
    model: str | None = Field(None, description="a Hugging Face folder; unset: SmolLM2-135M")
    device: str = Field("auto", description="cpu, cuda, cuda:1...; auto: cuda when available")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="float32, float16, bfloat16; auto: bfloat16 on CUDA, else float32")
    quantization: Literal["gptq", "awq", "compressed-tensors"] | None = Field(
        None, description="the checkpoint's weight quantization; unset: read from config.json")
    num_kv_blocks: int | None = Field(None, ge=1, description="KV pool size in blocks")
    kv_cache_memory_gib: float = Field(4.0, gt=0, description="CPU KV pool budget")
    max_num_seqs: int = Field(256, ge=1, description="sequences run side by side")
    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget per step")
    consumer: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
                          min_length=1, description="consumer name in the group; unique")
    reclaim_idle_ms: int = Field(60_000, ge=100,
                                 description="take over jobs whose worker was silent this long")
    max_deliveries: int = Field(3, ge=1, description="deliveries before a job is dead-lettered")
    result_ttl: int = Field(86_400, ge=1, description="seconds a result stream lives")
    grace_period: float = Field(30.0, ge=0,
                                description="seconds to finish in-flight jobs on SIGTERM")
    threads: int | None = Field(None, ge=1, description="torch threads; unset: torch's default")
    metrics_port: int | None = Field(None, ge=0, le=65535,
                                     description="port of /metrics, /healthz, /readyz; 0: off")
    metrics_host: str = Field("0.0.0.0", description="address the metrics port binds")
    stall_timeout: float = Field(300.0, gt=0,
                                 description="seconds without a loop tick before /healthz fails")

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: str) -> str:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("redis_url must start with redis://, rediss:// or unix://")
        return url

    def engine_config(self) -> EngineConfig:
        return EngineConfig(model=self.model, device=self.device, dtype=self.dtype,
                            quantization=self.quantization,
                            num_kv_blocks=self.num_kv_blocks,
                            kv_cache_memory_gib=self.kv_cache_memory_gib,
                            max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens)

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
