"""``pagedq batch``: a JSONL file of jobs, run resumably.

Input: one JSON object per line (blank lines are skipped), in any of three shapes:

- submit's keywords, flat: ``{"prompt": "Hi", "max_tokens": 32, "temperature": 0.7}``
  (``prompt`` or ``messages``; sampling keys; ``priority``; ``deadline``);
- the protocol's Job: ``{"prompt": "Hi", "sampling": {"max_tokens": 32}, "priority": 1}``
  (its ``v``, ``id``, ``queue`` and ``created_at`` are ignored: the batch names its jobs and
  ``--queue`` picks the queue);
- OpenAI's batch line: ``{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
  "body": {...}}``, one prompt per line, its ``body.model`` ignored (``--queue`` decides).

Every line is checked before anything is submitted; each bad one is reported with its number,
and then nothing runs. Output lines are ``{"line": N, ...JobResult}`` or ``{"line": N, "id",
"error": {"code", "message"}}`` (with ``custom_id`` for OpenAI lines), in input order. A job's
id is ``b{sha256 of the input file}-{line}``, so a rerun of the same file resumes: lines already
in the output are skipped (a torn last line is dropped), and jobs submitted before the
interruption are re-attached, not run again. An output written from another input is refused.
A full queue makes the batch wait and retry.
"""

import asyncio
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from . import core
from .aio import AsyncClient
from .core import JobFailed, QueueFull
from .gateway.schemas import BatchLine
from .protocol import explain

IGNORED_JOB_FIELDS = ("v", "id", "queue", "created_at")


def line_spec(record: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """One input line as (submit's keywords, what its output line repeats)."""
    if not isinstance(record, dict):
        raise ValueError("a line must be a JSON object")
    if "custom_id" in record:
        line = BatchLine.model_validate(record)
        specs = line.request().specs()
        if len(specs) != 1:
            raise ValueError("one prompt per line")
        return specs[0], {"custom_id": line.custom_id}
    if "sampling" in record:
        if not isinstance(record["sampling"], dict):
            raise ValueError("sampling must be an object")
        job = {k: v for k, v in record.items() if k not in IGNORED_JOB_FIELDS}
        return {**job.pop("sampling"), **job}, {}
    return record, {}


def read_batch(path: Path, queue: str) -> list[tuple[int, dict[str, Any], dict[str, Any]]]:
    """``(line number, submit keywords with job_id, extra output fields)`` per job line; checks
    them all and exits naming every bad line."""
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()[:16]
    specs, errors = [], []
    for number, text in enumerate(data.decode().splitlines(), 1):
        if not text.strip():
            continue
        try:
            spec, extra = line_spec(json.loads(text))
            spec["job_id"] = f"b{digest}-{number}"
            core.new_job(queue, **spec)
        except (ValueError, TypeError) as e:  # JSON, pydantic and InvalidJob are ValueErrors
            errors.append(f"{path}:{number}: {explain(e)}")
            continue
        specs.append((number, spec, extra))
    if errors:
        raise SystemExit("\n".join(errors) + f"\n{len(errors)} bad lines: nothing was submitted")
    return specs


def done_lines(path: Path) -> dict[int, str]:
    """``{line number: job id}`` already in the output; drops a torn last line left by an
    interruption."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        path.write_bytes(data)
    records = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
    return {record["line"]: record["id"] for record in records}


async def run_batch(client: AsyncClient, todo: list[tuple[int, dict[str, Any], dict[str, Any]]],
                    out: Any, max_in_flight: int, timeout: float | None, bar: tqdm) -> None:
    results: dict[int, dict[str, Any]] = {}
    written = 0  # todo[:written] are in the output

    async def run(k: int) -> dict[str, Any]:
        number, spec, extra = todo[k]
        while True:
            try:
                job = await client.submit(**spec)
                break
            except QueueFull:
                await asyncio.sleep(1.0)
        try:
            return {"line": number, **extra, **(await job.result(timeout)).model_dump(mode="json")}
        except JobFailed as e:
            return {"line": number, **extra, "id": job.id,
                    "error": {"code": e.code, "message": e.message}}

    async def lane(ks: Iterator[int]) -> None:
        nonlocal written
        for k in ks:  # the lanes share one iterator: a free lane takes the next job
            results[k] = await run(k)
            bar.update(1)
            while written in results:  # write the finished prefix, in input order
                out.write(json.dumps(results.pop(written)) + "\n")
                written += 1
            out.flush()

    ks = iter(range(len(todo)))
    await asyncio.gather(*(lane(ks) for _ in range(max(1, min(max_in_flight, len(todo))))))


def cmd_batch(url: str, queue: str, input_path: Path, output: Path, max_in_flight: int,
              timeout: float | None, err: Any) -> int:
    specs = read_batch(input_path, queue)
    done = done_lines(output)
    if any(done.get(n, spec["job_id"]) != spec["job_id"] for n, spec, _ in specs):
        raise SystemExit(f"{output} holds results of another input: choose another output")
    todo = [line for line in specs if line[0] not in done]
    if done:
        print(f"resuming: {len(specs) - len(todo)} of {len(specs)} lines already done",
              file=err)

    async def go() -> None:
        async with AsyncClient(url, queue) as client:
            with output.open("a") as out, tqdm(total=len(specs), initial=len(specs) - len(todo),
                                               unit="job", file=err) as bar:
                await run_batch(client, todo, out, max_in_flight, timeout, bar)

    asyncio.run(go())
    return 0
