"""The compose stack without Docker, for tests/test_stack.py: each service's own command,
arguments and environment from compose.yaml (and the Dockerfile's ENTRYPOINT and HEALTHCHECK),
run as processes. Redis with the compose's arguments, the ``worker-cpu`` service's
``pagedq-worker`` with the default model, a run of jobs, then rq-dashboard with the compose's
command.

The only changes to what compose would run: the Redis host is 127.0.0.1 and ports are free
ones (inside compose they are ``redis:6379``, 9100 and 9181), ``--bind 127.0.0.1`` for the
dashboard (compose publishes its 0.0.0.0 on 127.0.0.1 only), one torch thread, and Redis's data
in a tmp dir."""

import base64
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import redis
from compose_file import ROOT, load
from test_metrics import get, scrape, value
from test_worker import events_of

from producer import Client
from producer.protocol import Chunk, End
from worker.redis_server import RedisServer, free_port

ENV = {"REDIS_PASSWORD": "stack-pw-0123", "DASHBOARD_PASSWORD": "dash-pw-4567",
       "PRODUCER_REDIS_PASSWORD": "prod-pw-89ab", "WORKER_REDIS_PASSWORD": "work-pw-cdef",
       "DASHBOARD_REDIS_PASSWORD": "dash-redis-pw-0246",
       "GATEWAY_REDIS_PASSWORD": "gw-redis-pw-1357", "GATEWAY_API_KEYS": "gw-key-89ab"}
USER = "admin"  # DASHBOARD_USERNAME's default
DOCKERFILE = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")  # continuation lines
BIN = Path(sys.executable).parent


def localize(environment: dict[str, str], redis_port: int) -> dict[str, str]:
    """A service's environment, its Redis host (``redis:6379`` in compose) made local."""
    return {k: v.replace("@redis:6379/", f"@127.0.0.1:{redis_port}/")
            for k, v in environment.items()}


def dockerfile_json(instruction: str) -> list[str]:
    """The JSON (exec) form of the last ``instruction`` line, e.g. ENTRYPOINT."""
    return json.loads(re.findall(rf"{instruction} (\[.*\])", DOCKERFILE)[-1])


