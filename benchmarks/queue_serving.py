"""benchmarks/queue.py's worker side, shared by its parts: the worker's settings and logging, a
warm-up, the worker in a thread of this process, and the jobs and KV room the parts ask for."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import OUT_DIR

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from worker.config import Settings
    from worker.service import Worker

WORKER_LOG = OUT_DIR / "queue-worker.log"


def configure_worker_logging() -> None:
    """The worker CLI's JSON lines at INFO, into a file instead of stderr."""
    import structlog

    from worker.__main__ import configure_logging

    configure_logging()
    WORKER_LOG.parent.mkdir(parents=True, exist_ok=True)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(WORKER_LOG.open("w")))


def make_settings(url: str, queue_name: str, path: Path, num_kv_blocks: int,
                  args: argparse.Namespace) -> Settings:
    from worker.config import Settings

    return Settings(redis_url=url, queue=queue_name, model=str(path), device="cpu",
                    dtype="float32", num_kv_blocks=num_kv_blocks, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    stream_interval_ms=args.stream_interval_ms, consumer=f"bench-{queue_name}")


def warm_up(engine: LLMEngine, prompts: list[list[int]]) -> None:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"warm-up-{i}", prompt, params)
    while engine.has_unfinished():
        engine.step()


@dataclass
class Served:
    worker: Worker
    tid: int  # the worker thread's kernel id, for runqueue_wait


@contextmanager
def serving(settings: Settings, engine: LLMEngine) -> Iterator[Served]:
    """One worker on ``engine`` in a thread, registered before this yields; stopped after."""
    from producer.rq_mirror import worker_key
    from worker.service import Worker

    worker = Worker(settings, engine=engine)
    thread = threading.Thread(target=worker.run, name=settings.consumer, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not worker.conn.exists(worker_key(worker.name)):
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the worker did not start")
        time.sleep(0.01)
    assert thread.native_id is not None
    try:
        yield Served(worker, thread.native_id)
    finally:
        worker.stop()
        thread.join(60)


def greedy_job(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def kv_blocks_for(prompts: list[list[int]], outputs: list[int], block_size: int = 16) -> int:
    """Room for every request at its full length at once, plus slack: no preemption."""
    return sum(-(-(len(p) + n) // block_size) for p, n in zip(prompts, outputs, strict=True)) + 64
