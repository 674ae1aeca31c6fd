"""Queue overhead: one worker behind Redis vs ``LLM.generate`` directly, on the same engine.

Three parts, one private redis-server, the worker in this process (a thread: queue_serving.py),
every client in a child process (``python benchmarks/queue.py _client ...``, modes in
``queue_clients.py``), so that no client takes the worker's GIL, as in a deployment (timers and
CPU probes in ``queue_probes.py``):

1. Throughput (default model ``mid``, a random Llama, hidden 256, 4 layers): ``LLM.generate``
   against the same requests through the queue, --repeats pairs (queue_throughput.py).
2. Added latency per chunk (same worker, other prompts, --latency-jobs jobs at once): from
   ``engine.step``'s return to the client's read of each chunk (queue_latency.py), the stream
   interval's hold included (``--stream-interval-ms 0``: the transport's alone).
3. Jobs per second (default model ``tiny``): --jobs jobs with ``max_tokens=1`` through one
   worker, its loop's wall time split by part (queue_jobs.py).

The worker logs as in production (JSON lines at INFO) into benchmarks/out/queue-worker.log.
Prints one table to stdout and writes benchmarks/out/queue.json (queue_report.py).

    .venv/bin/python benchmarks/queue.py                # ~3 minutes on 2 shared cores
    .venv/bin/python benchmarks/queue.py --parts jobs --jobs 20000
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
# This file is named queue.py: with its folder first on sys.path, `import queue` (redis-py,
# concurrent.futures...) would load this file. Take the standard library's, then the folder.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
import queue  # noqa: E402,F401  (the standard library's, now in sys.modules)

sys.path.append(str(_HERE))
from common import (  # noqa: E402  (first: it sets the environment torch reads at import)
    MODELS,
    log,
    model_path,
    random_prompt,
    set_threads,
    usable_token_ids,
)
from queue_clients import client_main  # noqa: E402
from queue_jobs import jobs_per_second  # noqa: E402
from queue_latency import chunk_latency  # noqa: E402
from queue_report import report  # noqa: E402
from queue_serving import (  # noqa: E402
    configure_worker_logging,
    kv_blocks_for,
    make_settings,
    serving,
    warm_up,
)
from queue_throughput import throughput  # noqa: E402

# isort: split
import numpy as np  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="throughput,latency,jobs",
                   help="comma-separated subset of throughput,latency,jobs")
    p.add_argument("--model", choices=MODELS, default="mid",
                   help="model of the throughput and latency parts (random: the 77M llama)")
    p.add_argument("--jobs-model", choices=MODELS, default="tiny")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5,
                   help="(direct, queue) pairs, each on fresh token ids; best of each is shown")
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--latency-jobs", type=int, default=16, help="jobs streamed at once")
    p.add_argument("--latency-tokens", type=int, default=64, help="output tokens per job")
    p.add_argument("--jobs", type=int, default=5000, help="max_tokens=1 jobs")
    p.add_argument("--submit-batch", type=int, default=500, help="jobs per submit_many")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: every core)")
    p.add_argument("--stream-interval-ms", type=float, default=None,
                   help="the worker's: a running job's chunks held up to this long, which "
                   "part 2 measures too (0: sent every step; unset: the worker's default, 50 "
                   "where its torch threads take every core, else 0)")
    args = p.parse_args(argv)
    args.parts = [s for s in args.parts.split(",") if s]
    if bad := set(args.parts) - {"throughput", "latency", "jobs"}:
        p.error(f"unknown parts {sorted(bad)}")
    if not (0 < args.min_prompt <= args.max_prompt and 0 < args.min_output <= args.max_output):
        p.error("need 0 < min <= max for prompt and output lengths")
    return args


def throughput_and_latency(url: str, server_pid: int, args: argparse.Namespace,
                           parts: list[str]) -> dict[str, Any]:
    """Parts 1 and 2: one model, one engine and one worker for both (the direct ``LLM`` too,
    for part 1), their workloads drawn from one seeded generator."""
    from engine import LLM
    from engine.llm_engine import LLMEngine

    path = model_path(args.model)
    rng = np.random.default_rng(args.seed)
    ids = usable_token_ids(path)
    n = args.num_requests
    prompt_lens = [int(k) for k in rng.integers(args.min_prompt, args.max_prompt + 1, n)]
    outputs = [int(k) for k in rng.integers(args.min_output, args.max_output + 1, n)]
    # One workload per repeat: the same lengths, fresh token ids (no prefix-cache hits).
    workloads = [[random_prompt(rng, ids, k) for k in prompt_lens] for _ in range(args.repeats)]
    lat_prompts = [random_prompt(rng, ids, int(k))
                   for k in rng.integers(args.min_prompt, args.max_prompt + 1, args.latency_jobs)]
    warm = [random_prompt(rng, ids, 32) for _ in range(2)]
    blocks = max(kv_blocks_for(workloads[0], outputs),
                 kv_blocks_for(lat_prompts, [args.latency_tokens] * len(lat_prompts)))
    settings = make_settings(url, "bench-mid", path, blocks, args)
    config = settings.engine_config()
    result: dict[str, Any] = {"model": args.model, "model_path": str(path),
                              "engine_config": config.model_dump()}
    engine = LLMEngine(config)  # the worker's
    warm_up(engine, warm)
    llm = None
    if "throughput" in parts:
        llm = LLM(**config.model_dump())
        warm_up(llm.engine, warm)
    with serving(settings, engine) as served:
        result["stream_interval_ms"] = served.worker.stream_interval_s * 1000
        if llm is not None:
            result["throughput"] = throughput(served, llm, url, server_pid, workloads,
                                              prompt_lens, outputs, warm, args)
            del llm
            gc.collect()
        if "latency" in parts:
            log(f"latency: {args.latency_jobs} jobs x {args.latency_tokens} tokens, streamed")
            result["latency"] = chunk_latency(served, url, lat_prompts, args)
    return result


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_client"]:
        client_main(*argv[1:3])
        return
    args = parse_args(argv)
    threads = set_threads(args.threads or None)
    configure_worker_logging()
    from worker.redis_server import RedisServer

    server = RedisServer().start()
    assert server.process is not None
    results: dict[str, Any] = {}
    try:
        if {"throughput", "latency"} & set(args.parts):
            results |= throughput_and_latency(server.url, server.process.pid, args, args.parts)
            gc.collect()
        if "jobs" in args.parts:
            results["jobs"] = jobs_per_second(server.url, server.process.pid, args)
    finally:
        server.stop()
    report(results, args, threads)


if __name__ == "__main__":
    main()
