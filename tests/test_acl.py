"""Least privilege: Redis runs with worker/redis.acl; a producer (Client), a worker and
rq-dashboard each connect as their own user and do their whole job, and each is refused what
belongs to the others."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from rq.serializers import JSONSerializer
from test_worker import QUEUE, one_torch_thread, serving  # noqa: F401

from producer import Client
from producer.protocol import GROUP, cancel_key, queue_key, results_key
from producer.rq_mirror import job_key
from worker.acl import placeholders, render
from worker.redis_server import RedisServer

PASSWORDS = {"ADMIN": "admin-pw", "PRODUCER": "producer-pw", "WORKER": "worker-pw",
             "DASHBOARD": "dashboard-pw"}


@pytest.fixture
def urls(tmp_path: Path) -> Iterator[dict[str, str]]:
    acl = tmp_path / "users.acl"
    acl.write_text(render(PASSWORDS))
    server = RedisServer(data_dir=tmp_path, password=PASSWORDS["ADMIN"],
                         extra_args=["--aclfile", str(acl)]).start()
    base = f"127.0.0.1:{server.port}/0"
    yield {user.lower(): f"redis://{user.lower()}:{pw}@{base}" for user, pw in PASSWORDS.items()
           if user != "ADMIN"}
    server.stop()


def refused(conn: redis.Redis, *command: object) -> bool:
    try:
        conn.execute_command(*command)
    except redis.exceptions.NoPermissionError:
        return True
    return False


def test_the_template_names_each_user() -> None:
    assert placeholders() == set(PASSWORDS)


def test_each_user_does_its_job_and_nothing_else(urls, tiny_llama) -> None:
    from rq_dashboard import web
    from rq_dashboard.cli import make_flask_app

    client = Client(urls["producer"], queue=QUEUE)
    with serving(urls["worker"], tiny_llama, "acl-worker") as worker:
        done = client.submit("hello", max_tokens=4)
        assert done.result(timeout=60).status == "finished"
        long = client.submit("cancel me", max_tokens=500, ignore_eos=True)
        next(iter(long.stream(timeout=60)))
        long.cancel()
        assert long.result(timeout=60).status == "canceled" and long.status() == "canceled"
        stats = client.stats()
        assert stats["workers"][0]["name"] == "acl-worker" and stats["pending"] == 0
        worker_conn = worker.conn
        for command in [("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*"), ("ACL", "LIST"),
                        ("CLIENT", "KILL", "TYPE", "normal"), ("SET", "elsewhere", 1)]:
            assert refused(worker_conn, *command), command
    p = client.redis
    for command in [("FLUSHALL",), ("KEYS", "*"), ("CONFIG", "GET", "*"),
                    ("XREADGROUP", "GROUP", GROUP, "me", "STREAMS", queue_key(QUEUE), ">"),
                    ("XACK", queue_key(QUEUE), GROUP, "0-1"),
                    ("XCLAIM", queue_key(QUEUE), GROUP, "me", 0, "0-1"),
                    ("HGETALL", job_key(done.id)), ("HGET", job_key(done.id), "status"),
                    ("DEL", queue_key(QUEUE)), ("SET", results_key(done.id), "x"),
                    ("EXPIRE", queue_key(QUEUE), 1), ("GET", cancel_key(long.id))]:
        assert refused(p, *command), command
    app = make_flask_app(None, None, None, "")
    app.config["RQ_DASHBOARD_REDIS_URL"] = urls["dashboard"]
    web.setup_rq_connection(app)
    serializer, web.config.serializer = web.config.serializer, JSONSerializer  # as --json does
    try:
        http = app.test_client()
        [queue] = http.get("/0/data/queues.json").get_json()["queues"]
        assert (queue["name"], queue["finished_job_registry_count"]) == (QUEUE, 1)
        finished = http.get(f"/0/data/jobs/{QUEUE}/finished/8/asc/1.json").get_json()["jobs"]
        assert [j["id"] for j in finished] == [done.id]
        assert http.get(f"/0/data/job/{long.id}.json").get_json()["status"] == "canceled"
        for page in ("/0/view/queues", "/0/view/workers", "/0/view/jobs"):
            assert http.get(page, follow_redirects=True).status_code == 200, page
    finally:
        web.config.serializer = serializer
    d = redis.Redis.from_url(urls["dashboard"])
    for command in [("FLUSHALL",), ("XADD", queue_key(QUEUE), "*", "job", "{}"),
                    ("HSET", job_key(done.id), "status", "queued"), ("DEL", job_key(done.id)),
                    ("XRANGE", results_key(done.id), "-", "+")]:
        assert refused(d, *command), command
