"""One pipelined round trip per engine step, sent after the step and read after the next one,
so that Redis works while the engine computes: every job's new events with their
acknowledgements, the RQ mirror's transitions (one script for all jobs), other commands (dead
letters, acknowledgements), the check for cancellations and the read of the next jobs, in one
MULTI transaction on a connection of its own. At most one is in flight: its reply is read
(``collect``) before the next is sent (``send``).

Each job's events are appended by a Lua script only if the job's result stream still holds
exactly as many events as this worker last saw (a fence): of two workers that both think they
own a job (one stalled past the reclaim time) only one continues its stream; the other learns
it was superseded. A write re-sent after a lost reply counts as done when the stream already
holds it (its length then is the expected one plus the write's events), so it lands once.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import redis
import structlog
from redis.client import Pipeline
from redis.connection import AbstractConnection

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

# KEYS: the job stream, then one result stream per job. ARGV: the group, the result TTL,
# whether this is a re-send ('1') or not ('0'), then per job: the stream's expected length, the
# number of events, the entry to XACK ('' for none), the events. Returns per job 1 (written,
# now or by an earlier try) or 0 (superseded).
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
    if ack ~= '' then redis.pcall('XACK', KEYS[1], ARGV[1], ack) end
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
    mirror: Transitions = field(default_factory=Transitions)  # RQ transitions, after the events
    calls: list[Callable[[Pipeline], object]] = field(default_factory=list)

    def event(self, job_id: str, start: int, event: Chunk | Done | End | Error,
              ack: str = "") -> None:
        """Append ``event`` to the job's result stream, ``start`` being the number of events
        before it; ``ack``: the job's entry, acknowledged once this event is written."""
        append = self.appends.setdefault(job_id, _Append(start))
        append.events.append(event.model_dump_json())
        append.ack = append.ack or ack

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
    unsent: bool = False  # sending failed: collect() sends it again
    commands: list[str] = field(default_factory=list)  # names of the commands in its MULTI


class Publisher:
    def __init__(self, conn: redis.Redis, queue: str, result_ttl: int,
                 give_up: Callable[[], bool]) -> None:
        self.conn = conn
        self.queue = queue
        self.result_ttl = result_ttl
        self.give_up = give_up
        self._writer: AbstractConnection | None = None  # the round trips' own connection
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
        try:
            self._transmit(resent=False)
        except DOWN as exc:
            log.warning("redis unavailable", during="publish", error=str(exc))
            self._sent.unsent = True

    def collect(self) -> Flushed:
        """Reads the reply of the round trip in flight, sending it again until Redis answers
        (the fence makes that safe; jobs a lost reply had read stay pending, and come back by
        reclaim)."""
        sent = self._sent
        if sent is None:
            return Flushed(set(), set())
        replies = None
        if not sent.unsent:
            try:
                replies = self._receive()
            except DOWN as exc:
                log.warning("redis unavailable", during="publish", error=str(exc))
        if replies is None:
            replies = retry(lambda: self._transmit(resent=True) or self._receive(), "publish",
                            self.give_up)
        self._sent = None
        read_reply = replies.pop() if sent.read else None
        canceled = replies.pop() if sent.watch else []
        for reply in replies:  # a failed mirror or ack command must not stop the stream
            if isinstance(reply, Exception):
                log.error("redis command failed", error=str(reply))
        job_ids = list(sent.batch.appends)
        status = replies[0] if job_ids else []
        return Flushed({j for j, ok in zip(job_ids, status, strict=True) if not ok},
                       {j for j, on in zip(sent.watch, canceled, strict=True) if on is not None},
                       read_reply)

    def close(self) -> None:
        """Reads the reply in flight, if Redis answers before the worker must stop (jobs it
        read stay pending, for a peer), and gives the connection back to the pool."""
        try:
            self.collect()
        finally:
            if self._writer is not None:
                if self._sent is not None:  # a reply unread: the connection is out of step
                    self._writer.disconnect()
                self.conn.connection_pool.release(self._writer)
                self._writer = None

    def _transmit(self, resent: bool) -> None:
        sent = self._sent
        assert sent is not None
        batch = sent.batch
        pipe = self.conn.pipeline(transaction=False)  # only to build the commands
        if batch.appends:
            args: list[str | int] = [GROUP, self.result_ttl, int(resent)]
            for append in batch.appends.values():
                args += [append.start, len(append.events), append.ack, *append.events]
            pipe.eval(_APPEND, 1 + len(batch.appends), queue_key(self.queue),
                      *map(results_key, batch.appends), *args)
        batch.mirror.add_to(pipe, self.queue)
        for add in batch.calls:
            add(pipe)
        if sent.watch:
            pipe.mget([cancel_key(job_id) for job_id in sent.watch])
        if sent.read:
            sent.read(pipe)
        commands = [args for args, _ in pipe.command_stack]
        sent.commands = [str(args[0]) for args in commands]
        if self._writer is None:
            self._writer = self.conn.connection_pool.get_connection()
        packed = self._writer.pack_commands([("MULTI",), *commands, ("EXEC",)])
        self._writer.send_packed_command([b"".join(packed)])  # one write, not one per chunk

    def _receive(self) -> list:
        """EXEC's reply: per command its reply (an exception for a failed one), parsed as
        redis-py parses it."""
        sent, writer = self._sent, self._writer
        assert sent is not None and writer is not None
        try:
            for _ in range(len(sent.commands) + 1):  # MULTI's OK, then QUEUED per command
                writer.read_response()
            replies = list(writer.read_response())
        except redis.ResponseError:  # refused at queue time: the connection is out of step
            writer.disconnect()
            raise
        callbacks = self.conn.response_callbacks
        return [reply if isinstance(reply, Exception) or name not in callbacks
                else callbacks[name](reply) for name, reply in zip(sent.commands, replies,
                                                                    strict=True)]
