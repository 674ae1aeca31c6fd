"""``pagedq``: submit prompts, run JSONL batches, cancel jobs and look at a queue.

    pagedq submit "Tell me a joke" --n 2 --max-tokens 64 --temperature 0.8
    pagedq batch jobs.jsonl -o results.jsonl --max-in-flight 64
    pagedq cancel JOB_ID
    pagedq status [--json]

Every command takes ``--redis-url`` (default ``$PAGEDQ_REDIS_URL``, else ``$REDIS_URL``, else
redis://localhost:6379/0) and ``--queue`` (default ``$PAGEDQ_QUEUE``, else ``default``): the
worker's variables. Redis is pinged once first, without retries, so a wrong URL fails at once.
``submit`` streams the text as it arrives; with ``--n`` > 1 the samples stream one after
another (the first live, each next one from where it has got to when the previous ends); Ctrl-C
cancels the job. ``max_tokens`` defaults to 16, as in vLLM. ``batch``: see ``cli_batch``.
``cancel`` refuses ids that are malformed, unknown (or expired) or already ended, and then sets
no key.
"""

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any

import redis
from pydantic import TypeAdapter, ValidationError
from redis.backoff import NoBackoff
from redis.retry import Retry

from .cli_batch import cmd_batch
from .client import DEFAULT_URL, Client
from .core import InvalidJob, JobFailed, QueueFull
from .protocol import Chunk, Done, End, Job, Sampling, results_key
from .rq_mirror import job_key

FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "length_penalty")
INTS = ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "beam_width")
FLAGS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
LISTS = (("stop", str), ("stop_token_ids", int))  # repeatable: --stop A --stop B
CHOICES = {"early_stopping": {"false": False, "true": True, "never": "never"}}  # beam search
SAMPLING_OPTIONS = FLOATS + INTS + FLAGS + tuple(name for name, _ in LISTS) + tuple(CHOICES)
ENDED = ("finished", "failed", "canceled")
_JOB_ID = TypeAdapter(Annotated[str, Job.model_fields["id"]])


def build_parser() -> argparse.ArgumentParser:
    shown = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(
        prog="pagedq", formatter_class=shown,
        description="Submit prompts, run JSONL batches, cancel jobs, see a queue.")
    parser.add_argument("--redis-url", help="env PAGEDQ_REDIS_URL or REDIS_URL",
                        default=os.environ.get("PAGEDQ_REDIS_URL")
                        or os.environ.get("REDIS_URL") or DEFAULT_URL)
    parser.add_argument("--queue", default=os.environ.get("PAGEDQ_QUEUE") or "default",
                        help="env PAGEDQ_QUEUE")
    commands = parser.add_subparsers(dest="command", required=True)

    submit = commands.add_parser("submit", help="submit one prompt and stream its text",
                                 formatter_class=shown)
    submit.add_argument("prompt")
    submit.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    submit.add_argument("--priority", type=int, default=0, help="lower runs first")
    submit.add_argument("--timeout", type=float, help="seconds without a token before giving up")
    for name in SAMPLING_OPTIONS:  # absent options keep SamplingParams' defaults
        option, field = f"--{name.replace('_', '-')}", Sampling.model_fields[name]
        default = field.get_default(call_default_factory=True)
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": f"default: {default}"}
        if name in FLAGS:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif name in INTS or name in FLOATS:
            kwargs["type"] = float if name in FLOATS else int
        elif name in CHOICES:
            kwargs |= {"type": CHOICES[name].__getitem__, "choices": list(CHOICES[name].values())}
        else:
            kwargs |= {"type": dict(LISTS)[name], "action": "append"}
        submit.add_argument(option, **kwargs)

    batch = commands.add_parser("batch", help="run a JSONL file of jobs, resumably",
                                formatter_class=shown)
    batch.add_argument("input", type=Path)
    batch.add_argument("-o", "--output", type=Path, required=True)
    batch.add_argument("--max-in-flight", type=int, default=32)
    batch.add_argument("--timeout", type=float, help="seconds to wait for each job")

    cancel = commands.add_parser("cancel", help="cancel a queued or running job")
    cancel.add_argument("job_id")

    status = commands.add_parser("status", help="queue depth, consumers, dead letters, workers")
    status.add_argument("--json", action="store_true")
    return parser


