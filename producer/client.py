"""The synchronous client: what a backend app imports to submit jobs and read their results.

    client = Client("redis://localhost:6379/0", queue="default")
    job = client.submit("Tell me a joke", n=2, max_tokens=64, temperature=0.8)
    for event in job.stream():          # Chunk, Done, ..., End, in order
        ...
    result = job.result(timeout=60)     # result.outputs[i].text / .token_ids / .finish_reason

Decisions:
- Submitting is one Lua script per batch (``rq_mirror.enqueue_ops``): the length check, the
  stream entry and the RQ record are atomic, and a batch is all or nothing. Past
  ``max_queue_len`` jobs not yet delivered to a worker, ``QueueFull`` is raised and nothing is
  added. ``max_queue_len=None``: no limit.
- A job id given by the caller is an idempotency key: submitting an id that exists (queued,
  running or with results not yet expired) adds nothing and returns a handle to that job. So
  redis-py's retries of a submit whose reply was lost, and resumed batches, never duplicate.
- Connection errors and timeouts are retried by redis-py with exponential backoff
  (``retries`` attempts, ``backoff_base`` doubling up to ``backoff_cap`` seconds); the reader
  keeps the id of the last entry each handle saw, so after a reconnect it resumes there: no
  event is lost or repeated.
- One reader thread per client reads every stream its handles wait on (``producer.mux``);
  connections are at most ``max_connections`` (16: the reader's, the wake-ups', the commands'),
  and a thread that finds them all busy waits up to ``pool_timeout`` seconds for one.
- ``stream(timeout)`` bounds the silence between events; ``result(timeout)`` the whole wait.
  Both raise ``TimeoutError``; an ``error`` event raises ``JobFailed``.
- ``cancel()`` sets ``pagedq:cancel:{id}`` for ``cancel_ttl`` seconds and adds a notice to
  ``pagedq:cancels`` (one pipeline, not a transaction: producers hold no MULTI); the worker
  aborts the job within one engine step and ends its samples with finish reason ``abort``.
"""

import queue
from collections.abc import Iterable, Iterator
from typing import Any, cast

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from . import core
from .core import Entries, JobFailed, JobResult, Reader
from .mux import Mux
from .protocol import GROUP, Error, Event, dead_key, queue_key, results_key
from .rq_mirror import enqueue_ops, enqueue_reply, worker_key

DEFAULT_URL = "redis://localhost:6379/0"
CANCEL_TTL = 24 * 3600  # long enough for a queued job to be picked up and see it
MAX_CONNECTIONS = 16
POOL_TIMEOUT = 30.0


class JobHandle:
    def __init__(self, client: "Client", job_id: str) -> None:
        self.client, self.id = client, job_id

    def __repr__(self) -> str:
        return f"JobHandle({self.id!r})"

    def _read(self, reader: Reader, backlog: bool = False) -> Iterator[Event]:
        """The job's events as they come. ``backlog``: first read what the stream already
        holds with one XRANGE, so a job that has ended costs one round trip and never waits
        on the client's reader (joining it takes a wake-up and a new read: 96 ``result()``
        calls in a row on finished jobs took ~1 s that way); ``stream()`` skips it, since it
        is mostly called on a job just submitted, whose stream is empty."""
        cursor = "0-0"
        if backlog:
            entries = cast(Entries, self.client.redis.xrange(results_key(self.id)))
            yield from reader.feed(entries)
            cursor = entries[-1][0] if entries else cursor
        if reader.done:
            return
        mux = self.client.mux
        sub = mux.subscribe(self.id, cursor)
        try:
            while not reader.done:
                left = reader.left()  # raises TimeoutError once the time is up
                try:
                    item = sub.inbox.get(timeout=left)
                except queue.Empty:
                    continue
                if isinstance(item, Exception):
                    raise item
                yield from reader.feed(item)
        finally:
            mux.unsubscribe(sub)

    def stream(self, timeout: float | None = None) -> Iterator[Event]:
        """The job's events in order, ending with End; raises JobFailed on an error event and
        TimeoutError after ``timeout`` seconds without an event."""
        for event in self._read(Reader(self.id, timeout, idle=True)):
            if isinstance(event, Error):
                raise JobFailed(self.id, event.code, event.message)
            yield event

    def result(self, timeout: float | None = None) -> JobResult:
        """Waits up to ``timeout`` seconds for the job to end and returns its outputs."""
        return core.fold(self.id, list(self._read(Reader(self.id, timeout), backlog=True)))

    def status(self) -> str:
        """``queued``, ``started``, ``finished``, ``failed`` or ``canceled``."""
        entries = core.decode_entries(
            cast(Entries, self.client.redis.xrange(results_key(self.id))))
        return core.status_of([event for _, event in entries])

    def cancel(self) -> None:
        with self.client.redis.pipeline(transaction=False) as pipe:
            core.cancel_commands(pipe, self.id, self.client.cancel_ttl).execute()


