"""Where a batch lives: its OpenAI batch object, its answers and its lease, in Redis, so that any
gateway process, or the same one restarted, carries it on.

Keys (the gateway's own):
- ``pagedq:batch:{id}``: hash, one field per field of OpenAI's batch object, each as JSON.
- ``pagedq:batches``: sorted set of batch ids by creation time; ``pagedq:batches:active``: set
  of those not finished yet.
- ``pagedq:batch:{id}:ok`` / ``:failed``: hash, input line index -> output line (JSON). An
  answer is written once (HSETNX): a line that two gateways finish appears once.
- ``pagedq:batch:{id}:lease``: the id of the gateway process running the batch, with a TTL it
  renews; when it stops renewing (a crash), another process (or its restart) takes over.
"""

import json
import time
import uuid
from typing import Any, cast

from redis.asyncio import Redis

from ..protocol import PREFIX
from .errors import ApiError

BATCHES = f"{PREFIX}:batches"
ACTIVE = f"{PREFIX}:batches:active"
RUNNING = ("validating", "in_progress", "finalizing", "cancelling")
# compare-and-set of the status: KEYS[1] the batch; ARGV: new status, time field, now, then
# the statuses it may leave
_TRANSITION = """
local status = redis.call('HGET', KEYS[1], 'status')
for i = 4, #ARGV do
  if status == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[2], ARGV[3])
    return 1
  end
end
return 0
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def batch_key(batch_id: str, part: str = "") -> str:
    return f"{PREFIX}:batch:{batch_id}{':' + part if part else ''}"


def no_such_batch(batch_id: str) -> ApiError:
    return ApiError(404, f"No such Batch object: {batch_id}", "batch_not_found", "batch_id")


def time_field(status: str) -> str:
    """OpenAI's timestamp field of a status: ``cancelled`` -> ``cancelled_at``."""
    return f"{status}_at"


class BatchStore:
    def __init__(self, conn: Redis) -> None:
        self.redis = conn  # decode_responses=True (state.py): its replies are str, as cast
        self.owner = uuid.uuid4().hex  # this process, as a lease holder

    async def create(self, fields: dict[str, Any]) -> dict[str, Any]:
        now = int(time.time())
        batch = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "errors": None,
                 "output_file_id": None, "error_file_id": None, "created_at": now,
                 "expires_at": now + 24 * 3600, "metadata": None, "total": 0,
                 **{time_field(s): None for s in ("in_progress", "finalizing", "completed",
                                                  "failed", "expired", "cancelling",
                                                  "cancelled")}, **fields}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(batch_key(batch["id"]), mapping={k: json.dumps(v) for k, v in
                                                       batch.items()})
            pipe.zadd(BATCHES, {batch["id"]: time.time()})
            if batch["status"] in RUNNING:
                pipe.sadd(ACTIVE, batch["id"])
            await pipe.execute()
        return await self.get(batch["id"])

    async def get(self, batch_id: str) -> dict[str, Any]:
        """OpenAI's batch object, with ``request_counts`` counted from the answers."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(batch_key(batch_id))
            pipe.hlen(batch_key(batch_id, "ok"))
            pipe.hlen(batch_key(batch_id, "failed"))
            raw, ok, failed = await pipe.execute()
        if not raw:
            raise no_such_batch(batch_id)
        batch = {k: json.loads(v) for k, v in raw.items()}
        total = batch.pop("total")
        return batch | {"request_counts": {"total": total, "completed": ok, "failed": failed}}

    async def listing(self, after: str | None, limit: int) -> list[dict[str, Any]]:
        ids = cast(list[str], await self.redis.zrevrange(BATCHES, 0, -1))
        if after in ids:
            ids = ids[ids.index(after) + 1:]
        batches = []
        for batch_id in ids[:limit]:
            try:
                batches.append(await self.get(batch_id))
            except ApiError:  # expired
                await self.redis.zrem(BATCHES, batch_id)
        return batches

    async def transition(self, batch_id: str, to: str, leaving: tuple[str, ...]) -> bool:
        """Sets the status (and its ``*_at`` time) if it is one of ``leaving``."""
        now = json.dumps(int(time.time()))
        return bool(await self.redis.eval(_TRANSITION, 1, batch_key(batch_id), json.dumps(to),
                                          time_field(to), now,
                                          *(json.dumps(s) for s in leaving)))

    async def status(self, batch_id: str) -> str:
        raw = cast(str | None, await self.redis.hget(batch_key(batch_id), "status"))
        if raw is None:
            raise no_such_batch(batch_id)
        return json.loads(raw)

    async def answer(self, batch_id: str, index: int, line: dict[str, Any], ok: bool) -> None:
        await self.redis.hsetnx(batch_key(batch_id, "ok" if ok else "failed"), str(index),
                                json.dumps(line))

    async def answered(self, batch_id: str) -> set[int]:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hkeys(batch_key(batch_id, "ok"))
            pipe.hkeys(batch_key(batch_id, "failed"))
            ok, failed = await pipe.execute()
        return {int(k) for k in ok + failed}

    async def answers(self, batch_id: str, ok: bool) -> str:
        """The answers as JSONL, in input order."""
        lines = cast(dict[str, str],
                     await self.redis.hgetall(batch_key(batch_id, "ok" if ok else "failed")))
        return "".join(lines[k] + "\n" for k in sorted(lines, key=int))

    async def finish(self, batch_id: str, status: str, output_file_id: str | None,
                     error_file_id: str | None, ttl: int) -> None:
        """The final status and the output files; the batch and its answers expire with the
        files."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(batch_key(batch_id), mapping={
                "output_file_id": json.dumps(output_file_id),
                "error_file_id": json.dumps(error_file_id)})
            pipe.srem(ACTIVE, batch_id)
            for part in ("", "ok", "failed"):
                pipe.expire(batch_key(batch_id, part), ttl)
            await pipe.execute()
        await self.transition(batch_id, status, ("finalizing",))

    async def active(self) -> list[str]:
        return sorted(cast(set[str], await self.redis.smembers(ACTIVE)))

    async def take_lease(self, batch_id: str, ttl_s: float) -> bool:
        return bool(await self.redis.set(batch_key(batch_id, "lease"), self.owner, nx=True,
                                         px=int(ttl_s * 1000)))

    async def renew_lease(self, batch_id: str, ttl_s: float) -> bool:
        return bool(await self.redis.eval(_RENEW, 1, batch_key(batch_id, "lease"), self.owner,
                                          int(ttl_s * 1000)))

    async def release_lease(self, batch_id: str) -> None:
        await self.redis.eval(_RELEASE, 1, batch_key(batch_id, "lease"), self.owner)
