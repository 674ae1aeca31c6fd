"""One pipelined round trip per engine step: every job's new events with their
acknowledgements, other commands (dead letters, acknowledgements), the check for cancellations
and the read of the next jobs, in one transaction, waited for. The step's RQ mirror transitions
follow in one script call on a connection of their own, not waited for: their reply is read
before the next ones are sent, so Redis applies them while the engine computes the next step.

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

    def __bool__(self) -> bool:
        return bool(self.appends or self.mirror or self.calls)


@dataclass
class Flushed:
    superseded: set[str]  # jobs whose stream another worker continued: drop them
    canceled: set[str]  # watched jobs whose cancel key is set
    read: object = None  # the reply of the ``read`` command, if one was given


class Publisher:
    def __init__(self, conn: redis.Redis, queue: str, result_ttl: int,
                 give_up: Callable[[], bool]) -> None:
        self.conn = conn
        self.queue = queue
        self.result_ttl = result_ttl
        self.give_up = give_up
        self._mirror: AbstractConnection | None = None  # the mirror's own connection
        self._in_flight: Transitions | None = None  # sent on it, reply not read yet
        self._unsent = False  # sending those failed: collect() sends them again

    def flush(self, batch: Batch, watch: Iterable[str],
              read: Callable[[Pipeline], object] | None = None) -> Flushed:
        """Sends ``batch``, asks which of the ``watch`` jobs are canceled and adds the ``read``
        command, in one transaction; re-sent until Redis answers (the fence makes that safe;
        jobs a lost reply had read stay pending, and come back by reclaim). Then sends the
        batch's RQ transitions, but those of superseded jobs, without waiting."""
        watch = list(watch)
        job_ids = list(batch.appends)
        tries = 0

        def send() -> list:
            nonlocal tries
            tries += 1
            pipe = self.conn.pipeline(transaction=True)
            if job_ids:
                args: list[str | int] = [GROUP, self.result_ttl, int(tries > 1)]
                for append in batch.appends.values():
                    args += [append.start, len(append.events), append.ack, *append.events]
                pipe.eval(_APPEND, 1 + len(job_ids), queue_key(self.queue),
                          *map(results_key, job_ids), *args)
            for add in batch.calls:
                add(pipe)
            if watch:
                pipe.mget([cancel_key(job_id) for job_id in watch])
            if read:
                read(pipe)
            return pipe.execute(raise_on_error=False)

        replies = retry(send, "publish", self.give_up)
        read_reply = replies.pop() if read else None
        for reply in replies:  # a failed ack or dead letter must not stop the stream
            if isinstance(reply, Exception):
                log.error("redis command failed", error=str(reply))
        status = replies[0] if job_ids else []
        canceled = replies[-1] if watch else []
        superseded = {j for j, ok in zip(job_ids, status, strict=True) if not ok}
        batch.mirror.discard(superseded)
        self.collect()
        if batch.mirror:
            try:
                self._send(batch.mirror)
            except DOWN as exc:
                log.warning("redis unavailable", during="rq mirror", error=str(exc))
        return Flushed(superseded,
                       {j for j, flag in zip(watch, canceled, strict=True) if flag is not None},
                       read_reply)

    def collect(self) -> None:
        """Waits for the reply of the RQ transitions in flight, sending them again until Redis
        answers (re-applying a transition changes no count)."""
        transitions = self._in_flight
        if transitions is None:
            return
        try:
            if self._unsent:
                raise redis.ConnectionError("not sent")
            reply = self._receive()
        except DOWN as exc:
            log.warning("redis unavailable", during="rq mirror", error=str(exc))
            reply = retry(lambda: self._send(transitions) or self._receive(), "rq mirror",
                          self.give_up)
        except redis.ResponseError as exc:
            reply = exc
        if isinstance(reply, Exception):  # the mirror is a view: never stop the streams
            log.error("rq mirror update failed", error=str(reply))
        self._in_flight = None

    def close(self) -> None:
        """Reads the last reply (if Redis answers before the worker must stop) and gives the
        mirror's connection back."""
        if self._mirror is not None:
            self.collect()
            self.conn.connection_pool.release(self._mirror)
            self._mirror = None

    def _send(self, transitions: Transitions) -> None:
        self._in_flight, self._unsent = transitions, True
        pipe = self.conn.pipeline(transaction=False)  # only to build the command
        transitions.add_to(pipe, self.queue)
        if self._mirror is None:
            self._mirror = self.conn.connection_pool.get_connection()
        self._mirror.send_packed_command(self._mirror.pack_commands(
            [args for args, _ in pipe.command_stack]))
        self._unsent = False

    def _receive(self) -> object:
        assert self._mirror is not None
        return self._mirror.read_response()
