"""``pagedq``: submit prompts, run JSONL batches, cancel jobs and look at a queue.

    pagedq submit "Tell me a joke" --n 2 --max-tokens 64 --temperature 0.8
    pagedq batch jobs.jsonl -o results.jsonl --max-in-flight 64
    pagedq cancel JOB_ID
    pagedq status [--json]

Every command takes ``--redis-url`` (default ``$REDIS_URL``, else redis://localhost:6379/0) and
``--queue``. ``submit`` streams the text as it arrives (one sample), or prints each sample when
it ends (``--n`` > 1); Ctrl-C cancels the job.

``batch``: each input line is a job as a JSON object with submit's keywords (``prompt`` or
``messages``, sampling keys, ``priority``, ``deadline``); blank lines are skipped. Every line is
validated before anything is submitted. Output lines are ``{"line": N, ...JobResult}`` or
``{"line": N, "id", "error": {"code", "message"}}``, in input order (finished results wait for
the earlier ones). A job's id is ``b{sha256 of the input file}-{line}``, so a rerun of the same
file resumes: lines already in the output are skipped (a torn last line is dropped), and jobs
submitted before the interruption are re-attached, not run again (submit is idempotent per id).
An output written from another input is refused. A full queue makes the batch wait and retry.
"""

import argparse
import asyncio
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
from pydantic import ValidationError
from tqdm import tqdm

from . import core
from .aio import AsyncClient
from .client import DEFAULT_URL, Client
from .core import JobFailed, QueueFull
from .protocol import Chunk, Done, End, explain

FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty")
INTS = ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs")
FLAGS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
LISTS = (("stop", str), ("stop_token_ids", int))  # repeatable: --stop A --stop B
SAMPLING_OPTIONS = FLOATS + INTS + FLAGS + tuple(name for name, _ in LISTS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedq", description="Submit prompts, run JSONL batches, cancel jobs, see a queue.")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", DEFAULT_URL))
    parser.add_argument("--queue", default="default")
    commands = parser.add_subparsers(dest="command", required=True)

    submit = commands.add_parser("submit", help="submit one prompt and stream its text")
    submit.add_argument("prompt")
    submit.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    submit.add_argument("--priority", type=int, default=0)
    submit.add_argument("--timeout", type=float, help="seconds without a token before giving up")
    for name in FLOATS + INTS:  # absent options keep SamplingParams' defaults
        submit.add_argument(f"--{name.replace('_', '-')}", type=float if name in FLOATS else int,
                            default=argparse.SUPPRESS)
    for name in FLAGS:
        submit.add_argument(f"--{name.replace('_', '-')}", action=argparse.BooleanOptionalAction,
                            default=argparse.SUPPRESS)
    for name, kind in LISTS:
        submit.add_argument(f"--{name.replace('_', '-')}", type=kind, action="append",
                            default=argparse.SUPPRESS)

    batch = commands.add_parser("batch", help="run a JSONL file of jobs, resumably")
    batch.add_argument("input", type=Path)
    batch.add_argument("-o", "--output", type=Path, required=True)
    batch.add_argument("--max-in-flight", type=int, default=32)
    batch.add_argument("--timeout", type=float, help="seconds to wait for each job")

    cancel = commands.add_parser("cancel", help="cancel a job")
    cancel.add_argument("job_id")

    status = commands.add_parser("status", help="queue depth, consumers, dead letters, workers")
    status.add_argument("--json", action="store_true")
    return parser


def cmd_submit(client: Client, args: argparse.Namespace) -> int:
    sampling = {name: getattr(args, name) for name in SAMPLING_OPTIONS if hasattr(args, name)}
    prompt = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat \
        else {"prompt": args.prompt}
    job = client.submit(**prompt, priority=args.priority, **sampling)
    print(f"job {job.id}", file=sys.stderr)
    live = sampling.get("n", 1) == 1  # one sample streams; several print as each one ends
    texts: dict[int, str] = {}
    try:
        for event in job.stream(timeout=args.timeout):
            if isinstance(event, Chunk):
                texts[event.sample] = texts.get(event.sample, "") + event.text
                if live:
                    print(event.text, end="", flush=True)
            elif isinstance(event, Done):
                text = texts.get(event.sample, "")
                head = "" if live else f"--- sample {event.sample} ---\n{text}"
                print(f"{head}\n[{event.finish_reason}]", flush=True)
            elif isinstance(event, End):
                print(f"usage: {event.usage.prompt_tokens} prompt tokens, "
                      f"{event.usage.completion_tokens} completion tokens", file=sys.stderr)
    except KeyboardInterrupt:
        job.cancel()
        print(f"\ncanceled {job.id}", file=sys.stderr)
        return 130
    return 0