class Client:
    def __init__(self, redis_url: str = DEFAULT_URL, queue: str = "default", *,
                 max_queue_len: int | None = 10_000, retries: int = 10,
                 backoff_base: float = 0.05, backoff_cap: float = 2.0,
                 cancel_ttl: int = CANCEL_TTL, max_connections: int = MAX_CONNECTIONS,
                 pool_timeout: float = POOL_TIMEOUT) -> None:
        self.queue, self.max_queue_len, self.cancel_ttl = queue, max_queue_len, cancel_ttl
        retry = Retry(ExponentialBackoff(cap=backoff_cap, base=backoff_base), retries)
        pool = redis.BlockingConnectionPool.from_url(
            redis_url, max_connections=max_connections, timeout=pool_timeout,
            decode_responses=True, retry=retry,
            retry_on_error=[redis.ConnectionError, redis.TimeoutError])  # redis-py < 6 needs it
        self.redis = redis.Redis(connection_pool=pool)
        self.mux = Mux(self.redis, backoff_base)

    def submit(self, prompt: str | list[int] | None = None, **kwargs: Any) -> JobHandle:
        """Submits one job: ``prompt`` (text or token ids) or ``messages=[{"role", "content"}]``;
        ``priority=`` (lower runs first), ``deadline=`` (unix time), ``job_id=``; the rest are
        SamplingParams' keywords (n, max_tokens, temperature, top_p, seed, stop, ...)."""
        return self.submit_many([{"prompt": prompt, **kwargs}])[0]

    def submit_many(self, specs: Iterable[dict[str, Any]]) -> list[JobHandle]:
        """Submits a batch in one round trip, all or nothing; each spec holds submit's keywords."""
        jobs = core.new_jobs(self.queue, specs)
        if not jobs:
            return []
        with self.redis.pipeline(transaction=False) as pipe:
            enqueue_ops(pipe, jobs, self.max_queue_len)
            enqueue_reply(pipe.execute()[0], self.queue, self.max_queue_len)
        return [JobHandle(self, job.id) for job in jobs]

    def job(self, job_id: str) -> JobHandle:
        """A handle on a job submitted earlier, by id."""
        return JobHandle(self, job_id)

    def stats(self) -> dict[str, Any]:
        """The queue at a glance: stream length, ``lag`` (not yet delivered), ``pending``
        (delivered, not acknowledged), consumers, dead letters and the RQ workers listening."""
        r, key = self.redis, queue_key(self.queue)
        groups = r.xinfo_groups(key) if r.exists(key) else []
        group = next((g for g in groups if g["name"] == GROUP), None)
        consumers = r.xinfo_consumers(key, GROUP) if group else []
        names = sorted(cast(set[str], r.smembers(f"rq:workers:{self.queue}")))
        return {
            "queue": self.queue,
            "length": r.xlen(key),
            "lag": group["lag"] if group else 0,
            "pending": group["pending"] if group else 0,
            "consumers": [{k: c[k] for k in ("name", "pending", "idle")} for c in consumers],
            "dead_letters": r.xlen(dead_key(self.queue)),
            "workers": [{"name": k.removeprefix(worker_key("")), **w}
                        for k in names if (w := r.hgetall(k))],  # expired ones are skipped
        }

    def close(self) -> None:
        self.mux.close()
        self.redis.close()
        self.redis.connection_pool.disconnect()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
