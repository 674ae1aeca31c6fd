"""Queue overhead: one worker behind Redis vs ``LLM.generate`` directly, on the same engine.

Three parts, one private redis-server, the worker in this process (a thread), every client in a
child process (``python benchmarks/queue.py _client ...``, modes in ``queue_clients.py``), so
that no client takes the worker's GIL, as in a deployment (timers and CPU probes in
``queue_probes.py``):

1. Throughput (default model ``mid``, a random Llama, hidden 256, 4 layers): N requests of
   random token ids (prompt lengths uniform in [--min-prompt, --max-prompt], outputs uniform in
   [--min-output, --max-output], greedy, ignore_eos). (a) ``LLM.generate`` on all of them,
   timed; (b) the same requests through ``Client.submit_many`` to a queue served by one
   ``Worker`` whose engine was built beforehand from the same ``Settings.engine_config()``
   (model load excluded from both; both warmed up), timed from the submit to the last
   ``result()``. Token ids must be equal. --repeats pairs (a, b), each on fresh token ids of
   the same lengths; the figure is the best queue tok/s over the best direct tok/s. Beside it,
   as the cores are shared: the same over wall time less the time the engine's thread waited
   for a CPU (kernel schedstat), the ratio per CPU-second (queue: worker + client +
   redis-server), and engine.step's share of the best queue run's wall.
2. Added latency per chunk (same worker, other prompts, --latency-jobs jobs at once): the
   engine instance's ``step`` is wrapped (in this benchmark only) to record
   ``time.perf_counter()`` when it returns, keyed by (job id, sample, token position); the
   client process reads each job with ``handle.stream()`` in a thread of its own, started and
   blocked in XREAD before the jobs are submitted, and records ``perf_counter()`` when each
   chunk is yielded. perf_counter is CLOCK_MONOTONIC, one clock for every process of a Linux
   machine. Latency = received - produced: building the events, the publish round trip, Redis
   waking the reader, the reader's parse.
3. Jobs per second (default model ``tiny``, build_random_checkpoint's defaults): --jobs jobs of
   8 random token ids with ``max_tokens=1``, submitted in batches of --submit-batch, one
   worker (--max-num-seqs); done when every result stream's last entry is ``end``: in rounds,
   one pipelined XREVRANGE COUNT 1 per pending job (up to 512), then a blocking ``result()``
   of the oldest pending job. The worker loop's wall time is split by wrapping its parts'
   methods (engine.step, the driver's events, admit, flush...).

The worker logs as in production (JSON lines at INFO) into benchmarks/out/queue-worker.log.
Prints one table to stdout and writes benchmarks/out/queue.json.

    .venv/bin/python benchmarks/queue.py                # ~3 minutes on 2 shared cores
    .venv/bin/python benchmarks/queue.py --parts jobs --jobs 20000
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

_HERE = Path(__file__).resolve().parent
# This file is named queue.py: with its folder first on sys.path, `import queue` (redis-py,
# concurrent.futures...) would load this file. Take the standard library's, then the folder.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
import queue  # noqa: E402,F401  (the standard library's, now in sys.modules)

sys.path.append(str(_HERE))
from common import (  # noqa: E402  (first: it sets the environment torch reads at import)
    MODELS,
    OUT_DIR,
    format_table,
    load_average,
    log,
    model_path,
    percentile_ms,
    random_prompt,
    set_threads,
    timed,
    usable_token_ids,
    write_json,
)
from proctree import process_cpu_seconds  # noqa: E402
from queue_clients import client_main  # noqa: E402
from queue_probes import (  # noqa: E402
    Patches,
    StepClock,
    Timers,
    breakdown,
    instrument,
    runqueue_wait,
    waited,
)

# isort: split
import numpy as np  # noqa: E402

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from worker.config import Settings
    from worker.service import Worker

TARGET_RATIO = 0.95
TARGET_P50_MS = 5.0
TARGET_JOBS_S = 1000.0
JOB_PROMPT_LEN = 8
WORKER_LOG = OUT_DIR / "queue-worker.log"


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
    args = p.parse_args(argv)
    args.parts = [s for s in args.parts.split(",") if s]
    if bad := set(args.parts) - {"throughput", "latency", "jobs"}:
        p.error(f"unknown parts {sorted(bad)}")
    if not (0 < args.min_prompt <= args.max_prompt and 0 < args.min_output <= args.max_output):
        p.error("need 0 < min <= max for prompt and output lengths")
    return args


def configure_worker_logging() -> None:
    """The worker CLI's JSON lines at INFO, into a file instead of stderr."""
    import structlog

    from worker.__main__ import configure_logging

    configure_logging()
    WORKER_LOG.parent.mkdir(parents=True, exist_ok=True)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(WORKER_LOG.open("w")))


