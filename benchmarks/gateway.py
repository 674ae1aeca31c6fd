"""Gateway overhead: one Poisson arrival trace through the gateway with the official ``openai``
SDK, and the same trace through ``AsyncClient`` directly, against the same worker; then how many
concurrent SSE streams one gateway process holds.

Processes: a private redis-server, one worker (``python -m worker``), the gateway (``python -m
producer.gateway``), and this one, the client (asyncio), so that the gateway's cost shows as it
would in a deployment: its own process, the SDK's parsing in the client.

1. Trace: --num-requests requests of random token ids (--prompt-len), arriving with
   exponential gaps at --rate per second (seeded), each greedy with ``ignore_eos`` and
   max_tokens uniform in [--min-output, --max-output]; every path streams (SDK:
   ``completions.create(stream=True)`` with the ids as the prompt; plain HTTP: the same JSON
   posted with httpx, its SSE lines parsed here, which tells the gateway's own cost from the
   SDK's work in the client; Client: ``submit`` + ``stream()``). The paths alternate, --repeats
   rounds of (gateway, http, client). Figures: tok/s over a round's wall (first send to last
   token), TTFT (send to first token) p50 per path; the ratio of the best gateway tok/s to the
   best client tok/s, and the median TTFT p50 of each gateway path less the client's. Greedy
   agreement: every request's text equal on every path.
2. Streams: --streams chat requests at once, streamed, to a queue whose only worker is a live
   RQ record that reads nothing: each request is admitted (200, its role chunk sent) and held
   open. Counted once the SDK returns the stream; then the gateway's RSS and open files; then
   all closed (their jobs canceled).

    .venv/bin/python benchmarks/gateway.py                  # ~2 minutes on 2 shared cores
    .venv/bin/python benchmarks/gateway.py --parts streams --streams 4000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# This folder holds queue.py, which would shadow the standard library's queue (redis-py and
# asyncio's users import it): the folder goes last on the path, after the standard library.
sys.path.append(sys.path.pop(0))

import httpx2
import numpy as np
import openai
import redis
from common import (
    OUT_DIR,
    format_table,
    git_revision,
    load_average,
    log,
    model_path,
    random_prompt,
    usable_token_ids,
    write_json,
)
from gateway_streams import HOLD, KEY, streams_part
from proctree import process_cpu_seconds

from producer import AsyncClient
from producer.protocol import Chunk, End
from producer.rq_mirror import register_worker
from worker.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent
QUEUE = "bench"


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


def trace(args: argparse.Namespace, path: Path) -> list[dict[str, Any]]:
    rng = np.random.default_rng(args.seed)
    ids = usable_token_ids(path)
    gaps = rng.exponential(1 / args.rate, args.num_requests)
    return [{"at": float(at), "prompt": random_prompt(rng, ids, args.prompt_len),
             "max_tokens": int(rng.integers(args.min_output, args.max_output + 1))}
            for at in np.cumsum(gaps) - gaps[0]]


async def via_gateway(sdk: openai.AsyncOpenAI, request: dict[str, Any]) -> dict[str, Any]:
    sent, first, text, tokens = time.perf_counter(), None, "", 0
    stream = await sdk.completions.create(
        model=QUEUE, prompt=request["prompt"], max_tokens=request["max_tokens"], temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and first is None:
            first = time.perf_counter()
        text += "".join(c.text for c in chunk.choices)
        tokens = chunk.usage.completion_tokens if chunk.usage else tokens
    return {"ttft": first - sent, "tokens": tokens, "text": text}


async def via_http(http: httpx2.AsyncClient, base_url: str, request: dict[str, Any]
                   ) -> dict[str, Any]:
    """The gateway without the SDK: the same request as JSON, its SSE lines read as they come
    (what the gateway itself adds, apart from the SDK's own work in the client)."""
    sent, first, text, tokens = time.perf_counter(), None, "", 0
    body = {"model": QUEUE, "prompt": request["prompt"], "max_tokens": request["max_tokens"],
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    async with http.stream("POST", f"{base_url}/completions", json=body,
                           headers={"Authorization": f"Bearer {KEY}"}) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and first is None:
                first = time.perf_counter()
            text += "".join(c["text"] for c in chunk["choices"])
            tokens = chunk["usage"]["completion_tokens"] if chunk.get("usage") else tokens
    return {"ttft": first - sent, "tokens": tokens, "text": text}


async def via_client(client: AsyncClient, request: dict[str, Any]) -> dict[str, Any]:
    sent, first, text, tokens = time.perf_counter(), None, "", 0
    job = await client.submit(request["prompt"], max_tokens=request["max_tokens"],
                              temperature=0, ignore_eos=True)
    async for event in job.stream():
        if isinstance(event, Chunk) and first is None:
            first = time.perf_counter()
        if isinstance(event, Chunk):
            text += event.text
        elif isinstance(event, End):
            tokens = event.usage.completion_tokens
    return {"ttft": first - sent, "tokens": tokens, "text": text}


async def run_round(send: Any, requests: list[dict[str, Any]], gateway_pid: int
                    ) -> dict[str, Any]:
    start, cpu = time.perf_counter(), process_cpu_seconds(gateway_pid)

    async def one(request: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, start + request["at"] - time.perf_counter()))
        return await send(request)

    answers = await asyncio.gather(*(one(r) for r in requests))
    wall = time.perf_counter() - start
    tokens = sum(a["tokens"] for a in answers)
    return {"tok_s": tokens / wall, "wall_s": wall,
            "gateway_cpu_ms_per_token": 1000 * (process_cpu_seconds(gateway_pid) - cpu) / tokens,
            "ttft_p50_ms": 1000 * statistics.median(a["ttft"] for a in answers),
            "texts": [a["text"] for a in answers]}


async def trace_part(args: argparse.Namespace, base_url: str, redis_url: str,
                     requests: list[dict[str, Any]], gateway_pid: int) -> dict[str, Any]:
    http = httpx2.AsyncClient(limits=httpx2.Limits(max_connections=None), timeout=600)
    sdk = openai.AsyncOpenAI(base_url=base_url, api_key=KEY, http_client=http, max_retries=0)
    rounds: dict[str, list[dict[str, Any]]] = {"gateway": [], "http": [], "client": []}
    async with AsyncClient(redis_url, QUEUE) as client:
        paths = (("gateway", lambda r: via_gateway(sdk, r)),
                 ("http", lambda r: via_http(http, base_url, r)),
                 ("client", lambda r: via_client(client, r)))
        for _, send in paths:  # warm-up
            await run_round(send, requests[:4], gateway_pid)
        for i in range(args.repeats):
            for name, send in paths:
                result = await run_round(send, requests, gateway_pid)
                rounds[name].append(result)
                log(f"round {i} {name}: {result['tok_s']:.1f} tok/s, TTFT p50 "
                    f"{result['ttft_p50_ms']:.1f} ms, gateway CPU "
                    f"{result['gateway_cpu_ms_per_token']:.3f} ms/token, "
                    f"load {load_average():.2f}")
    await sdk.close()
    agree = all(r["texts"] == rounds["client"][0]["texts"] for rs in rounds.values() for r in rs)
    best = {name: max(r["tok_s"] for r in rs) for name, rs in rounds.items()}
    ttft = {name: statistics.median(r["ttft_p50_ms"] for r in rs) for name, rs in rounds.items()}
    return {"rounds": {n: [{k: v for k, v in r.items() if k != "texts"} for r in rs]
                       for n, rs in rounds.items()},
            "best_tok_s": best, "throughput_ratio": best["gateway"] / best["client"],
            "ttft_p50_ms": ttft, "added_ttft_p50_ms": ttft["gateway"] - ttft["client"],
            "added_ttft_p50_ms_without_sdk": ttft["http"] - ttft["client"],
            "greedy_agreement": agree}


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
