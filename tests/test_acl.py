"""Least privilege: Redis runs with worker/redis.acl; a producer (Client), a worker,
rq-dashboard and the gateway each connect as their own user and do their whole job, and each is
refused what belongs to the others. (The gateway's whole test stack runs as ``gateway``: see
tests/gateway_fixtures.py.)"""

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from acl_server import PASSWORDS, acl_server
from rq.serializers import JSONSerializer
from test_gateway_batch import jsonl, line, wait_batch
from test_worker import QUEUE, one_torch_thread, serving  # noqa: F401

from producer import Client
from producer.protocol import CANCELS_KEY, GROUP, cancel_key, dead_key, queue_key, results_key
from producer.rq_mirror import job_key
from worker.acl import placeholders


@pytest.fixture
def urls(tmp_path: Path) -> Iterator[dict[str, str]]:
    server, by_user = acl_server(tmp_path)
    yield by_user
    server.stop()


pytest_plugins = ["redis_fixtures", "gateway_fixtures"]  # `stack`: gateway as `gateway`


def refused(conn: redis.Redis, *command: object) -> bool:
    try:
        conn.execute_command(*command)
    except redis.exceptions.NoPermissionError:
        return True
    except redis.exceptions.ResponseError as e:  # a script's command is refused this way
        return "can't access" in str(e)
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
                    ("XADD", results_key(done.id), "*", "event", "{}"),
                    ("XTRIM", results_key(done.id), "MAXLEN", 0),
                    ("EVAL", "return redis.call('XADD', KEYS[1], '*', 'event', '{}')", 1,
                     results_key(done.id)),
                    ("EXPIRE", queue_key(QUEUE), 1), ("GET", cancel_key(long.id)),
                    ("XRANGE", CANCELS_KEY, "-", "+"), ("DEL", CANCELS_KEY)]:
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


def test_the_gateway_user_serves_files_batches_and_completions_only(stack) -> None:
    server, gateway = stack
    assert gateway.settings.redis_url.startswith("redis://gateway:")
    client = gateway.client()
    text = client.completions.create(model="q", prompt="hi", max_tokens=3).choices[0].text
    assert text
    uploaded = client.files.create(file=("acl.jsonl", jsonl([line("a", {
        "model": "q", "prompt": "hi", "max_tokens": 3})])), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                  completion_window="24h")
    done = wait_batch(client, batch.id)
    assert (done.status, done.request_counts.completed) == ("completed", 1)
    assert [m.id for m in client.models.list()] == ["q"]  # reads the RQ worker records
    admin = redis.Redis.from_url(server.url, decode_responses=True)
    job = next(k for k in admin.scan_iter("rq:job:*"))
    g = redis.Redis.from_url(gateway.settings.redis_url)
    for command in [("FLUSHALL",), ("KEYS", "*"), ("CONFIG", "GET", "*"),
                    ("XREADGROUP", "GROUP", GROUP, "me", "STREAMS", queue_key("q"), ">"),
                    ("XACK", queue_key("q"), GROUP, "0-1"), ("DEL", queue_key("q")),
                    ("HGETALL", job), ("HSETNX", job, "status", "x"), ("DEL", job),
                    ("EXPIRE", job, 1), ("SET", job, "x"), ("SET", results_key("x"), "x"),
                    ("XADD", dead_key("q"), "*", "a", "b"), ("HGET", "elsewhere", "a"),
                    ("SET", "pagedq:other", "x")]:
        assert refused(g, *command), command