# ----------------------------------------------------------------------------- worker side


def make_settings(url: str, queue_name: str, path: Path, num_kv_blocks: int,
                  args: argparse.Namespace) -> Settings:
    from worker.config import Settings

    return Settings(redis_url=url, queue=queue_name, model=str(path), device="cpu",
                    dtype="float32", num_kv_blocks=num_kv_blocks, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    consumer=f"bench-{queue_name}")


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


# ----------------------------------------------------------------------------- client side


def run_client(mode: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Runs a client mode in a child process; returns what it printed (JSON)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="pagedq-bench-") as f:
        json.dump(spec, f)
        f.flush()
        out = subprocess.run([sys.executable, __file__, "_client", mode, f.name],
                             stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout)


# ----------------------------------------------------------------------------- the parts


def greedy_job(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def kv_blocks_for(prompts: list[list[int]], outputs: list[int], block_size: int = 16) -> int:
    """Room for every request at its full length at once, plus slack: no preemption."""
    return sum(-(-(len(p) + n) // block_size) for p, n in zip(prompts, outputs, strict=True)) + 64


def throughput_and_latency(url: str, server_pid: int, args: argparse.Namespace,
                           parts: list[str]) -> dict[str, Any]:
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
        if llm is not None:
            log(f"throughput: {args.repeats} x (direct, queue) on {n} requests, "
                f"{sum(prompt_lens)} prompt + {sum(outputs)} output tokens, model {args.model}")
            runs = []
            for r, prompts in enumerate(workloads):
                direct = run_direct(llm, prompts, outputs)
                queued = run_queued(served, url, server_pid, prompts, outputs,
                                    warm if r == 0 else [])
                queued["token_ids_equal"] = sum(a == b for a, b in zip(
                    direct.pop("token_ids"), queued.pop("token_ids"), strict=True))
                runs.append({"direct": direct, "queue": queued})
                log(f"repeat {r + 1}: direct {direct['tok_s']:.1f} tok/s, queue "
                    f"{queued['tok_s']:.1f} tok/s; token ids equal for "
                    f"{queued['token_ids_equal']}/{n}")
            result["throughput"] = summarize_throughput(runs, prompt_lens, outputs)
            del llm
            gc.collect()
        if "latency" in parts:
            log(f"latency: {args.latency_jobs} jobs x {args.latency_tokens} tokens, streamed")
            result["latency"] = chunk_latency(served, url, lat_prompts, args)
    return result


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


# ----------------------------------------------------------------------------- report


def uncommitted() -> list[str]:
    """Files of the code under test that differ from HEAD (others may be editing them)."""
    out = subprocess.run(["git", "status", "--porcelain", "--", "engine", "kernels", "worker",
                          "producer"], cwd=_HERE.parent, capture_output=True, text=True,
                         check=False).stdout
    return [line[3:] for line in out.splitlines()]


def verdict(ok: bool) -> str:
    return "yes" if ok else "NO"


def breakdown_line(what: str, b: dict[str, dict[str, float]]) -> str:
    return (f"{what}: worker loop {b['seconds']['tick']:.2f}s in {b['calls']['tick']} ticks, "
            f"{b['calls']['engine.step']} engine steps, {b['calls']['flush']} flushes: "
            + ", ".join(f"{k} {v:.2f}" for k, v in b["seconds"].items() if k != "tick"))


def seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}s"


def share(value: float | None) -> str:
    return "?" if value is None else f"{100 * value:.0f}%"


def cpu_line(cpu: dict[str, float]) -> str:
    return "CPU s " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())


def report(results: dict[str, Any], args: argparse.Namespace, threads: int) -> None:
    rows: list[list[Any]] = []
    if tp := results.get("throughput"):
        best = f"best of {tp['repeats']}"
        rows += [
            [f"LLM.generate, output tok/s ({results['model']}, {best})", tp["direct"]["tok_s"],
             "", ""],
            [f"queue + 1 worker, output tok/s ({best})", tp["queue"]["tok_s"], "", ""],
            ["throughput ratio queue / direct", tp["ratio"], f">= {TARGET_RATIO}",
             verdict(tp["ratio"] >= TARGET_RATIO)],
            ["  wall less the engine thread's waits for a CPU", tp["ratio_no_wait"], "", ""],
            ["  engine.step's share of the best queue run's wall", tp["engine_share"], "", ""],
            ["  per CPU-second (queue: worker+client+redis)", tp["ratio_cpu"], "", ""],
            ["greedy token ids equal (requests, every repeat)",
             f"{tp['token_ids_equal']}/{tp['num_requests']}", "all",
             verdict(tp["token_ids_equal"] == tp["num_requests"])],
        ]
    if lat := results.get("latency"):
        rows += [
            ["added latency per chunk, p50 (ms)", lat["p50_ms"], f"< {TARGET_P50_MS:g}",
             verdict(lat["p50_ms"] < TARGET_P50_MS)],
            ["added latency per chunk, p99 (ms)", lat["p99_ms"], "", ""],
        ]
    if jobs := results.get("jobs"):
        rows += [
            [f"jobs/s, max_tokens=1 ({jobs['model']}, {jobs['jobs']} jobs)", jobs["jobs_s"],
             f">= {TARGET_JOBS_S:g}", verdict(jobs["jobs_s"] >= TARGET_JOBS_S)],
            ["  wall less the worker thread's waits for a CPU", jobs["jobs_s_no_wait"], "", ""],
            ["  jobs per worker CPU-second", jobs["jobs_per_worker_cpu_s"], "", ""],
        ]
    print(f"\n== queue: one worker (in-process thread), {threads} torch thread(s), clients in a "
          f"child process, private redis-server ==")
    print(format_table(["figure", "value", "target", "met"], rows))
    if tp:
        d, q = tp["direct"], tp["queue"]
        print(f"throughput: {tp['num_requests']} requests, {tp['prompt_tokens']} prompt + "
              f"{tp['output_tokens']} output tokens; best direct {d['seconds']:.2f}s "
              f"({d['cpu_seconds']:.2f} CPU s, waited {seconds(d['cpu_wait_seconds'])}, load "
              f"{d['load']}), best queue {q['seconds']:.2f}s ({cpu_line(q['cpu_seconds'])}, "
              f"worker waited {seconds(q['cpu_wait_seconds'])}, load {q['load']})")
        print(breakdown_line("throughput, best queue run", q["worker_breakdown"]))
    if lat:
        print(f"latency: {lat['jobs']} jobs x {lat['tokens_per_job']} tokens, {lat['chunks']} "
              f"chunks: p50 {lat['p50_ms']:.2f}, p90 {lat['p90_ms']:.2f}, p99 "
              f"{lat['p99_ms']:.2f}, max {lat['max_ms']:.2f} ms (load {lat['load']}; the "
              f"worker thread waited for a CPU {share(lat['worker_cpu_wait_share'])} of the "
              f"time)")
    if jobs:
        print(f"jobs: {jobs['seconds']:.2f}s (submit {jobs['submit_seconds']:.2f}s, "
              f"{cpu_line(jobs['cpu_seconds'])}, worker waited "
              f"{seconds(jobs['cpu_wait_seconds'])}, load {jobs['load']})")
        print(breakdown_line("jobs", jobs["worker_breakdown"]))
    print("waited: seconds the engine's thread was runnable but waited for a CPU (schedstat); "
          "load: 1-min load average after the run (> cores: others shared them); worker loop "
          "parts: wall seconds (idle: blocked waiting for jobs)")
    write_json(OUT_DIR / "queue.json", {"args": vars(args), "threads": threads,
                                        "uncommitted": uncommitted(), **results})


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