def wait(condition: Any, what: str, timeout: float = 120.0, proc: Any = None,
         log: Path | None = None) -> None:
    """Polls ``condition``; fails early, with the tail of ``log``, if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log else ""
            raise AssertionError(f"{what}: the process exited ({proc.returncode})\n{tail}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def http(url: str, method: str = "GET", auth: tuple[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, method=method)
    if auth:
        token = base64.b64encode(":".join(auth).encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:  # not listening yet
        return 0, str(exc)


def base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("PAGEDQ_", "RQ_DASHBOARD_")) or k == "PAGEDQ_CACHE_DIR"}


def run_jobs(client: Client) -> dict[str, Any]:
    """Three chat jobs that finish (one n=2), one that fails, one canceled while it runs."""
    chats = [client.submit(messages=[{"role": "user", "content": q}], n=n, max_tokens=8,
                           temperature=0.7, seed=i)
             for i, (q, n) in enumerate([("Name a colour.", 1), ("Say hi.", 2),
                                         ("Count to three.", 1)])]
    failed = client.submit([99_999])
    canceled = client.submit("Tell a long story.", max_tokens=2000, ignore_eos=True)
    for event in canceled.stream(timeout=120):
        if isinstance(event, Chunk):
            canceled.cancel()
            break
    for handle in chats + [canceled]:
        handle.result(timeout=120)
    wait(lambda: failed.status() == "failed", "the invalid job to fail")
    ends = [e for h in chats + [canceled] for e in events_of(client.redis, h.id)
            if isinstance(e, End)]
    return {"tokens": sum(e.usage.completion_tokens for e in ends), "failed": failed.id,
            "n_finished": len(chats)}


@contextmanager
def running_stack(tmp: Path) -> Iterator[SimpleNamespace]:
    """Runs the stack in ``tmp`` and a run of jobs; yields what the tests check (the run's
    figures, the worker's metrics, probes, log and exit, the dashboard's URL); stops it all."""
    compose = load(ENV)["services"]
    redis_service = compose["redis"]
    acl = tmp / "users.acl"  # the entrypoint's own rendering, its paths made local
    render = redis_service["entrypoint"][2].replace("/etc/pagedq/redis.acl",
                                                    str(ROOT / "worker" / "redis.acl"))
    render = render.replace("/data/users.acl", str(acl)).split(" && exec")[0]
    subprocess.run(["sh", "-c", render], check=True, env=base_env() | redis_service[
        "environment"])
    server = RedisServer(data_dir=tmp, password=ENV["REDIS_PASSWORD"], extra_args=[
        str(acl) if a == "/data/users.acl" else a for a in redis_service["command"][1:]]).start()
    procs: list[subprocess.Popen] = []
    out = SimpleNamespace(redis_config=redis.Redis.from_url(server.url).config_get("append*"),
                          redis_port=server.port)
    _, check = compose["redis"]["healthcheck"]["test"]  # CMD-SHELL, with the port added
    check = check.replace("redis-cli", f"redis-cli -p {server.port}")
    out.redis_health = [subprocess.run(["sh", "-c", check], timeout=30, env=base_env() | {
        "REDIS_PASSWORD": password}).returncode for password in (ENV["REDIS_PASSWORD"], "no")]
    try:
        # the worker-cpu service: the image's ENTRYPOINT with the service's environment
        metrics_port = free_port()
        env = base_env() | localize(compose["worker-cpu"]["environment"], server.port) | {
            "PAGEDQ_METRICS_PORT": str(metrics_port), "PAGEDQ_THREADS": "1"}
        log = tmp / "worker.log"
        with open(log, "wb") as sink:
            worker = subprocess.Popen([str(BIN / dockerfile_json("ENTRYPOINT")[0])], env=env,
                                      stderr=sink, cwd=tmp)
        procs.append(worker)
        wait(lambda: http(f"http://127.0.0.1:{metrics_port}/readyz")[0] == 200,
             "the worker to be ready", proc=worker, log=log)
        client = Client(server.url, queue=env["PAGEDQ_QUEUE"])
        out.jobs = run_jobs(client)
        idle = {"pagedq_kv_blocks_used": 0, "pagedq_running_sequences": 0,
                "pagedq_waiting_sequences": 0}
        # The engine may sample one token more than was published for the canceled job: the
        # cancel is learnt in the round trip that overlaps the next step, whose tokens drop.
        generated = range(out.jobs["tokens"], out.jobs["tokens"] + 2)
        wait(lambda: {k: value(scrape(metrics_port), k) for k in idle} == idle and value(
            scrape(metrics_port), "pagedq_generated_tokens_total") in generated,
             "an engine snapshot taken idle, after every token and with every block free")
        out.metrics = scrape(metrics_port)
        out.probes = {p: get(metrics_port, f"/{p}") for p in ("healthz", "readyz")}
        healthcheck = dockerfile_json("HEALTHCHECK.*CMD")
        out.healthcheck = subprocess.run([str(BIN / healthcheck[0]), *healthcheck[1:]],
                                         env=env, capture_output=True, text=True, timeout=30)
        worker.terminate()  # SIGTERM, as docker stop
        out.worker_exit = worker.wait(timeout=60)
        out.log = [json.loads(line) for line in log.read_text().splitlines()
                   if line.startswith("{")]
        out.queued = client.submit_many([{"prompt": f"later {i}"} for i in range(2)])
        # the dashboard service: its command and environment
        port = free_port()
        dashboard = compose["dashboard"]
        env = base_env() | localize(dashboard["environment"], server.port)
        log = tmp / "dashboard.log"
        with open(log, "wb") as sink:
            procs.append(subprocess.Popen(
                [str(BIN / dashboard["command"][0]), *dashboard["command"][1:],
                 "--bind", "127.0.0.1", "--port", str(port)],
                env=env, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT))
        out.dashboard = f"http://127.0.0.1:{port}"
        wait(lambda: http(out.dashboard + "/", auth=(USER, ENV["DASHBOARD_PASSWORD"]))[0] == 200,
             "the dashboard to answer", proc=procs[-1], log=log)
        out.tmp = tmp
        yield out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        server.stop()
