"""The asyncio client: ``Client``'s API with coroutines, on ``redis.asyncio``.

    async with AsyncClient("redis://localhost:6379/0") as client:
        job = await client.submit("Tell me a joke", max_tokens=64)
        async for event in job.stream():
            ...
        result = await job.result(timeout=60)

Same semantics as ``producer.client`` (see its docstring): the same submit script, the same
folding and timeouts (``producer.core``), the same multiplexing reader (``producer.mux``), here
a task of the event loop the first subscription runs in; only the I/O differs.
"""

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any, cast

import redis
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from . import core
from .client import CANCEL_TTL, DEFAULT_URL, MAX_CONNECTIONS, POOL_TIMEOUT
from .core import Entries, JobFailed, JobResult, Reader
from .mux import Streams, Subscription
from .protocol import Error, Event, results_key
from .rq_mirror import enqueue_ops, enqueue_reply


class FairPool(BlockingConnectionPool):
    """redis-py's asyncio ``BlockingConnectionPool`` with a FIFO gate in front: no more callers
    reach its pool than it has connections. Without it, a waiter woken for a freed connection
    queues again for the pool's lock behind every other waiter, so 10,000 concurrent
    ``result()`` calls cost O(n²) and, on two loaded cores, some waited past ``pool_timeout``
    ("No connection available" after 30 s; measured, once in CI)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = asyncio.Semaphore(self.max_connections)

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            async with asyncio.timeout(self.timeout):
                await self.gate.acquire()
        except TimeoutError as err:
            raise redis.ConnectionError("No connection available.") from err
        try:
            return await super().get_connection(*args, **kwargs)
        except BaseException:
            self.gate.release()
            raise

    async def release(self, connection: Any) -> None:
        try:
            await super().release(connection)
        finally:
            self.gate.release()


class AsyncMux:
    """``producer.mux.Mux`` for asyncio: the reader is a task, started by the first
    subscription (it runs in that loop: an ``AsyncClient`` belongs to one loop)."""

    def __init__(self, conn: Redis, backoff: float) -> None:
        self.conn, self.backoff = conn, backoff
        self.streams = Streams()
        self.task: asyncio.Task | None = None

    async def subscribe(self, job_id: str, cursor: str = "0-0") -> Subscription:
        sub = Subscription(job_id, asyncio.Queue(), cursor)
        wake = self.streams.add(sub)
        if self.task is None:
            self.task = asyncio.create_task(self._run(), name="pagedq-reader")
        elif wake:
            async with self.conn.pipeline(transaction=False) as pipe:
                self.streams.wake(pipe)
                await pipe.execute()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self.streams.remove(sub)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def _run(self) -> None:
        failures = 0
        while self.streams.subs:
            try:
                reply = await self.conn.xread(**self.streams.request())
            except redis.RedisError as exc:
                for sub in self.streams.everyone():
                    sub.inbox.put_nowait(exc)
                failures += 1
                await asyncio.sleep(core.read_backoff(failures, self.backoff))
                continue
            failures = 0
            for sub, entries in self.streams.dispatch(reply):
                sub.inbox.put_nowait(entries)
        self.task = None


class AsyncJobHandle:
    def __init__(self, client: "AsyncClient", job_id: str) -> None:
        self.client, self.id = client, job_id

    def __repr__(self) -> str:
        return f"AsyncJobHandle({self.id!r})"

    async def _read(self, reader: Reader, backlog: bool = False) -> AsyncIterator[Event]:
        """As ``JobHandle._read``."""
        cursor = "0-0"
        if backlog:
            entries = cast(Entries, await self.client.redis.xrange(results_key(self.id)))
            for event in reader.feed(entries):
                yield event
            cursor = entries[-1][0] if entries else cursor
        if reader.done:
            return
        mux = self.client.mux
        sub = await mux.subscribe(self.id, cursor)
        try:
            while not reader.done:
                left = reader.left()  # raises TimeoutError once the time is up
                try:
                    item = await asyncio.wait_for(sub.inbox.get(), left)
                except TimeoutError:
                    continue
                if isinstance(item, Exception):
                    raise item
                for event in reader.feed(item):
                    yield event
        finally:
            mux.unsubscribe(sub)

    async def stream(self, timeout: float | None = None) -> AsyncIterator[Event]:
        """The job's events in order, ending with End; raises JobFailed on an error event and
        TimeoutError after ``timeout`` seconds without an event."""
        async for event in self._read(Reader(self.id, timeout, idle=True)):
            if isinstance(event, Error):
                raise JobFailed(self.id, event.code, event.message)
            yield event

    async def result(self, timeout: float | None = None) -> JobResult:
        """Waits up to ``timeout`` seconds for the job to end and returns its outputs."""
        return core.fold(self.id, [event async for event in
                                   self._read(Reader(self.id, timeout), backlog=True)])

    async def status(self) -> str:
        """``queued``, ``started``, ``finished``, ``failed`` or ``canceled``."""
        entries = core.decode_entries(
            cast(Entries, await self.client.redis.xrange(results_key(self.id))))
        return core.status_of([event for _, event in entries])

    async def cancel(self) -> None:
        async with self.client.redis.pipeline(transaction=False) as pipe:
            await core.cancel_commands(pipe, self.id, self.client.cancel_ttl).execute()


class AsyncClient:
    def __init__(self, redis_url: str = DEFAULT_URL, queue: str = "default", *,
                 max_queue_len: int | None = 10_000, retries: int = 10,
                 backoff_base: float = 0.05, backoff_cap: float = 2.0,
                 cancel_ttl: int = CANCEL_TTL, max_connections: int = MAX_CONNECTIONS,
                 pool_timeout: float = POOL_TIMEOUT) -> None:
        self.queue, self.max_queue_len, self.cancel_ttl = queue, max_queue_len, cancel_ttl
        retry = Retry(ExponentialBackoff(cap=backoff_cap, base=backoff_base), retries)
        pool = FairPool.from_url(
            redis_url, max_connections=max_connections, timeout=pool_timeout,
            decode_responses=True, retry=retry,
            retry_on_error=[redis.ConnectionError, redis.TimeoutError])  # redis-py < 6 needs it
        self.redis = Redis(connection_pool=pool)
        self.mux = AsyncMux(self.redis, backoff_base)

    async def submit(self, prompt: str | list[int] | None = None, **kwargs: Any) -> AsyncJobHandle:
        """As ``Client.submit``."""
        return (await self.submit_many([{"prompt": prompt, **kwargs}]))[0]

    async def submit_many(self, specs: Iterable[dict[str, Any]]) -> list[AsyncJobHandle]:
        """As ``Client.submit_many``: one round trip, all or nothing."""
        jobs = core.new_jobs(self.queue, specs)
        if not jobs:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            enqueue_ops(pipe, jobs, self.max_queue_len)
            enqueue_reply((await pipe.execute())[0], self.queue, self.max_queue_len)
        return [AsyncJobHandle(self, job.id) for job in jobs]

    def job(self, job_id: str) -> AsyncJobHandle:
        """A handle on a job submitted earlier, by id."""
        return AsyncJobHandle(self, job_id)

    async def aclose(self) -> None:
        await self.mux.close()
        await self.redis.aclose()
        await self.redis.connection_pool.disconnect()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
