"""Models are queues: the live workers (their RQ records, which expire without heartbeats) tell
which queues are served and by which model; a request's ``model`` picks the queue, and its jobs
go through that queue's ``AsyncClient``.

Decisions:
- 404 for a model that is no queue at all (no job stream and no worker); 503 for a queue with
  a job stream but no live worker: jobs would wait for nobody, so the request is refused rather
  than left hanging.
- The worker list is read at most once per ``workers_cache_s`` (one SMEMBERS and one pipelined
  HGETALL per worker), not per request: under 2,000 concurrent requests that would be 2,000
  reads of the same thing.
"""

import asyncio
import time
from typing import Any

from redis.asyncio import Redis

from ..aio import AsyncClient
from ..protocol import queue_key
from ..rq_mirror import WORKERS
from .errors import ApiError
from .settings import GatewaySettings


class Queues:
    def __init__(self, settings: GatewaySettings, conn: Redis) -> None:
        self.settings, self.redis = settings, conn
        self.clients: dict[str, AsyncClient] = {}
        self._served: dict[str, dict[str, Any]] = {}
        self._read_at = -1.0
        self._lock = asyncio.Lock()

    def client(self, queue: str) -> AsyncClient:
        if queue not in self.clients:
            self.clients[queue] = AsyncClient(self.settings.redis_url, queue,
                                              max_queue_len=self.settings.max_queue_len)
        return self.clients[queue]

    async def served(self) -> dict[str, dict[str, Any]]:
        """``{queue: {"model", "created", "workers"}}`` for every queue with a live worker."""
        async with self._lock:
            if time.monotonic() - self._read_at >= self.settings.workers_cache_s:
                self._served = await self._read_workers()
                self._read_at = time.monotonic()
        return self._served

    async def _read_workers(self) -> dict[str, dict[str, Any]]:
        keys = sorted(await self.redis.smembers(WORKERS))
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(key)
            records = await pipe.execute()
        served: dict[str, dict[str, Any]] = {}
        for record in records:
            for queue in filter(None, record.get("queues", "").split(",")):
                entry = served.setdefault(queue, {"model": record.get("model"),
                                                  "created": record.get("birth"), "workers": 0})
                entry["workers"] += 1
        return served

    async def check(self, model: str) -> AsyncClient:
        """The client of the queue named ``model``; 404 or 503 when nothing serves it."""
        if model in await self.served():
            return self.client(model)
        if await self.redis.exists(queue_key(model)):
            raise ApiError(503, f"no worker serves the model `{model}` now; start one with "
                                f"`pagedq-worker --queue {model}`", "no_worker", "model")
        raise ApiError(404, f"The model `{model}` does not exist: a model is a pagedq queue "
                            "(GET /v1/models lists those with live workers)",
                       "model_not_found", "model")

    async def close(self) -> None:
        for client in self.clients.values():
            await client.aclose()
