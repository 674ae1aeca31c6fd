"""benchmarks/gateway.py's first part: one Poisson arrival trace through the gateway with the
official ``openai`` SDK, through the gateway as plain HTTP, and through ``AsyncClient`` directly,
against the same worker.

--num-requests requests of random token ids (--prompt-len), arriving with exponential gaps at
--rate per second (seeded), each greedy with ``ignore_eos`` and max_tokens uniform in
[--min-output, --max-output]; every path streams (SDK: ``completions.create(stream=True)`` with
the ids as the prompt; plain HTTP: the same JSON posted with httpx, its SSE lines parsed here,
which tells the gateway's own cost from the SDK's work in the client; Client: ``submit`` +
``stream()``). The paths alternate, --repeats rounds of (gateway, http, client). Figures: tok/s
over a round's wall (first send to last token), TTFT (send to first token) p50 per path; the
ratio of the best gateway tok/s to the best client tok/s, and the median TTFT p50 of each
gateway path less the client's. Greedy agreement: every request's text equal on every path."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx2
import numpy as np
import openai
from common import load_average, log, random_prompt, usable_token_ids
from gateway_streams import KEY
from proctree import process_cpu_seconds

from producer import AsyncClient
from producer.protocol import Chunk, End

QUEUE = "bench"  # the traced requests' queue: the worker's, the model the SDK names


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
