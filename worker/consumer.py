"""Reading the job stream through the consumer group: new jobs, jobs reclaimed from silent
peers, keeping this worker's own jobs claimed, and what each job's result stream already holds.
"""

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Annotated, cast

import redis
import structlog
from pydantic import TypeAdapter, ValidationError
from redis.client import Pipeline
from redis.typing import StreamIdT

from producer.protocol import (
    EVENT_FIELD,
    GROUP,
    JOB_FIELD,
    Event,
    Job,
    dead_key,
    queue_key,
    results_key,
)
from worker.connection import retry

log = structlog.get_logger()
_EVENTS = TypeAdapter(Event)
_JOB_ID = TypeAdapter(Annotated[str, Job.model_fields["id"]])
_MAX_MESSAGE = 500  # characters of a validation error that go into an error event
# A busy worker's read (``read_in``) takes jobs only up to its share of all the jobs held or
# waiting: the stream's entries less the pending ones are waiting (an acknowledged entry is
# deleted with its XACK), and each live consumer's pending entries are what it holds (live:
# this one, and those seen within ARGV[4] ms, the reclaim time: one silent longer is dead to
# its peers too). So a burst splits evenly instead of going to whichever worker reads first or
# drains first (96 jobs on 2 workers: 43/53 before, the second worker's last job ending 0.2 s
# after the first's). A worker holding nothing always reads one.
_FAIR_READ = """
local waiting = redis.call('XLEN', KEYS[1]) - redis.call('XPENDING', KEYS[1], ARGV[1])[1]
local live, held, mine = 1, 0, 0
for _, consumer in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local info = {}
  for i = 1, #consumer, 2 do info[consumer[i]] = consumer[i + 1] end
  if info['name'] == ARGV[2] then
    mine = info['pending']
  elseif info['idle'] < tonumber(ARGV[4]) then
    live, held = live + 1, held + info['pending']
  end
end
local count = math.min(tonumber(ARGV[3]), waiting,
                       math.ceil((waiting + held + mine) / live) - mine)
if mine == 0 then count = math.max(count, 1) end
if count < 1 then return false end
return redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', count,
                  'STREAMS', KEYS[1], '>')
"""


@dataclass
class Delivery:
    """One job stream entry handed to this worker."""

    entry_id: str
    raw: str | None  # the entry's `job` field as received
    reclaimed: bool  # taken over from a silent peer (else read new)
    job: Job | None = None
    job_id: str = ""  # the job's id; the entry id where none can be read from it
    invalid: str = ""  # why the job was refused, when it was
    deliveries: int = 1
    events: list[Event] = field(default_factory=list)  # its result stream so far
    written: int = 0  # events in its result stream


def _errors(exc: ValidationError) -> str:
    parts = [f"{'.'.join(map(str, e['loc'])) or 'job'}: {e['msg']}" for e in exc.errors()]
    return "; ".join(parts)[:_MAX_MESSAGE]


def _guess_id(raw: str | None) -> str | None:
    """The id of an invalid job, if it has a valid one, so its error reaches its reader."""
    try:
        return _JOB_ID.validate_python(json.loads(raw or "").get("id"))
    except (ValueError, AttributeError):  # pydantic's ValidationError is a ValueError
        return None


def _fields(fields: dict[str, str] | list[str]) -> dict[str, str]:
    """An entry's fields: redis-py's dict, or the flat list a script's reply holds."""
    return fields if isinstance(fields, dict) else dict(zip(fields[::2], fields[1::2],
                                                            strict=True))


def parse(entry_id: str, fields: dict[str, str], reclaimed: bool) -> Delivery:
    delivery = Delivery(entry_id, fields.get(JOB_FIELD), reclaimed)
    if delivery.raw is None:
        delivery.invalid = f"the entry has no {JOB_FIELD!r} field"
    else:
        try:
            delivery.job = Job.model_validate_json(delivery.raw)
        except ValidationError as exc:
            delivery.invalid = _errors(exc)
    delivery.job_id = delivery.job.id if delivery.job else _guess_id(delivery.raw) or entry_id
    return delivery


