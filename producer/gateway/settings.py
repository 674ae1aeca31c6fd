"""Gateway settings: environment variables (``PAGEDQ_`` prefix, as the worker's) overridden by
command-line flags, one flag per field; ``settings_table`` is the README's table."""

import argparse
from collections.abc import Sequence
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ..client import DEFAULT_URL


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PAGEDQ_", extra="ignore")

    redis_url: str = Field(DEFAULT_URL, description="the Redis the workers serve")
    host: str = Field("127.0.0.1", description="address to bind; 0.0.0.0 to serve a network")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    api_key: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="accepted keys, comma-separated (flag repeatable); none: no check")
    max_queue_len: int = Field(10_000, ge=1,
                               description="jobs waiting in a queue before requests get 429")
    request_timeout: float = Field(600.0, gt=0,
                                   description="seconds a request waits for its job's events")
    max_file_bytes: int = Field(100 << 20, ge=1, description="largest /v1/files upload")
    batch_max_in_flight: int = Field(256, ge=1,
                                     description="jobs of one batch in the queue at once")
    batch_lease_s: float = Field(30.0, gt=0,
                                 description="a gateway that stops renewing a batch for this "
                                             "long leaves it to another (or to its restart)")
    workers_cache_s: float = Field(1.0, ge=0,
                                   description="how long the list of live workers is reused")

    @field_validator("api_key", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            return [key.strip() for item in value for key in str(item).split(",") if key.strip()]
        return value


def settings_table() -> str:
    """Every setting as a Markdown table (flag, environment variable, default, meaning)."""
    rows = ["| flag | environment | default | what |", "| --- | --- | --- | --- |"]
    for name, field in GatewaySettings.model_fields.items():
        default = "none" if field.default_factory is not None else f"`{field.default}`"
        rows.append(f"| `--{name.replace('_', '-')}` | `PAGEDQ_{name.upper()}` | {default} | "
                    f"{field.description} |")
    return "\n".join(rows)


def parse_args(argv: Sequence[str] | None = None) -> GatewaySettings:
    parser = argparse.ArgumentParser(
        prog="pagedq-gateway", description="OpenAI-compatible HTTP gateway over pagedq queues.")
    for name, field in GatewaySettings.model_fields.items():
        action = "append" if name == "api_key" else "store"
        default = [] if field.default_factory is not None else field.default
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, action=action,
                            default=argparse.SUPPRESS,
                            help=f"{field.description} (env PAGEDQ_{name.upper()}; "
                                 f"default {default})")
    return GatewaySettings(**vars(parser.parse_args(argv)))  # flags win over the environment
