"""One reader per client for every result stream its handles wait on.

A handle that streams or waits subscribes its job's result stream; the client's reader (a
daemon thread, ``Mux``; a task for the asyncio client, ``producer.aio``) blocks in one
``XREAD`` over all subscribed streams, then hands each subscription the entries past its
cursor. So a client holds one connection for all its waiting handles however many there are
(10,000 and more), besides those of its commands (a ``BlockingConnectionPool``: callers wait for
a free one, never fail for want of one).

A new subscription must join a read that is already blocked: the client adds an entry to its
own wake-up stream (``pagedq:wake:{client}``, one entry kept, expiring after an hour of quiet),
which every read includes. At most one wake-up is sent per read, however many handles
subscribe meanwhile.

A read that fails (Redis down past redis-py's retries, a refused command) is handed to every
subscription, whose handle raises it; the reader backs off and reads on for the others. Entry
ids only grow, so each subscription's cursor makes a re-read after a reconnect deliver nothing
twice and lose nothing.
"""

import queue
import threading
import time
import uuid
from typing import Any

import redis

from .core import BLOCK_SLICE, READ_COUNT, Entries, read_backoff, xread_streams
from .protocol import results_key, wake_key

WAKE_TTL = 3600


def _order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class Subscription:
    """One reader of one job's result stream. ``inbox``: a ``queue.SimpleQueue`` (sync) or an
    ``asyncio.Queue`` of entry lists or exceptions."""

    def __init__(self, job_id: str, inbox: Any, cursor: str = "0-0") -> None:
        self.key, self.inbox, self.cursor = results_key(job_id), inbox, cursor


class Streams:
    """The reader's state, no I/O: the subscriptions by stream, the next read's arguments,
    and which subscription gets which entries of a reply."""

    def __init__(self) -> None:
        self.wake_key = wake_key(uuid.uuid4().hex)
        self.subs: dict[str, list[Subscription]] = {}
        # per stream, where the next read starts: its least advanced subscription's cursor
        # (kept up to date, so that building a read of 10,000 streams costs ~1 ms, not 40)
        self.cursors: dict[str, str] = {self.wake_key: "0-0"}
        self.woken = False  # a wake-up was sent since the last read was built
        self.requested: dict[str, str] = {}  # the cursors the read in flight started from

    def add(self, sub: Subscription) -> bool:
        """Registers ``sub``; True when a wake-up must be sent for it to join the read."""
        self.subs.setdefault(sub.key, []).append(sub)
        self._advance(sub.key)
        wake, self.woken = not self.woken, True
        return wake

    def remove(self, sub: Subscription) -> None:
        subs = self.subs.get(sub.key, [])
        if sub in subs:
            subs.remove(sub)
        if subs:
            self._advance(sub.key)
        else:
            self.subs.pop(sub.key, None)
            self.cursors.pop(sub.key, None)

    def _advance(self, key: str) -> None:
        self.cursors[key] = min((s.cursor for s in self.subs[key]), key=_order)

    def request(self) -> dict[str, Any]:
        """The next XREAD's arguments."""
        self.woken = False
        self.requested = dict(self.cursors)
        return {"streams": self.requested, "count": READ_COUNT,
                "block": int(BLOCK_SLICE * 1000)}

    def dispatch(self, reply: Any) -> list[tuple[Subscription, Entries]]:
        """Each subscription's new entries in an XREAD reply; advances the cursors."""
        out = []
        for key, entries in xread_streams(reply):
            if key == self.wake_key:
                self.cursors[key] = entries[-1][0]
                continue
            if key not in self.subs:  # its last reader left meanwhile
                continue
            start = _order(self.requested.get(key, "0-0"))
            for sub in self.subs[key]:
                after = _order(sub.cursor)
                if start > after:  # joined after this read began: it starts past its cursor,
                    continue       # so the next read (from this cursor) serves it in order
                new = [e for e in entries if _order(e[0]) > after]
                if new:
                    sub.cursor = new[-1][0]
                    out.append((sub, new))
            self._advance(key)
        return out

    def everyone(self) -> list[Subscription]:
        return [sub for subs in self.subs.values() for sub in subs]

    def wake(self, pipe: Any) -> None:
        """Adds the wake-up to a pipeline."""
        pipe.xadd(self.wake_key, {"w": 1}, maxlen=1, approximate=False)
        pipe.expire(self.wake_key, WAKE_TTL)


class Mux:
    """The sync client's reader thread, started by the first subscription."""

    def __init__(self, conn: redis.Redis, backoff: float = 0.05) -> None:
        self.conn, self.backoff = conn, backoff
        self.streams = Streams()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.closed = False

    def subscribe(self, job_id: str, cursor: str = "0-0") -> Subscription:
        """Entries of the job's stream past ``cursor`` go to the subscription's inbox."""
        sub = Subscription(job_id, queue.SimpleQueue(), cursor)
        with self.lock:
            wake = self.streams.add(sub)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="pagedq-reader",
                                               daemon=True)
                self.thread.start()
                wake = False
        if wake:
            self._wake()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self.lock:
            self.streams.remove(sub)

    def close(self) -> None:
        self.closed = True
        thread = self.thread
        if thread is not None:
            self._wake()
            thread.join(BLOCK_SLICE + 1)

    def _wake(self) -> None:
        with self.conn.pipeline(transaction=False) as pipe:
            self.streams.wake(pipe)
            pipe.execute()

    def _run(self) -> None:
        """Reads while some handle waits: the thread ends with the last subscription (a
        client never closed leaves no thread behind), the next one starts another."""
        failures = 0
        while not self.closed:
            with self.lock:
                if not self.streams.subs:
                    self.thread = None
                    return
                request = self.streams.request()
            try:
                reply = self.conn.xread(**request)
            except redis.RedisError as exc:
                with self.lock:
                    for sub in self.streams.everyone():
                        sub.inbox.put(exc)
                failures += 1
                time.sleep(read_backoff(failures, self.backoff))
                continue
            failures = 0
            with self.lock:
                for sub, entries in self.streams.dispatch(reply):
                    sub.inbox.put(entries)
