"""benchmarks/queue.py's report: one table of the parts' figures against their targets, a line
of detail per part, and benchmarks/out/queue.json with the arguments and every figure."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path
from typing import Any

from common import OUT_DIR, format_table, write_json

ROOT = Path(__file__).resolve().parent.parent
TARGET_RATIO = 0.95
TARGET_P50_MS = 5.0
TARGET_JOBS_S = 1000.0


def uncommitted() -> list[str]:
    """Files of the code under test that differ from HEAD (others may be editing them)."""
    out = subprocess.run(["git", "status", "--porcelain", "--", "engine", "kernels", "worker",
                          "producer"], cwd=ROOT, capture_output=True, text=True,
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
    interval = results.get("stream_interval_ms")  # the worker's, as resolved
    print(f"\n== queue: one worker (in-process thread, stream interval "
          f"{'-' if interval is None else f'{interval:g}'} ms), {threads} torch thread(s), "
          f"clients in a child process, private redis-server ==")
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
