"""Gateway overhead: one Poisson arrival trace through the gateway with the official ``openai``
SDK, and the same trace through ``AsyncClient`` directly, against the same worker; then how many
concurrent SSE streams one gateway process holds.

Processes: a private redis-server, one worker (``python -m worker``), the gateway (``python -m
producer.gateway``), and this one, the client (asyncio), so that the gateway's cost shows as it
would in a deployment: its own process, the SDK's parsing in the client.

1. Trace (gateway_trace.py): --num-requests requests arriving at --rate per second, streamed
   through the gateway with the SDK, through the gateway as plain HTTP, and through ``Client``,
   in --repeats alternating rounds: tok/s, TTFT p50 per path, greedy agreement.
2. Streams (gateway_streams.py): --streams chat requests held open at once on a queue whose
   only worker reads nothing; then the gateway's RSS and open files.

Prints a table to stdout and writes benchmarks/out/gateway.json.

    .venv/bin/python benchmarks/gateway.py                  # ~2 minutes on 2 shared cores
    .venv/bin/python benchmarks/gateway.py --parts streams --streams 4000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# This folder holds queue.py, which would shadow the standard library's queue (redis-py and
# asyncio's users import it): the folder goes last on the path, after the standard library.
sys.path.append(sys.path.pop(0))

import httpx2
import openai
import redis
from common import OUT_DIR, format_table, git_revision, load_average, model_path, write_json
from gateway_streams import HOLD, KEY, streams_part
from gateway_trace import QUEUE, trace, trace_part

from producer.rq_mirror import register_worker
from worker.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent


def spawn(args: list[str], log_name: str) -> subprocess.Popen:
    out = open(OUT_DIR / log_name, "w")  # noqa: SIM115 - the child keeps it
    return subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stdout=out,
                            stderr=subprocess.STDOUT, env=os.environ | {"HF_HUB_OFFLINE": "1"})


def wait(condition: Any, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except (OSError, httpx2.HTTPError, openai.APIError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def run(main: Any, loop: str) -> Any:
    """``main`` on asyncio's own event loop, or on uvloop's (as a client inside a uvicorn app
    would be)."""
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mid")
    parser.add_argument("--threads", type=int, default=1, help="the worker's torch threads")
    parser.add_argument("--parts", default="trace,streams")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client-loop", choices=("asyncio", "uvloop"), default="asyncio",
                        help="this process's event loop (uvicorn runs the gateway on uvloop)")
    args = parser.parse_args()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = model_path(args.model)
    server = RedisServer(data_dir=OUT_DIR / "gateway-redis").start()
    port = free_port()
    base_url = f"http://127.0.0.1:{port}/v1"
    procs = [spawn(["worker", "--redis-url", server.url, "--queue", QUEUE, "--model", str(path),
                    "--device", "cpu", "--dtype", "float32", "--threads", str(args.threads)],
                   "gateway-worker.log"),
             spawn(["producer.gateway", "--redis-url", server.url, "--port", str(port),
                    "--api-key", KEY], "gateway-gateway.log")]
    result: dict[str, Any] = {"model": args.model, "args": vars(args), "git": git_revision()}
    try:
        sdk = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0)
        wait(lambda: any(m.id == QUEUE for m in sdk.models.list().data), "the worker")
        if "trace" in args.parts:
            result["trace"] = run(trace_part(args, base_url, server.url, trace(args, path),
                                             procs[1].pid), args.client_loop)
        if "streams" in args.parts:
            register_worker(redis.Redis.from_url(server.url), "asleep", [HOLD], ttl=600)
            wait(lambda: any(m.id == HOLD for m in sdk.models.list().data), "the hold queue")
            result["streams"] = run(streams_part(args, base_url, procs[1].pid), args.client_loop)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
        server.stop()
    result["load_average_end"] = load_average()
    rows = []
    if "trace" in result:
        t = result["trace"]
        rows += [["throughput ratio (gateway / client)", f"{t['throughput_ratio']:.3f}"],
                 ["best tok/s gateway / client",
                  f"{t['best_tok_s']['gateway']:.1f} / {t['best_tok_s']['client']:.1f}"],
                 ["TTFT p50 gateway (SDK) / gateway (plain HTTP) / client (ms)",
                  " / ".join(f"{t['ttft_p50_ms'][p]:.1f}" for p in ("gateway", "http", "client"))],
                 ["added TTFT p50 (ms), SDK", f"{t['added_ttft_p50_ms']:.1f}"],
                 ["added TTFT p50 (ms), plain HTTP", f"{t['added_ttft_p50_ms_without_sdk']:.1f}"],
                 ["gateway CPU per token, gateway rounds (ms)",
                  f"{min(r['gateway_cpu_ms_per_token'] for r in t['rounds']['gateway']):.3f}"],
                 ["greedy agreement", "agree" if t["greedy_agreement"] else "DIFFER"]]
    if "streams" in result:
        s = result["streams"]
        rows += [["concurrent SSE streams held", f"{s['held']} of {s['requested']}"],
                 ["gateway RSS (MiB) / open files",
                  f"{s['gateway_rss_mib']:.0f} / {s['gateway_open_files']}"]]
    print(format_table(["gateway benchmark", "value"], rows))
    write_json(OUT_DIR / "gateway.json", result)


if __name__ == "__main__":
    main()
