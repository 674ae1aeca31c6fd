"""The RQ mirror: every pagedq job is also an RQ job record, so that rq-dashboard shows the truth.

The records are written with plain Redis commands in RQ's own storage format (rq 2.12, the
version pinned in the ``worker`` extra; ``tests/test_producer_rq.py`` reads them back with rq's
API and rq-dashboard 0.9.0's JSON routes), so a producer needs neither rq nor pickle. The mirror
is a view: the streams are the source of truth. Its keys, all RQ's:

- ``rq:job:{id}``: hash. ``data`` is RQ's job tuple ``[func, instance, args, kwargs]`` as JSON
  (rq's ``JSONSerializer``; stored uncompressed, which RQ reads too): ``["pagedq.generate",
  null, [], <the Job>]``. Also ``status``, ``origin`` (the queue), ``description``,
  ``created_at``, ``enqueued_at``, ``started_at``, ``ended_at``, ``last_heartbeat``,
  ``worker_name``, ``exc_info`` (zlib, as RQ). It expires ``ttl`` seconds after the job ends.
- ``rq:queue:{q}``: list of queued ids; ``rq:queues``: set of those list keys.
- ``rq:wip:{q}``: started registry, members ``{id}:pagedq`` (RQ's ``{job}:{execution}``; one
  fixed execution so that a peer that reclaims the job re-marks the same member), score ``+inf``:
  pagedq's reclaim, not RQ's timeout cleanup, decides when a worker is dead.
- ``rq:finished:{q}``, ``rq:failed:{q}``, ``rq:canceled:{q}``: registries scored by expiry
  time, as RQ's; each transition also drops expired members, since the dashboard never cleans.
- ``rq:results:{id}``: RQ's result stream (``type`` 1 successful / 2 failed, ``return_value``
  base64 of JSON, ``exc_string`` base64 of zlib).
- ``rq:workers``, ``rq:workers:{q}``: sets of ``rq:worker:{name}`` hashes (``birth``,
  ``last_heartbeat``, ``queues`` comma-joined, ``pid``, ``hostname``, ``python_version``,
  ``state``; pagedq's ``model``, the model the worker serves), which expire unless heartbeats
  come. ``current_job`` is never set: rq-dashboard's worker view fetches it with the pickle
  serializer and breaks on JSON jobs.

The job transitions (queued -> started -> finished / failed / canceled) are
``producer.rq_transitions``: one script call for many jobs.

``enqueue_ops`` is also pagedq's submit: one Lua script that, atomically, refuses the batch when
the queue is full, skips ids already submitted (so a retried or resumed submit is idempotent),
appends each job to the stream and creates its RQ record.
"""

import json
import os
import socket
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from .core import QueueFull
from .protocol import GROUP, JOB_FIELD, Job, queue_key, results_key

FUNC = "pagedq.generate"
EXECUTION = "pagedq"
RESULT_TTL = 24 * 3600  # how long finished and canceled records stay
FAILURE_TTL = 7 * 24 * 3600  # failed ones stay longer, as in RQ
QUEUES = "rq:queues"
WORKERS = "rq:workers"


def job_key(job_id: str) -> str:
    return f"rq:job:{job_id}"


def rq_queue_key(queue: str) -> str:
    return f"rq:queue:{queue}"


def registry_key(kind: str, queue: str) -> str:
    """``kind``: ``wip`` (started), ``finished``, ``failed`` or ``canceled``."""
    return f"rq:{kind}:{queue}"


def worker_key(name: str) -> str:
    return f"rq:worker:{name}"


RQ_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"  # rq.utils.utcformat's, always UTC


def timestamp(t: float | None = None) -> str:
    """RQ's date format (``rq.utils.utcformat``)."""
    when = datetime.now(UTC) if t is None else datetime.fromtimestamp(t, UTC)
    return when.strftime(RQ_TIME_FORMAT)


def parse_timestamp(text: str) -> float:
    """``timestamp``'s inverse: unix time of an RQ date."""
    return datetime.strptime(text, RQ_TIME_FORMAT).replace(tzinfo=UTC).timestamp()


def describe(job: Job) -> str:
    """A short call string for the dashboard's job lists, like RQ's ``description``."""
    if job.messages is not None:
        head = repr(job.messages[-1].content)
    elif isinstance(job.prompt, str):
        head = repr(job.prompt)
    else:
        head = f"<{len(job.prompt or [])} token ids>"
    head = head if len(head) <= 75 else head[:72] + "..."
    extra = job.sampling.model_dump(exclude_defaults=True)
    if job.priority:
        extra["priority"] = job.priority
    return f"{FUNC}({', '.join([head] + [f'{k}={v!r}' for k, v in sorted(extra.items())])})"


def rq_fields(job: Job) -> list[str]:
    """The RQ hash of a queued job, flattened field, value, ..."""
    created = timestamp(job.created_at or None)
    data = json.dumps([FUNC, None, [], job.model_dump(mode="json")])
    fields = {"data": data, "status": "queued", "origin": job.queue,
              "description": describe(job), "created_at": created, "enqueued_at": created,
              "started_at": "", "ended_at": "", "last_heartbeat": "", "worker_name": ""}
    return [item for pair in fields.items() for item in pair]


