"""The gateway's shared state, one per process: settings, the Redis connection for its own
keys, the queues' clients, the file and batch stores, the batch runner."""

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any

from redis.asyncio import Redis

from ..aio import AsyncJobHandle
from .batch_runner import BatchRunner
from .batch_store import BatchStore
from .files import FileStore
from .queues import Queues
from .settings import GatewaySettings


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.redis = Redis.from_url(settings.redis_url, decode_responses=True)
        self.queues = Queues(settings, self.redis)
        self.files = FileStore(self.redis, settings.max_file_bytes)
        self.batches = BatchStore(self.redis)
        self.runner = BatchRunner(self)
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Runs ``work`` in the background, held until it ends (asyncio keeps weak refs)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel(self, handles: Iterable[AsyncJobHandle]) -> None:
        """Cancels jobs without waiting: callable from a generator being closed."""
        for handle in handles:
            self.spawn(handle.cancel())

    async def start(self) -> None:
        await self.redis.ping()
        self.runner.start()

    async def close(self) -> None:
        await self.runner.stop()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.queues.close()
        await self.redis.aclose()
