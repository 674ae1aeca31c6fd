"""benchmarks/queue.py's clients, each run in a child process of its own (``queue.py _client
MODE SPEC``, started by ``run_client``) so that no client takes the worker's GIL: each reads its
spec (JSON) and prints its figures (JSON)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from producer import Client

QUEUE_PY = Path(__file__).resolve().parent / "queue.py"  # its ``_client`` mode runs client_main
CLIENT_TIMEOUT_S = 600.0
POLL_WINDOW = 512  # result streams checked per round trip while waiting for the jobs part


def run_client(mode: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Runs a client mode in a child process; returns what it printed (JSON)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="pagedq-bench-") as f:
        json.dump(spec, f)
        f.flush()
        out = subprocess.run([sys.executable, str(QUEUE_PY), "_client", mode, f.name],
                             stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout)


def _client_generate(client: Client, spec: dict[str, Any]) -> dict[str, Any]:
    for h in client.submit_many(spec["warm_up"]):
        h.result(timeout=CLIENT_TIMEOUT_S)
    wall, cpu = time.perf_counter(), time.process_time()
    handles = client.submit_many(spec["jobs"])
    results = [h.result(timeout=CLIENT_TIMEOUT_S) for h in handles]
    return {"seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu,
            "token_ids": [r.outputs[0].token_ids for r in results]}


def _client_latency(client: Client, spec: dict[str, Any]) -> dict[str, Any]:
    from producer.protocol import Chunk

    ids = [uuid.uuid4().hex for _ in spec["jobs"]]
    received: dict[str, list[tuple[int, int, float]]] = {i: [] for i in ids}
    errors: list[Exception] = []
    ready = threading.Barrier(len(ids) + 1)

    def read(job_id: str) -> None:
        counts: dict[int, int] = defaultdict(int)
        ready.wait()
        try:
            for event in client.job(job_id).stream(timeout=CLIENT_TIMEOUT_S):
                now = time.perf_counter()
                if isinstance(event, Chunk):
                    received[job_id].append((event.sample, counts[event.sample], now))
                    counts[event.sample] += len(event.token_ids)
        except Exception as exc:  # re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in ids]
    for t in threads:
        t.start()
    ready.wait()
    time.sleep(0.5)  # every reader is blocked in XREAD on its (empty) result stream
    client.submit_many([job | {"job_id": i} for i, job in zip(ids, spec["jobs"], strict=True)])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return {"received": received}


def _client_jobs(client: Client, spec: dict[str, Any]) -> dict[str, Any]:
    from producer.core import decode_entries
    from producer.protocol import End, Error, results_key

    jobs, batch = spec["jobs"], spec["batch"]
    wall, cpu = time.perf_counter(), time.process_time()
    pending: list[str] = []
    for start in range(0, len(jobs), batch):
        pending += [h.id for h in client.submit_many(jobs[start:start + batch])]
    submitted = time.perf_counter() - wall
    failed, polls = 0, 0
    deadline = time.monotonic() + CLIENT_TIMEOUT_S
    while pending:
        window = pending[:POLL_WINDOW]
        with client.redis.pipeline(transaction=False) as pipe:
            for job_id in window:
                pipe.xrevrange(results_key(job_id), count=1)
            replies = pipe.execute()
        polls += 1
        left = []
        for job_id, entries in zip(window, replies, strict=True):
            last = decode_entries(entries)[-1][1] if entries else None
            if isinstance(last, End | Error):
                failed += isinstance(last, Error)
            else:
                left.append(job_id)
        pending = left + pending[POLL_WINDOW:]
        if pending:  # jobs end in about submission order, many per worker round trip
            client.job(pending[0]).result(timeout=deadline - time.monotonic())
    return {"seconds": time.perf_counter() - wall, "submit_seconds": submitted,
            "cpu_seconds": time.process_time() - cpu, "failed": failed, "polls": polls}


CLIENT_MODES = {"generate": _client_generate, "latency": _client_latency, "jobs": _client_jobs}


def client_main(mode: str, spec_path: str) -> None:
    from producer import Client

    spec = json.loads(Path(spec_path).read_text())
    with Client(spec["url"], queue=spec["queue"], max_queue_len=None) as client:
        print(json.dumps(CLIENT_MODES[mode](client, spec)))
