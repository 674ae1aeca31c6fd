"""One pipelined round trip per engine step, sent after the step and read after the next one,
so that Redis works while the engine computes: every job's new events with their
acknowledgements, the RQ mirror's transitions (one script for all jobs), other commands (dead
letters, acknowledgements), the check for cancellations and the read of the next jobs, in one
MULTI transaction. At most one is in flight: its reply is read (``collect``) before the next is
sent (``send``).

The transaction is a public redis-py pipeline (``transaction=True``) executed on a thread of
its own, the round trip's only job: the engine's step runs meanwhile (torch releases the GIL;
the thread holds it only to pack ~1 KB of commands and parse the reply, with hiredis). Its
replies are looked up by name (``_Sent.slots``), never by position.

Each job's events are appended by a Lua script only if the job's result stream still holds
exactly as many events as this worker last saw (a fence): of two workers that both think they
own a job (one stalled past the reclaim time) only one continues its stream; the other learns
it was superseded. The RQ transitions go first in the transaction, fenced on the same length
(``Transitions``), so a superseded worker writes no RQ state either. A write re-sent after a
lost reply counts as done when the stream already holds it (its length then is the expected one
plus the write's events), so it lands once.

Retention: a job's entry is acknowledged and deleted (``XACK`` + ``XDEL``) by the same script
that writes its last event, so the job stream holds only unread and pending jobs. Deleting the
one entry just acknowledged never touches an unread or pending one, costs O(1) per job, and is
not held back by one long job, as ``XTRIM MINID`` below the oldest pending entry would be.
"""

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import redis
import structlog
from redis.client import Pipeline

from producer.protocol import (
    EVENT_FIELD,
    GROUP,
    Chunk,
    Done,
    End,
    Error,
    cancel_key,
    queue_key,
    results_key,
)
from producer.rq_transitions import Transitions
from worker.connection import DOWN, retry

log = structlog.get_logger()
CLOSE_WAIT_S = 5.0  # close() waits this long for the reply in flight, once, never retrying

# KEYS: the job stream, then one result stream per job. ARGV: the group, the result TTL,
# whether this is a re-send ('1') or not ('0'), then per job: the stream's expected length, the
# number of events, the entry to XACK and XDEL ('' for none), the events. Returns per job 1
# (written, now or by an earlier try) or 0 (superseded).
_APPEND = f"""
local i, status, resent = 4, {{}}, ARGV[3] == '1'
for k = 2, #KEYS do
  local start, count, ack = tonumber(ARGV[i]), tonumber(ARGV[i + 1]), ARGV[i + 2]
  local have = redis.call('XLEN', KEYS[k])
  if have == start then
    for e = 1, count do
      redis.call('XADD', KEYS[k], '*', '{EVENT_FIELD}', ARGV[i + 2 + e])
    end
    redis.call('EXPIRE', KEYS[k], ARGV[2])
    if ack ~= '' then
      redis.pcall('XACK', KEYS[1], ARGV[1], ack)
      redis.pcall('XDEL', KEYS[1], ack)
    end
    status[k - 1] = 1
  elseif resent and have == start + count then
    status[k - 1] = 1
  else
    status[k - 1] = 0
  end
  i = i + 3 + count
end
return status
"""


@dataclass
class _Append:
    start: int  # events in the job's result stream before these
    events: list[str] = field(default_factory=list)
    ack: str = ""  # the job's stream entry, acknowledged after the events


@dataclass
class Batch:
    """What one round trip writes; built by the driver, sent by the publisher."""

    appends: dict[str, _Append] = field(default_factory=dict)
    mirror: Transitions = field(default_factory=Transitions)  # RQ transitions, fenced
    calls: list[Callable[[Pipeline], object]] = field(default_factory=list)
    firsts: bool = False  # holds an event other than a running job's later chunks

    def event(self, job_id: str, start: int, event: Chunk | Done | End | Error,
              ack: str = "") -> None:
        """Append ``event`` to the job's result stream, ``start`` being the number of events
        before it; ``ack``: the job's entry, acknowledged once this event is written."""
        append = self.appends.setdefault(job_id, _Append(start))
        append.events.append(event.model_dump_json())
        append.ack = append.ack or ack
        self.firsts = self.firsts or not isinstance(event, Chunk) or event.seq == 0

    @property
    def urgent(self) -> bool:
        """Whether it must go at once: it holds a sample's first chunk (time to first token),
        a ``done``, ``end`` or ``error``, an RQ transition or another command; otherwise it
        holds only running jobs' later chunks, which may wait for the stream interval."""
        return self.firsts or bool(self.mirror or self.calls)

    def call(self, add: Callable[[Pipeline], object]) -> None:
        """Another command (a dead letter, an acknowledgement...), after the events."""
        self.calls.append(add)

    def discard(self, job_ids: set[str]) -> None:
        """Forgets the events and RQ transitions of jobs that another worker continues."""
        for job_id in job_ids:
            self.appends.pop(job_id, None)
        self.mirror.discard(job_ids)

    def __bool__(self) -> bool:
        return bool(self.appends or self.mirror or self.calls)


