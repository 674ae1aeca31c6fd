"""The gateway for tests: the real app on uvicorn, in a thread of the test process, on a free
loopback port; ``stop()`` shuts it down as SIGTERM would (its batch leases are released) and
``start()`` brings it back on the same port, like a restart. Also a real worker process on the
tiny random model, serving queue ``q``."""

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import uvicorn
from acl_server import acl_server
from test_worker_recovery import spawn

from producer.gateway.app import create_app
from producer.gateway.settings import GatewaySettings
from worker.redis_server import RedisServer, free_port

KEYS = ["key-one", "key-two"]


class GatewayThread:
    def __init__(self, redis_url: str, **overrides: Any) -> None:
        self.port = free_port()
        self.settings = GatewaySettings(redis_url=redis_url, port=self.port, api_key=KEYS,
                                        **overrides)
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self, key: str = KEYS[0], **kwargs: Any) -> openai.OpenAI:
        """The official SDK, without its retries: each status must reach the test."""
        return openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0, **kwargs)

    def start(self) -> "GatewayThread":
        config = uvicorn.Config(create_app(self.settings), host="127.0.0.1", port=self.port,
                                log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "gateway not up"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self.server is not None and self.thread is not None:
            self.server.should_exit = True
            self.thread.join(30)
            assert not self.thread.is_alive(), "the gateway did not stop"
        self.server = self.thread = None


@pytest.fixture
def make_gateway() -> Iterator[Callable[..., GatewayThread]]:
    """``make_gateway(redis_url, **settings)``: started gateways, stopped at teardown."""
    made: list[GatewayThread] = []

    def make(redis_url: str, **overrides: Any) -> GatewayThread:
        made.append(GatewayThread(redis_url, **overrides).start())
        return made[-1]

    yield make
    for gateway in made:
        gateway.stop()


@pytest.fixture(scope="session")
def stack(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[RedisServer, GatewayThread]]:
    """A redis-server with worker/redis.acl's users, one worker process on ``q`` (as user
    ``worker``) and a gateway (as user ``gateway``: every gateway test checks that its ACL
    lets it work), shared by the gateway's tests (each uses queues or ids of its own);
    ``server.url`` is the admin's."""
    server, urls = acl_server(tmp_path_factory.mktemp("redis"))
    worker = spawn(urls["worker"], tiny_llama, "gw-worker")
    gateway = GatewayThread(urls["gateway"], max_queue_len=50, workers_cache_s=0.2,
                            max_file_bytes=1 << 20).start()
    try:
        yield server, gateway
    finally:
        gateway.stop()
        worker.kill()
        worker.wait(10)
        server.stop()