def read_batch(path: Path, queue: str) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, submit keywords with job_id)`` per job line; validates them all."""
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()[:16]
    specs = []
    for number, line in enumerate(data.decode().splitlines(), 1):
        if not line.strip():
            continue
        try:
            spec = json.loads(line)
            if not isinstance(spec, dict):
                raise ValueError("a job must be a JSON object")
            spec["job_id"] = f"b{digest}-{number}"
            core.new_job(queue, **spec)
        except (ValueError, TypeError) as e:  # ValidationError is a ValueError
            raise SystemExit(f"{path}:{number}: {explain(e)}") from None
        specs.append((number, spec))
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


async def run_batch(client: AsyncClient, todo: list[tuple[int, dict[str, Any]]], out: Any,
                    max_in_flight: int, timeout: float | None, bar: tqdm) -> None:
    results: dict[int, dict[str, Any]] = {}
    written = 0  # todo[:written] are in the output

    async def run(k: int) -> dict[str, Any]:
        number, spec = todo[k]
        while True:
            try:
                job = await client.submit(**spec)
                break
            except QueueFull:
                await asyncio.sleep(1.0)
        try:
            return {"line": number, **(await job.result(timeout)).model_dump(mode="json")}
        except JobFailed as e:
            return {"line": number, "id": job.id, "error": {"code": e.code, "message": e.message}}

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


def cmd_batch(url: str, queue: str, args: argparse.Namespace) -> int:
    specs = read_batch(args.input, queue)
    done = done_lines(args.output)
    if any(done.get(n, spec["job_id"]) != spec["job_id"] for n, spec in specs):
        raise SystemExit(f"{args.output} holds results of another input: choose another output")
    todo = [(n, spec) for n, spec in specs if n not in done]
    if done:
        print(f"resuming: {len(specs) - len(todo)} of {len(specs)} lines already done",
              file=sys.stderr)

    async def go() -> None:
        async with AsyncClient(url, queue) as client:
            with args.output.open("a") as out, tqdm(total=len(specs), initial=len(specs) -
                                                    len(todo), unit="job", file=sys.stderr) as bar:
                await run_batch(client, todo, out, args.max_in_flight, args.timeout, bar)

    asyncio.run(go())
    return 0


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    stats = client.stats()
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print(f"queue {stats['queue']}: {stats['length']} entries, {stats['lag']} not yet delivered, "
          f"{stats['pending']} pending, {stats['dead_letters']} dead letters")
    for c in stats["consumers"]:
        print(f"  consumer {c['name']}: {c['pending']} pending, idle {c['idle'] / 1000:.1f} s")
    for w in stats["workers"]:
        print(f"  worker {w['name']}: {w.get('state', '?')}, last heartbeat "
              f"{w.get('last_heartbeat', '?')}")
    if not stats["workers"]:
        print("  no workers")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "batch":
            try:
                return cmd_batch(args.redis_url, args.queue, args)
            except KeyboardInterrupt:
                print("\ninterrupted: run the same command again to resume", file=sys.stderr)
                return 130
        with Client(args.redis_url, args.queue) as client:
            if args.command == "submit":
                return cmd_submit(client, args)
            if args.command == "cancel":
                client.job(args.job_id).cancel()
                print(f"cancel requested for {args.job_id}")
                return 0
            return cmd_status(client, args)
    except ValidationError as e:
        print(f"error: invalid job: {explain(e)}", file=sys.stderr)
        return 2
    except (QueueFull, JobFailed, TimeoutError, redis.RedisError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
