"""benchmarks/queue.py's part 3, jobs per second (default model ``tiny``,
build_random_checkpoint's defaults): --jobs jobs of 8 random token ids with ``max_tokens=1``,
submitted in batches of --submit-batch, one worker (--max-num-seqs); done when every result
stream's last entry is ``end``: in rounds, one pipelined XREVRANGE COUNT 1 per pending job (up
to 512), then a blocking ``result()`` of the oldest pending job. The worker loop's wall time is
split by wrapping its parts' methods (engine.step, the driver's events, admit, flush...)."""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from common import load_average, log, model_path, random_prompt, usable_token_ids
from proctree import process_cpu_seconds
from queue_clients import run_client
from queue_probes import Patches, Timers, breakdown, instrument, runqueue_wait, waited
from queue_serving import greedy_job, kv_blocks_for, make_settings, serving, warm_up

JOB_PROMPT_LEN = 8


def jobs_per_second(url: str, server_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    from engine.llm_engine import LLMEngine

    path = model_path(args.jobs_model)
    rng = np.random.default_rng(args.seed + 1)
    ids = usable_token_ids(path)
    prompts = [random_prompt(rng, ids, JOB_PROMPT_LEN) for _ in range(args.jobs)]
    warm = [random_prompt(rng, ids, JOB_PROMPT_LEN) for _ in range(8)]
    blocks = kv_blocks_for(warm * (args.max_num_seqs // len(warm) + 1), [1] * (
        len(warm) * (args.max_num_seqs // len(warm) + 1)))
    settings = make_settings(url, "bench-jobs", path, blocks, args)
    engine = LLMEngine(settings.engine_config())
    warm_up(engine, warm)
    log(f"jobs: {args.jobs} jobs, max_tokens=1, model {args.jobs_model}")
    spec = {"url": url, "queue": settings.queue, "batch": args.submit_batch,
            "warm_up": [greedy_job(p, 1) for p in warm],
            "jobs": [{"prompt": p, "max_tokens": 1, "temperature": 0} for p in prompts]}
    timers, patches = Timers(), Patches()
    with serving(settings, engine) as served:
        run_client("generate", {**spec, "jobs": []})  # the warm-up jobs
        instrument(served.worker, timers, patches)
        cpu0, redis0 = time.process_time(), process_cpu_seconds(server_pid)
        wait0 = runqueue_wait(served.tid)
        got = run_client("jobs", spec)
        wait = waited(served.tid, wait0)
        worker_cpu = time.process_time() - cpu0
        redis_cpu = process_cpu_seconds(server_pid) - redis0
        patches.undo()
    if got["failed"]:
        raise RuntimeError(f"{got['failed']} jobs failed")
    rate = args.jobs / got["seconds"]
    log(f"jobs: {got['seconds']:.2f}s, {rate:.0f} jobs/s")
    return {"model": args.jobs_model, "jobs": args.jobs, "submit_batch": args.submit_batch,
            "max_num_seqs": args.max_num_seqs, "seconds": got["seconds"],
            "submit_seconds": got["submit_seconds"], "jobs_s": rate, "load": load_average(),
            "jobs_per_worker_cpu_s": args.jobs / worker_cpu, "cpu_wait_seconds": wait,
            "jobs_s_no_wait": None if wait is None else args.jobs / (got["seconds"] - wait),
            "cpu_seconds": {"worker": worker_cpu, "client": got["cpu_seconds"],
                            "redis": redis_cpu},
            "worker_breakdown": breakdown(timers)}
