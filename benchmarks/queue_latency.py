"""benchmarks/queue.py's part 2, added latency per chunk (the throughput part's worker, other
prompts, --latency-jobs jobs at once): the engine instance's ``step`` is wrapped (in this
benchmark only) to record ``time.perf_counter()`` when it returns, keyed by (job id, sample,
token position); the client process reads each job with ``handle.stream()`` in a thread of its
own, started and blocked in XREAD before the jobs are submitted, and records ``perf_counter()``
when each chunk is yielded. perf_counter is CLOCK_MONOTONIC, one clock for every process of a
Linux machine. Latency = received - produced: the hold of the worker's stream interval (a
running job's later chunks wait up to --stream-interval-ms; 0: none), building the events, the
publish round trip, Redis waking the reader, the reader's parse."""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from common import load_average, percentile_ms
from queue_clients import run_client
from queue_probes import Patches, StepClock, runqueue_wait, waited
from queue_serving import Served, greedy_job


def chunk_latency(served: Served, url: str, prompts: list[list[int]],
                  args: argparse.Namespace) -> dict[str, Any]:
    clock, patches = StepClock(), Patches()
    patches.wrap(served.worker.engine, "step", clock.wrap)
    try:
        spec = {"url": url, "queue": served.worker.settings.queue,
                "jobs": [greedy_job(p, args.latency_tokens) for p in prompts]}
        wall0, wait0 = time.perf_counter(), runqueue_wait(served.tid)
        got = run_client("latency", spec)
        wall, wait = time.perf_counter() - wall0, waited(served.tid, wait0)
    finally:
        patches.undo()
    produced = clock.produced
    delays = [t - produced[(job_id, sample, pos)] for job_id, chunks in got["received"].items()
              for sample, pos, t in chunks]
    expected = len(prompts) * args.latency_tokens
    if len(delays) != expected:
        raise RuntimeError(f"matched {len(delays)} chunks, expected {expected}")
    return {"jobs": len(prompts), "tokens_per_job": args.latency_tokens, "chunks": len(delays),
            "p50_ms": percentile_ms(delays, 50), "p90_ms": percentile_ms(delays, 90),
            "p99_ms": percentile_ms(delays, 99), "max_ms": max(delays) * 1000,
            "mean_ms": float(np.mean(delays)) * 1000, "load": load_average(),
            "worker_cpu_wait_share": None if wait is None else wait / wall}