@dataclass
class Flushed:
    superseded: set[str]  # jobs whose stream another worker continued: drop them
    canceled: set[str]  # watched jobs whose cancel key is set
    read: object = None  # the reply of the ``read`` command, if one was given


@dataclass
class _Sent:
    batch: Batch
    watch: list[str]
    read: Callable[[Pipeline], object] | None
    future: Future | None = None  # the transaction on the round-trip thread; None: unsent
    slots: dict[str, int] = field(default_factory=dict)  # a named command's place in EXEC


class Publisher:
    def __init__(self, conn: redis.Redis, queue: str, result_ttl: int,
                 give_up: Callable[[], bool]) -> None:
        self.conn = conn
        self.queue = queue
        self.result_ttl = result_ttl
        self.give_up = give_up
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="publish")
        self._sent: _Sent | None = None  # the round trip in flight

    @property
    def in_flight(self) -> bool:
        return self._sent is not None

    def send(self, batch: Batch, watch: Iterable[str],
             read: Callable[[Pipeline], object] | None = None) -> None:
        """Sends ``batch``, asks which of the ``watch`` jobs are canceled and adds the ``read``
        command, in one transaction, without waiting for the reply."""
        assert self._sent is None, "collect() the round trip in flight first"
        self._sent = _Sent(batch, list(watch), read)
        self._sent.future = self._thread.submit(self._execute, self._sent, resent=False)

    def collect(self) -> Flushed:
        """Reads the reply of the round trip in flight, sending it again until Redis answers
        (the fence makes that safe; jobs a lost reply had read stay pending, and come back by
        reclaim)."""
        sent = self._sent
        if sent is None:
            return Flushed(set(), set())
        replies = self._reply(sent)
        if replies is None:
            replies = retry(lambda: self._execute(sent, resent=True), "publish", self.give_up)
        self._sent = None
        return self._decode(sent, replies)

    def close(self) -> None:
        """Reads the reply in flight if Redis gives it within ``CLOSE_WAIT_S``, without
        re-sending (jobs it wrote or read stay pending for a peer otherwise), and stops the
        round-trip thread. Never waits on a Redis that is down: close() runs on the way out,
        also when the loop raised."""
        sent, self._sent = self._sent, None
        if sent is not None and sent.future is not None:
            try:
                sent.future.result(CLOSE_WAIT_S)
            except (*DOWN, TimeoutError) as exc:
                log.warning("the last round trip's reply was lost", error=str(exc))
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _reply(self, sent: _Sent) -> list | None:
        """The in-flight transaction's replies; None when Redis did not answer."""
        try:
            return sent.future.result() if sent.future is not None else None
        except DOWN as exc:
            log.warning("redis unavailable", during="publish", error=str(exc))
            return None

    def _decode(self, sent: _Sent, replies: list) -> Flushed:
        named = {sent.slots[name]: name for name in sent.slots}
        for i, reply in enumerate(replies):  # a failed mirror or ack command must not stop it
            if isinstance(reply, Exception) and named.get(i) != "read":
                log.error("redis command failed", command=named.get(i, "call"), error=str(reply))
        job_ids = list(sent.batch.appends)
        status = replies[sent.slots["append"]] if "append" in sent.slots else []
        canceled = replies[sent.slots["cancels"]] if "cancels" in sent.slots else []
        return Flushed({j for j, ok in zip(job_ids, status, strict=True) if not ok},
                       {j for j, on in zip(sent.watch, canceled, strict=True) if on is not None},
                       replies[sent.slots["read"]] if "read" in sent.slots else None)

    def _execute(self, sent: _Sent, resent: bool) -> list:
        """Builds the transaction and runs it; per command its reply (an exception for one
        that failed)."""
        batch, slots = sent.batch, sent.slots
        slots.clear()
        with self.conn.pipeline(transaction=True) as pipe:
            # The RQ transitions first, fenced on each stream's length before the events: in
            # one transaction, it is the length the append script's own fence requires.
            batch.mirror.add_to(pipe, self.queue,
                                {job_id: a.start for job_id, a in batch.appends.items()})
            if batch.appends:
                args: list[str | int] = [GROUP, self.result_ttl, int(resent)]
                for append in batch.appends.values():
                    args += [append.start, len(append.events), append.ack, *append.events]
                slots["append"] = len(pipe)
                pipe.eval(_APPEND, 1 + len(batch.appends), queue_key(self.queue),
                          *map(results_key, batch.appends), *args)
            for add in batch.calls:
                add(pipe)
            if sent.watch:
                slots["cancels"] = len(pipe)
                pipe.mget([cancel_key(job_id) for job_id in sent.watch])
            if sent.read is not None:
                slots["read"] = len(pipe)
                sent.read(pipe)
            return pipe.execute(raise_on_error=False)