class Consumer:
    def __init__(self, conn: redis.Redis, queue: str, name: str,
                 give_up: Callable[[], bool], dead_letter_max_len: int = 10_000) -> None:
        self.conn = conn
        self.dead_letter_max_len = dead_letter_max_len
        self.queue = queue
        self.key = queue_key(queue)
        self.name = name
        self.give_up = give_up
        self._cursor = "0-0"  # where the next reclaim scan of the pending entries starts

    def ensure_group(self) -> None:
        """The consumer group, and this worker in it: a peer's read counts it among the live
        consumers (``_FAIR_READ``) before it has read anything (Redis 7.0 adds a consumer only
        once it is handed an entry)."""
        try:
            retry(lambda: self.conn.xgroup_create(self.key, GROUP, id="0", mkstream=True),
                  "create group", self.give_up)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        retry(lambda: self.conn.xgroup_createconsumer(self.key, GROUP, self.name),
              "join group", self.give_up)

    def read(self, count: int, block_ms: int) -> list[Delivery]:
        """Up to ``count`` new jobs, waiting up to ``block_ms`` for one (an idle worker's read;
        a busy one reads with its publishing round trip: ``read_in``)."""
        def call() -> object:
            try:
                return self.conn.xreadgroup(GROUP, self.name, {self.key: ">"}, count=count,
                                            block=block_ms)
            except redis.ResponseError as exc:
                return exc

        return self.arrived(retry(call, "read", self.give_up))

    def read_in(self, pipe: Pipeline, count: int, live_ms: int) -> None:
        """Adds a read of up to ``count`` new jobs, and no more than this worker's share of
        those waiting (``_FAIR_READ``), to a pipeline; its reply goes to arrived()."""
        pipe.eval(_FAIR_READ, 1, self.key, GROUP, self.name, count, live_ms)

    def arrived(self, reply: object) -> list[Delivery]:
        """The new jobs in an XREADGROUP reply."""
        if isinstance(reply, redis.ResponseError):
            if "NOGROUP" not in str(reply):
                raise reply
            log.warning("consumer group missing; creating it", queue=self.queue)
            self.ensure_group()  # the stream, or Redis's data, went away
            return []
        streams = cast(list[tuple[str, list[tuple[str, dict[str, str]]]]], reply or [])
        return [parse(entry_id, _fields(fields), False) for _, entries in streams
                for entry_id, fields in entries]

    def reclaim(self, count: int, min_idle_ms: int) -> list[Delivery]:
        """Up to ``count`` jobs whose worker has been silent for ``min_idle_ms``, scanning the
        pending entries a little further on each call."""
        def call() -> list:
            return self.conn.xautoclaim(self.key, GROUP, self.name, min_idle_ms,
                                        start_id=self._cursor, count=count)

        try:
            self._cursor, entries, *_ = retry(call, "reclaim", self.give_up)
        except redis.ResponseError as exc:  # NOGROUP: read() recreates it
            log.warning("reclaim failed", error=str(exc))
            return []
        return [parse(entry_id, fields, True) for entry_id, fields in entries if fields]

    def refresh(self, entry_ids: Iterable[str]) -> None:
        """Re-claims this worker's in-flight jobs, which resets their idle time, so that no
        peer takes them over while they run."""
        ids: list[StreamIdT] = list(entry_ids)
        if ids:
            retry(lambda: self.conn.xclaim(self.key, GROUP, self.name, 0, ids,
                                                 justid=True), "refresh claims", self.give_up)

    def inspect(self, reclaimed: list[Delivery]) -> None:
        """Fills in what each reclaimed job's result stream holds and how often it was
        delivered: one round trip. (A new job's stream is empty; if it is not, a reused id,
        the fenced first write fails and the entry, left pending, comes back through here.)"""
        def call() -> list:
            pipe = self.conn.pipeline(transaction=False)
            for d in reclaimed:
                pipe.xrange(results_key(d.job_id))
                pipe.xpending_range(self.key, GROUP, d.entry_id, d.entry_id, 1)
            return pipe.execute()

        replies = retry(call, "inspect", self.give_up)
        for d, stream, pending in zip(reclaimed, replies[::2], replies[1::2], strict=True):
            d.written = len(stream)
            d.deliveries = pending[0]["times_delivered"] if pending else 1
            try:
                d.events = [_EVENTS.validate_json(fields[EVENT_FIELD]) for _, fields in stream]
            except (ValidationError, KeyError) as exc:  # written by something else than pagedq
                d.invalid = f"its result stream holds an unreadable event: {exc}"[:_MAX_MESSAGE]

    def leave(self) -> None:
        """Removes this consumer from the group if it holds no pending entry (deleting one that
        does would drop its entries), so that restarts do not pile up consumers."""
        if not self.conn.xpending_range(self.key, GROUP, "-", "+", 1, consumername=self.name):
            self.conn.xgroup_delconsumer(self.key, GROUP, self.name)

    def ack(self, pipe: Pipeline, entry_id: str) -> None:
        """Acknowledges and deletes the entry, as the publisher's append script does."""
        pipe.xack(self.key, GROUP, entry_id)
        pipe.xdel(self.key, entry_id)

    def dead_letter(self, pipe: Pipeline, delivery: Delivery, reason: str) -> None:
        """Keeps about the newest ``dead_letter_max_len`` dead letters (trimmed in whole
        stream nodes, ``MAXLEN ~``, as Redis trims cheaply)."""
        pipe.xadd(dead_key(self.queue), {JOB_FIELD: delivery.raw or "", "reason": reason,
                                         "deliveries": delivery.deliveries},
                  maxlen=self.dead_letter_max_len, approximate=True)
