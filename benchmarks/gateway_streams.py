"""benchmarks/gateway.py's second part: how many concurrent SSE streams one gateway process
holds. --streams chat requests at once, streamed, to a queue whose only worker is a live RQ
record that reads nothing: each request is admitted (200, its role chunk sent) and held open.
Counted once the SDK returns the stream; then the gateway's RSS and open files; then all closed
(their jobs canceled)."""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx2
import openai
from common import log

HOLD, KEY = "hold", "bench-key"  # the held streams' queue; the gateway's API key


async def streams_part(args: argparse.Namespace, base_url: str, gateway_pid: int
                       ) -> dict[str, Any]:
    http = httpx2.AsyncClient(limits=httpx2.Limits(max_connections=None), timeout=600)
    sdk = openai.AsyncOpenAI(base_url=base_url, api_key=KEY, http_client=http, max_retries=0)
    release, opened, failed, waiting = asyncio.Event(), [], [], set()

    async def hold() -> None:
        """Open, the role chunk read, then waiting for a token that never comes: held. An
        error instead (before or after the response began) is a failure."""
        try:
            stream = await sdk.chat.completions.create(
                model=HOLD, messages=[{"role": "user", "content": "wait"}], stream=True)
            events = stream.__aiter__()
            await events.__anext__()
            opened.append(stream)
            waiting.add(stream)
            following = asyncio.ensure_future(events.__anext__())
            await asyncio.wait({following, asyncio.ensure_future(release.wait())},
                               return_when=asyncio.FIRST_COMPLETED)
            waiting.discard(stream)
            if following.done():
                following.result()
            following.cancel()
            await stream.close()
        except openai.APIError as e:
            failed.append(repr(e))

    started = time.perf_counter()
    tasks = [asyncio.ensure_future(hold()) for _ in range(args.streams)]
    while len(opened) + len(failed) < args.streams and time.perf_counter() - started < 120:
        await asyncio.sleep(0.1)
    held_s = time.perf_counter() - started
    await asyncio.sleep(2.0)  # errors that follow an open stream arrive at once
    held = len(waiting)
    status = Path(f"/proc/{gateway_pid}/status").read_text()
    rss = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
    files = len(os.listdir(f"/proc/{gateway_pid}/fd"))
    release.set()
    await asyncio.gather(*tasks)
    await sdk.close()
    log(f"{held} of {args.streams} streams held at once ({len(failed)} failed), "
        f"gateway RSS {rss / 1024:.0f} MiB, {files} open files")
    return {"requested": args.streams, "held": held, "failed": len(failed),
            "first_failures": sorted(set(failed))[:3], "seconds_to_open": held_s,
            "gateway_rss_mib": rss / 1024, "gateway_open_files": files}
