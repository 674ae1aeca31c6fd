"""Noticing entries landing on a stream while busy: new jobs, so that they start a step sooner,
and cancel notices (``pagedq:cancels``), so that the round trips the stream interval skips need
not ask for cancellations (``worker.service``: ``_due``). One watcher (a thread) per stream.

A busy worker reads new jobs in its publishing round trip, sent after a step and read back
after the next one (``worker.publisher``): a job that lands during step N is read by the round
trip sent after N, and its reply is handled only after step N+1, so the job starts in step N+2,
a step later than a loop that read its input between steps would start it (vLLM's engine core
takes new requests from its socket before every step). At 4 requests/s on SmolLM2 that step is
~21 ms of time to first token, and it left pagedq's p50 TTFT 21 ms behind vLLM's in
``benchmarks/serve.py``; with the watcher below, 131 / 132 -> 118 / 111 ms (alternating runs).

So a thread blocks in ``XREAD`` on the job stream (not the group: it takes nothing) and notes
that an entry landed. The loop asks at each send (``take``) whether one landed since the last
send: if so, that round trip's read holds it, and the loop waits for its reply (~0.2 ms) before
the next step instead of after it. Steps without arrivals pay nothing: a worker serving one
stream keeps its overlapped round trip.

Only while the engine has no request waiting to start: then new jobs are the step's only
prefill. Behind a backlog they would only fill the next step's token budget, lengthening the
step that ends the waiting prompts' prefill: a 32-job burst's p50 TTFT (SmolLM2, 2 cores) was
1.30-1.34 s without the early reads and 1.9-2.3 s with them at every step.

Cost: every watching worker receives each new entry once (one ``XREAD`` reply of one entry);
fleets of many workers at high job rates can turn it off (``watch_arrivals``). Cancels are rare:
their watcher runs whenever the stream interval is on.
"""

import threading
import time

import redis
import structlog

from producer.core import read_backoff, xread_streams

log = structlog.get_logger()
BLOCK_MS = 500  # the watcher's read returns this often without news, to see close()


class Arrivals:
    def __init__(self, conn: redis.Redis, key: str, block_ms: int = BLOCK_MS) -> None:
        self.conn, self.key, self.block_ms = conn, key, block_ms
        self._noticed = False  # an entry landed since the last take()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pagedq-arrivals", daemon=True)
        self._thread.start()

    def take(self) -> bool:
        """Whether an entry landed since the last call; the watcher then looks for the next."""
        with self._cond:
            noticed, self._noticed = self._noticed, False
            self._cond.notify()
        return noticed

    def close(self) -> None:
        """Stops the watcher within ``block_ms``; never waits for it."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        """Waits for an entry past the stream's end, notes it, and waits again only once the
        loop has taken the note, from the end as it is then: the round trip sent after a take
        reads whatever landed before it, so only later entries are news. At most one wake-up
        per step however many jobs a burst brings, and no backlog of old entries to walk
        through after one. (An entry that lands between a take and the read of the end after
        it is missed, and joins a step later, as without the watcher.)

        The end is read as an id (``_end``) and the blocking reads wait past that id, not past
        '$': a read from '$' that times out and is sent again misses an entry landing between
        the two, and that gap recurs every ``block_ms`` (CI lost a job's notice to it once, the
        entry landing as a read timed out)."""
        failures, after = 0, None
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or not self._noticed)
                if self._closed:
                    return
            try:
                after = after or self._end()
                reply = self.conn.xread({self.key: after}, count=1, block=self.block_ms)
            except redis.RedisError as exc:  # Redis down or the stream gone: the loop copes
                failures, after = failures + 1, None
                log.debug("arrivals watch failed", error=str(exc), failures=failures)
                time.sleep(read_backoff(failures, 0.05))
                continue
            failures = 0
            if xread_streams(reply):
                after = None  # the next wait starts from the end as it is after the take
                with self._cond:
                    self._noticed = True

    def _end(self) -> str | bytes:
        """The id of the stream's last entry ('0-0' while it has none): entries past it are
        news."""
        last = self.conn.xrevrange(self.key, count=1)
        return (last[0][0] if last else None) or "0-0"