def out(text: str) -> None:
    print(text, end="", flush=True)


class SamplePrinter:
    """Streams a job's samples one after another: the current one live, the others kept until
    it ends, then shown (what they have so far) and continued live."""

    def __init__(self, n: int) -> None:
        self.n, self.current = n, 0
        self.texts = [""] * n
        self.reasons: list[str | None] = [None] * n
        self._open()

    def _open(self) -> None:
        if self.n > 1:
            out(f"--- sample {self.current} ---\n{self.texts[self.current]}")

    def chunk(self, event: Chunk) -> None:
        self.texts[event.sample] += event.text
        if event.sample == self.current:
            out(event.text)

    def done(self, event: Done) -> None:
        score = "" if event.cum_logprob is None else f" {event.cum_logprob:.4f}"  # a beam's
        self.reasons[event.sample] = f"{event.finish_reason}{score}"
        while self.current < self.n and self.reasons[self.current] is not None:
            out(f"\n[{self.reasons[self.current]}]\n")
            self.current += 1
            if self.current < self.n:
                self._open()


def cmd_submit(client: Client, args: argparse.Namespace) -> int:
    sampling = {name: getattr(args, name) for name in SAMPLING_OPTIONS if hasattr(args, name)}
    prompt = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat \
        else {"prompt": args.prompt}
    job = client.submit(**prompt, priority=args.priority, **sampling)
    print(f"job {job.id}", file=sys.stderr)
    # One sample streams; several (or beams, ranked only at the end) print one after another.
    printer = SamplePrinter(max(sampling.get("n", 1), sampling.get("beam_width", 1)))
    try:
        for event in job.stream(timeout=args.timeout):
            if isinstance(event, Chunk):
                printer.chunk(event)
            elif isinstance(event, Done):
                printer.done(event)
            elif isinstance(event, End):
                print(f"usage: {event.usage.prompt_tokens} prompt tokens, "
                      f"{event.usage.completion_tokens} completion tokens", file=sys.stderr)
    except KeyboardInterrupt:
        job.cancel()
        print(f"\ncanceled {job.id}", file=sys.stderr)
        return 130
    return 0


def cmd_cancel(client: Client, job_id: str) -> int:
    try:
        _JOB_ID.validate_python(job_id)
    except ValidationError:
        print(f"error: {job_id!r} is no job id (1-128 of A-Z a-z 0-9 _ -)", file=sys.stderr)
        return 2
    if not client.redis.exists(job_key(job_id), results_key(job_id)):
        print(f"error: no job {job_id} (unknown, or ended and expired)", file=sys.stderr)
        return 1
    status = client.job(job_id).status()
    if status in ENDED:
        print(f"error: job {job_id} is already {status}: nothing to cancel", file=sys.stderr)
        return 1
    client.job(job_id).cancel()
    print(f"cancel requested for {job_id} ({status})")
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


def check_reachable(url: str) -> None:
    """One ping without retries: a wrong URL fails now, not after the client's backoff."""
    conn = redis.Redis.from_url(url, socket_connect_timeout=3, retry=Retry(NoBackoff(), 0))
    try:
        conn.ping()
    except redis.RedisError as e:
        shown = re.sub(r"//[^@/]*@", "//***@", url)  # no password in the message
        raise SystemExit(f"error: cannot reach Redis at {shown}: {e} (is it running? set "
                         "--redis-url or PAGEDQ_REDIS_URL)") from None
    finally:
        conn.close()


def run(args: argparse.Namespace) -> int:
    check_reachable(args.redis_url)
    if args.command == "batch":
        try:
            return cmd_batch(args.redis_url, args.queue, args.input, args.output,
                             args.max_in_flight, args.timeout, sys.stderr)
        except KeyboardInterrupt:
            print("\ninterrupted: run the same command again to resume", file=sys.stderr)
            return 130
    with Client(args.redis_url, args.queue) as client:
        if args.command == "submit":
            return cmd_submit(client, args)
        if args.command == "cancel":
            return cmd_cancel(client, args.job_id)
        return cmd_status(client, args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except InvalidJob as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (QueueFull, JobFailed, TimeoutError, redis.RedisError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away (`pagedq status | head -1`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
