"""RQ mirror transitions (queued -> started -> finished / failed / canceled), many jobs per
script call: a worker sends every transition of one publish round trip as one EVAL, instead of
a dozen commands per job.

Per job the script writes what ``producer.rq_mirror`` describes: the ``rq:job:{id}`` hash
(``status``, ``started_at``, ``last_heartbeat``, ``worker_name``, ``ended_at``, ``exc_info``;
it expires ``ttl`` seconds after the job ends), the started registry (member ``{id}:pagedq``,
score ``+inf``), the finished / failed / canceled registries (scored by expiry; expired members
dropped once per call), ``rq:results:{id}``, and the ending worker's ``successful_job_count`` /
``failed_job_count`` in its ``rq:worker:{name}`` record (RQ's own counters; its
``total_working_time`` is not kept). A job leaves the ``rq:queue:{q}`` list only
while its hash still says ``queued``: the list is scanned once per job (from the head, where
the oldest jobs are, and only to the first match), never for a job already started. Re-applying
a transition (a re-sent round trip, a peer's reclaim) changes no count.

A transition may carry a fence: the length the job's result stream (``pagedq:results:{id}``)
must have when it is applied, else it is skipped. A worker's transitions are fenced as its
events are, so that a worker that stalled while a peer took its job over writes no RQ state
for it (the peer's transitions are the truth).
"""

import json
import time
import zlib
from base64 import b64encode
from dataclasses import dataclass, field
from typing import Any

from .protocol import results_key
from .rq_mirror import (
    EXECUTION,
    FAILURE_TTL,
    RESULT_TTL,
    job_key,
    registry_key,
    rq_queue_key,
    timestamp,
)

_ENDED = ("finished", "failed", "canceled")

# KEYS: rq:queue:{q}, rq:wip:{q}, rq:finished:{q}, rq:failed:{q}, rq:canceled:{q}, then per
# transition rq:job:{id}, rq:results:{id} and pagedq:results:{id}. ARGV: now (unix time), now
# (RQ's format), then per transition its status, its fence (the result stream's length; '' for
# none) and job id, and for ``started`` the worker name, for an end the ttl, exc_info ('' for
# none), the result type ('' for none, 1 success, 2 failure) and its payload.
_APPLY = f"""
local queue, wip = KEYS[1], KEYS[2]
local ended = {{finished = KEYS[3], failed = KEYS[4], canceled = KEYS[5]}}
local now, stamp = tonumber(ARGV[1]), ARGV[2]
local touched = {{}}
local a, k = 3, 6
while a <= #ARGV do
  -- ARGV[a]: the status, a + 1 the fence, a + 2 the job id, then the status's own arguments
  local status, fence, id, job = ARGV[a], ARGV[a + 1], ARGV[a + 2], KEYS[k]
  local width = status == 'started' and 4 or 7
  if fence == '' or redis.call('XLEN', KEYS[k + 2]) == tonumber(fence) then
    local previous = redis.call('HGET', job, 'status')
    if previous == 'queued' then redis.call('LREM', queue, 1, id) end
    if status == 'started' then
      redis.call('ZADD', wip, '+inf', id .. ':{EXECUTION}')
      redis.call('HSET', job, 'status', status, 'started_at', stamp, 'last_heartbeat', stamp,
                 'worker_name', ARGV[a + 3])
    else
      local ttl = tonumber(ARGV[a + 3])
      redis.call('ZREM', wip, id .. ':{EXECUTION}')
      for name, key in pairs(ended) do
        if name == status then
          redis.call('ZADD', key, now + ttl, id)
          touched[key] = true
        else
          redis.call('ZREM', key, id)
        end
      end
      local worker = redis.call('HGET', job, 'worker_name')
      if previous ~= status and status ~= 'canceled' and worker and worker ~= '' then
        -- RQ's per-worker counts, as rq-dashboard shows them; only on a live record (HINCRBY
        -- on an expired one would leave a key without TTL). RQ's key, rq_mirror.worker_key.
        local record = 'rq:worker:' .. worker
        if redis.call('EXISTS', record) == 1 then
          redis.call('HINCRBY', record, status == 'finished' and 'successful_job_count'
                     or 'failed_job_count', 1)
        end
      end
      redis.call('HSET', job, 'status', status, 'ended_at', stamp)
      if ARGV[a + 4] ~= '' then redis.call('HSET', job, 'exc_info', ARGV[a + 4]) end
      redis.call('EXPIRE', job, ttl)
      local kind = ARGV[a + 5]
      if kind ~= '' then
        local name = kind == '1' and 'return_value' or 'exc_string'
        redis.call('XADD', KEYS[k + 1], 'MAXLEN', 10, '*', 'type', kind, 'worker_name', '',
                   name, ARGV[a + 6])
        redis.call('EXPIRE', KEYS[k + 1], ttl)
      end
    end
  end
  a = a + width
  k = k + 3
end
for key in pairs(touched) do redis.call('ZREMRANGEBYSCORE', key, 0, now) end
return 1
"""


