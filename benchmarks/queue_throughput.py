"""benchmarks/queue.py's part 1, throughput (default model ``mid``, a random Llama, hidden 256,
4 layers): N requests of random token ids (prompt lengths uniform in [--min-prompt,
--max-prompt], outputs uniform in [--min-output, --max-output], greedy, ignore_eos). (a)
``LLM.generate`` on all of them, timed; (b) the same requests through ``Client.submit_many`` to
a queue served by one ``Worker`` whose engine was built beforehand from the same
``Settings.engine_config()`` (model load excluded from both; both warmed up), timed from the
submit to the last ``result()``. Token ids must be equal. --repeats pairs (a, b), each on fresh
token ids of the same lengths; the figure is the best queue tok/s over the best direct tok/s.
Beside it, as the cores are shared: the same over wall time less the time the engine's thread
waited for a CPU (kernel schedstat), the ratio per CPU-second (queue: worker + client +
redis-server), and engine.step's share of the best queue run's wall."""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

from common import load_average, log, timed
from proctree import process_cpu_seconds
from queue_clients import run_client
from queue_probes import Patches, Timers, breakdown, instrument, runqueue_wait, waited
from queue_serving import Served, greedy_job


def throughput(served: Served, llm: Any, url: str, server_pid: int,
               workloads: list[list[list[int]]], prompt_lens: list[int], outputs: list[int],
               warm: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """--repeats pairs (direct, queue), one per workload; the queue's first run submits the
    warm-up jobs before it is timed."""
    n = len(outputs)
    log(f"throughput: {args.repeats} x (direct, queue) on {n} requests, "
        f"{sum(prompt_lens)} prompt + {sum(outputs)} output tokens, model {args.model}")
    runs = []
    for r, prompts in enumerate(workloads):
        direct = run_direct(llm, prompts, outputs)
        queued = run_queued(served, url, server_pid, prompts, outputs, warm if r == 0 else [])
        queued["token_ids_equal"] = sum(a == b for a, b in zip(
            direct.pop("token_ids"), queued.pop("token_ids"), strict=True))
        runs.append({"direct": direct, "queue": queued})
        log(f"repeat {r + 1}: direct {direct['tok_s']:.1f} tok/s, queue "
            f"{queued['tok_s']:.1f} tok/s; token ids equal for "
            f"{queued['token_ids_equal']}/{n}")
    return summarize_throughput(runs, prompt_lens, outputs)


def run_direct(llm: Any, prompts: list[list[int]], outputs: list[int]) -> dict[str, Any]:
    from engine import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in outputs]
    tid = threading.get_native_id()
    wait0 = runqueue_wait(tid)
    outs, seconds, cpu = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    return {"seconds": seconds, "cpu_seconds": cpu, "cpu_wait_seconds": waited(tid, wait0),
            "load": load_average(), "tok_s": sum(outputs) / seconds,
            "tok_cpu_s": sum(outputs) / cpu, "token_ids": [o.outputs[0].token_ids for o in outs]}


def run_queued(served: Served, url: str, server_pid: int, prompts: list[list[int]],
               outputs: list[int], warm: list[list[int]]) -> dict[str, Any]:
    worker = served.worker
    spec = {"url": url, "queue": worker.settings.queue,
            "warm_up": [greedy_job(p, 4) for p in warm],
            "jobs": [greedy_job(p, k) for p, k in zip(prompts, outputs, strict=True)]}
    timers, patches = Timers(), Patches()
    instrument(worker, timers, patches)
    try:
        cpu0, redis0 = time.process_time(), process_cpu_seconds(server_pid)
        wait0 = runqueue_wait(served.tid)
        got = run_client("generate", spec)
        worker_cpu = time.process_time() - cpu0
        redis_cpu = process_cpu_seconds(server_pid) - redis0
    finally:
        patches.undo()
    all_cpu = worker_cpu + redis_cpu + got["cpu_seconds"]
    return {"seconds": got["seconds"], "cpu_wait_seconds": waited(served.tid, wait0),
            "load": load_average(),
            "tok_s": sum(outputs) / got["seconds"], "tok_cpu_s": sum(outputs) / all_cpu,
            "cpu_seconds": {"worker": worker_cpu, "client": got["cpu_seconds"],
                            "redis": redis_cpu},
            "token_ids": got["token_ids"], "worker_breakdown": breakdown(timers)}


def summarize_throughput(runs: list[dict[str, Any]], prompt_lens: list[int],
                         outputs: list[int]) -> dict[str, Any]:
    """Best-of-repeats tok/s of each (the run least disturbed by other processes); the same
    over each run's wall time less its engine thread's waits for a CPU; the CPU ratio over
    every run (queue: worker + client + redis-server CPU)."""
    for run in runs:
        for r in run.values():
            wait = r["cpu_wait_seconds"]
            r["tok_s_no_wait"] = None if wait is None else sum(outputs) / (r["seconds"] - wait)
    no_wait = [max(r[k]["tok_s_no_wait"] or 0 for r in runs) for k in ("queue", "direct")]
    best_direct = max((r["direct"] for r in runs), key=lambda d: d["tok_s"])
    best_queue = max((r["queue"] for r in runs), key=lambda q: q["tok_s"])
    direct_cpu = sum(r["direct"]["cpu_seconds"] for r in runs)
    queue_cpu = sum(sum(r["queue"]["cpu_seconds"].values()) for r in runs)
    return {"num_requests": len(outputs), "prompt_tokens": sum(prompt_lens),
            "output_tokens": sum(outputs), "repeats": len(runs), "runs": runs,
            "direct": best_direct, "queue": best_queue,
            "ratio": best_queue["tok_s"] / best_direct["tok_s"],
            "ratio_no_wait": no_wait[0] / no_wait[1] if all(no_wait) else None,
            "ratio_cpu": direct_cpu / queue_cpu,
            "engine_share": best_queue["worker_breakdown"]["seconds"]["engine.step"]
            / best_queue["seconds"],
            "token_ids_equal": min(r["queue"]["token_ids_equal"] for r in runs)}