# KEYS: the stream, the RQ queue list, rq:queues, then rq:job:{id} and the results key per job.
# ARGV: the group, the length limit (-1: none), then id, Job JSON, RQ hash (JSON array) per job.
_ENQUEUE = """
local stream, rq_queue = KEYS[1], KEYS[2]
local group, max_len = ARGV[1], tonumber(ARGV[2])
local info = nil
if redis.call('EXISTS', stream) == 1 then
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local fields = {}
    for i = 1, #g, 2 do fields[g[i]] = g[i + 1] end
    if fields['name'] == group then info = fields end
  end
end
local waiting
if not info then
  -- from id 0, so that no job submitted before the first worker starts is skipped
  redis.call('XGROUP', 'CREATE', stream, group, '0', 'MKSTREAM')
  waiting = redis.call('XLEN', stream)
elseif info['lag'] then
  waiting = info['lag']
else  -- lag unknown (entries deleted past the group's position): count, up to the limit
  waiting = #redis.call('XRANGE', stream, '(' .. info['last-delivered-id'], '+',
                        'COUNT', math.max(max_len, 0) + 1)
end
local reply, new = {0}, 0  -- reply: waiting after the batch, then 1 (added) or 0 per job
for j = 1, (#KEYS - 3) / 2 do
  reply[j + 1] = redis.call('EXISTS', KEYS[2 + 2 * j], KEYS[3 + 2 * j]) == 0 and 1 or 0
  new = new + reply[j + 1]
end
if max_len >= 0 and new > 0 and waiting + new > max_len then return {-1, waiting} end
for j = 1, #reply - 1 do
  if reply[j + 1] == 1 then
    redis.call('XADD', stream, '*', ARGV[3], ARGV[2 + 3 * j])
    redis.call('HSET', KEYS[2 + 2 * j], unpack(cjson.decode(ARGV[3 + 3 * j])))
    redis.call('RPUSH', rq_queue, ARGV[1 + 3 * j])
  end
end
redis.call('SADD', KEYS[3], rq_queue)
reply[1] = waiting + new
return reply
"""


def enqueue_ops(pipe: Any, job: Job | Sequence[Job], max_queue_len: int | None = None) -> None:
    """Adds the submit script for one job or a batch (all or nothing) to a pipeline. Its reply
    goes to ``enqueue_reply``. The jobs must share a queue and have distinct ids."""
    jobs = [job] if isinstance(job, Job) else list(job)
    queue = jobs[0].queue
    if any(j.queue != queue for j in jobs) or len({j.id for j in jobs}) != len(jobs):
        raise ValueError("a batch must have one queue and distinct job ids")
    keys = [queue_key(queue), rq_queue_key(queue), QUEUES]
    args: list[Any] = [GROUP, -1 if max_queue_len is None else max_queue_len, JOB_FIELD]
    for j in jobs:
        keys += [job_key(j.id), results_key(j.id)]
        args += [j.id, j.model_dump_json(), json.dumps(rq_fields(j))]
    pipe.eval(_ENQUEUE, len(keys), *keys, *args)


def enqueue_reply(reply: list[int], queue: str, max_queue_len: int | None) -> list[bool]:
    """Per job, whether it was added (False: that id had been submitted already). Raises
    ``QueueFull`` when the script refused the batch."""
    if reply[0] == -1:
        raise QueueFull(queue, int(reply[1]), max_queue_len or 0)
    return [bool(flag) for flag in reply[1:]]


def register_worker(conn: Any, name: str, queues: list[str], ttl: int,
                    model: str | None = None) -> None:
    """Registers an RQ worker record (state ``idle``) that expires ``ttl`` seconds after the
    last heartbeat. Replaces any previous record of that name. ``model`` (an extra field RQ
    ignores) is what the gateway's ``/v1/models`` shows for the worker's queue."""
    key, now = worker_key(name), timestamp()
    with conn.pipeline() as pipe:  # MULTI: never half registered
        pipe.delete(key)
        pipe.hset(key, mapping={"birth": now, "last_heartbeat": now, "queues": ",".join(queues),
                                "pid": os.getpid(), "hostname": socket.gethostname(),
                                "python_version": sys.version, "state": "idle",
                                **({"model": model} if model else {})})
        pipe.expire(key, ttl)
        pipe.sadd(WORKERS, key)
        for queue in queues:
            pipe.sadd(f"{WORKERS}:{queue}", key)
        pipe.execute()


def heartbeat(conn: Any, name: str, ttl: int, state: str | None = None) -> bool:
    """Extends the worker record's life by ``ttl`` and optionally sets its ``state`` (``busy``,
    ``idle``). False when the record had already expired: call ``register_worker`` again."""
    key = worker_key(name)
    if not conn.expire(key, ttl):
        return False
    conn.hset(key, mapping={"last_heartbeat": timestamp(), **({"state": state} if state else {})})
    return True


def unregister_worker(conn: Any, name: str) -> None:
    key = worker_key(name)
    queues = conn.hget(key, "queues") or ""
    queues = queues.decode() if isinstance(queues, bytes) else queues
    with conn.pipeline() as pipe:
        pipe.srem(WORKERS, key)
        for queue in filter(None, queues.split(",")):
            pipe.srem(f"{WORKERS}:{queue}", key)
        pipe.delete(key)
        pipe.execute()