@dataclass
class Transitions:
    """RQ transitions of jobs of one queue, in order, for one script call (``add_to``)."""

    jobs: list[str] = field(default_factory=list)  # per transition, its job id
    args: list[list[Any]] = field(default_factory=list)  # per transition, its ARGV part
    fences: list[int | None] = field(default_factory=list)  # per transition, or None

    def started(self, job_id: str, worker_name: str, fence: int | None = None) -> None:
        """-> started, by ``worker_name``; ``fence``: the result stream's length it needs
        (see ``add_to``)."""
        self._add(job_id, ["started", job_id, worker_name], fence)

    def finished(self, job_id: str, result: dict[str, Any], ttl: int = RESULT_TTL) -> None:
        """-> finished; ``result`` (JSON-able) becomes the RQ job's return value."""
        value = b64encode(json.dumps(result).encode()).decode()
        self._add(job_id, ["finished", job_id, ttl, "", 1, value])

    def failed(self, job_id: str, message: str, ttl: int = FAILURE_TTL) -> None:
        """-> failed; ``message`` is shown as the RQ job's exception."""
        packed = zlib.compress(message.encode())
        self._add(job_id, ["failed", job_id, ttl, packed, 2, b64encode(packed).decode()])

    def canceled(self, job_id: str, ttl: int = RESULT_TTL) -> None:
        """-> canceled."""
        self._add(job_id, ["canceled", job_id, ttl, "", "", ""])

    def _add(self, job_id: str, args: list[Any], fence: int | None = None) -> None:
        self.jobs.append(job_id)
        self.args.append(args)
        self.fences.append(fence)

    def discard(self, job_ids: set[str]) -> None:
        """Forgets the transitions of these jobs (another worker continues them)."""
        keep = [i for i, job_id in enumerate(self.jobs) if job_id not in job_ids]
        self.jobs = [self.jobs[i] for i in keep]
        self.args = [self.args[i] for i in keep]
        self.fences = [self.fences[i] for i in keep]

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def add_to(self, pipe: Any, queue: str, fences: dict[str, int] | None = None) -> None:
        """Adds the script call that applies every transition to a pipeline (nothing if none).
        One timestamp for all: they happen in the same round trip. ``fences``: per job, the
        length its result stream must have; a transition of such a job, or one given a fence
        of its own, is applied only if the stream has that length (else another worker wrote
        it: it owns the job now)."""
        if not self.jobs:
            return
        fences = fences or {}
        keys = [rq_queue_key(queue),
                *(registry_key(kind, queue) for kind in ("wip", *_ENDED))]
        now = time.time()
        args: list[Any] = [repr(now), timestamp(now)]
        for job_id, part, own in zip(self.jobs, self.args, self.fences, strict=True):
            keys += [job_key(job_id), f"rq:results:{job_id}", results_key(job_id)]
            fence = fences.get(job_id, own)
            args += [part[0], "" if fence is None else fence, *part[1:]]
        pipe.eval(_APPLY, len(keys), *keys, *args)
