"""Real Redis servers for tests: a fresh ``redis-server`` on a free loopback port in a tmp dir,
killed at teardown. Never a mock: the Lua scripts, stream commands and RQ's own readers must run
against the real thing.

Registered from ``tests/conftest.py`` (``pytest_plugins = ["redis_fixtures"]``).

- ``redis_url``: one server per test, no persistence, yields ``redis://127.0.0.1:PORT/0``.
- ``redis_server``: the same, as a ``RedisServer`` (``.url``, ``.stop()``, ``.start()``,
  ``.restart()``).
- ``redis_server_factory(aof=False)``: more servers; ``aof=True`` turns on the append-only file
  (fsync always) so that ``restart()`` — same port, same dir — keeps the data.
- ``make_fake_worker`` / ``fake_worker``: ``FakeWorker``s, which answer jobs per the wire
  protocol without an engine, for tests of the producer side.
"""

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from producer import rq_mirror
from producer.protocol import (
    GROUP,
    Chunk,
    Done,
    End,
    Error,
    Job,
    Usage,
    cancel_key,
    queue_key,
    results_key,
)
from producer.rq_transitions import Transitions
from worker.redis_server import RedisServer


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    servers: list[RedisServer] = []

    def make(aof: bool = False) -> RedisServer:
        directory = tmp_path / f"redis{len(servers)}"
        directory.mkdir()
        server = RedisServer(data_dir=directory, appendonly=aof)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def redis_server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    return redis_server_factory()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


def mirror(conn: redis.Redis, queue: str, add: Callable[[Transitions], None]) -> None:
    """Applies the RQ transitions that ``add`` records, in one script call, as a worker's round
    trip does."""
    transitions = Transitions()
    add(transitions)
    with conn.pipeline() as pipe:
        transitions.add_to(pipe, queue)
        pipe.execute()


class FakeWorker:
    """Answers jobs as a pagedq worker would, without an engine, so that producer tests need no
    model: sample i of a job gets min(max_tokens, 4) tokens, token t being id 100 * i + t and
    text " s{i}t{t}", one chunk each (``delay`` seconds apart); a canceled job ends its samples
    with "abort"; a prompt containing "FAIL" gets an ``error`` event. Every step is mirrored in
    RQ through ``producer.rq_mirror``."""

    def __init__(self, url: str, queue: str = "default", name: str = "fake-1",
                 delay: float = 0.0) -> None:
        self.key = queue_key(queue)
        self.conn = redis.Redis.from_url(url, decode_responses=True)
        self.queue, self.name, self.delay = queue, name, delay
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        try:
            self.conn.xgroup_create(self.key, GROUP, id="0", mkstream=True)
        except redis.ResponseError:  # BUSYGROUP: a producer made it first
            pass
        rq_mirror.register_worker(self.conn, name, [queue], ttl=60)

    def step(self, block_ms: int = 50) -> bool:
        """Handles at most one job; True if there was one."""

        reply = self.conn.xreadgroup(GROUP, self.name, {self.key: ">"}, count=1,
                                     block=block_ms)
        if not reply:
            return False
        entry_id, fields = reply[0][1][0]
        job = Job.model_validate_json(fields["job"])
        mirror(self.conn, self.queue, lambda t: t.started(job.id, self.name))
        out = results_key(job.id)

        def publish(event: Chunk | Done | End | Error) -> None:
            self.conn.xadd(out, {"event": event.model_dump_json()})
            self.conn.expire(out, 3600)

        if "FAIL" in str(job.prompt):
            publish(Error(code="invalid_request", message="the prompt asked to fail"))
            mirror(self.conn, self.queue, lambda t: t.failed(job.id, "asked to fail"))
        else:
            prompt_tokens = len(str(job.prompt or job.messages))
            n_tokens = min(job.sampling.max_tokens or 4, 4)
            aborted = False
            for i in range(job.sampling.n):
                done = 0
                for t in range(n_tokens):
                    aborted = aborted or bool(self.conn.exists(cancel_key(job.id)))
                    if aborted:
                        break
                    publish(Chunk(sample=i, seq=t, text=f" s{i}t{t}", token_ids=[100 * i + t]))
                    done += 1
                    time.sleep(self.delay)
                reason = "abort" if aborted else "length"
                publish(Done(sample=i, finish_reason=reason,
                             usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=done)))
            publish(End(usage=Usage(prompt_tokens=prompt_tokens,
                                    completion_tokens=job.sampling.n * n_tokens)))
            if aborted:
                mirror(self.conn, self.queue, lambda t: t.canceled(job.id))
            else:
                result = {"texts": [f"sample {i}" for i in range(job.sampling.n)]}
                mirror(self.conn, self.queue, lambda t: t.finished(job.id, result))
        self.conn.xack(self.key, GROUP, entry_id)
        return True

    def start(self) -> "FakeWorker":
        def loop() -> None:
            while not self.stopped.is_set():
                self.step()

        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join(timeout=10)
        self.conn.close()


@pytest.fixture
def make_fake_worker(redis_url: str) -> Iterator[Callable[..., FakeWorker]]:
    """``make_fake_worker(name=, delay=, queue=)``: FakeWorkers on ``redis_url``, stopped at
    teardown; each one answers when stepped, or by itself once started."""
    workers: list[FakeWorker] = []

    def make(**kwargs: object) -> FakeWorker:
        workers.append(FakeWorker(redis_url, **kwargs))
        return workers[-1]

    yield make
    for worker in workers:
        worker.stop()


@pytest.fixture
def fake_worker(make_fake_worker: Callable[..., FakeWorker]) -> FakeWorker:
    """A FakeWorker answering the ``default`` queue in a thread."""
    return make_fake_worker().start()
