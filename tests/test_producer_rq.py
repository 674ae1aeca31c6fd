"""The RQ mirror, read back by rq's own API and by rq-dashboard's JSON routes (both from the
``worker`` extra): every pagedq job must show up there as an RQ job in its true state."""

import pytest
import redis

from producer import Client, rq_mirror

rq = pytest.importorskip("rq")
rq_dashboard = pytest.importorskip("rq_dashboard")
from rq import Queue, Worker  # noqa: E402
from rq.job import Job, JobStatus  # noqa: E402
from rq.registry import (  # noqa: E402
    CanceledJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    StartedJobRegistry,
)
from rq.serializers import JSONSerializer  # noqa: E402

pytest_plugins = ["redis_fixtures"]  # a real redis-server per test


def counts(conn: redis.Redis) -> dict[str, int]:
    return {"queued": Queue("default", connection=conn).count,
            **{name: cls("default", connection=conn).count for name, cls in [
                ("started", StartedJobRegistry), ("finished", FinishedJobRegistry),
                ("failed", FailedJobRegistry), ("canceled", CanceledJobRegistry)]}}


@pytest.fixture
def lifecycle(redis_url: str, make_fake_worker) -> dict[str, str]:
    """One job in each state: queued, started, finished, failed, canceled."""
    client, worker = Client(redis_url), make_fake_worker(name="gpu-0")
    ids = {}
    for state, prompt in [("finished", "hello"), ("failed", "FAIL me"), ("canceled", "stop it")]:
        job = client.submit(prompt, n=2, max_tokens=3, job_id=f"{state}-job")
        if state == "canceled":
            job.cancel()
        worker.step()
        ids[state] = job.id
    ids["started"] = client.submit("taken", job_id="started-job").id
    conn = redis.Redis.from_url(redis_url)
    conn.xreadgroup("workers", "gpu-0", {"pagedq:queue:default": ">"}, count=1)
    from redis_fixtures import mirror  # here: the plugin is registered (and rewritten) by now

    mirror(conn, "default", lambda t: t.started(ids["started"], "gpu-0"))
    ids["queued"] = client.submit([1, 2, 3], temperature=0, job_id="queued-job").id
    return ids


def test_rq_reads_the_mirror(redis_url: str, lifecycle: dict[str, str]) -> None:
    conn = redis.Redis.from_url(redis_url)
    for state, job_id in lifecycle.items():
        job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
        assert job.get_status() == JobStatus(state), state
        assert job.origin == "default" and job.func_name == "pagedq.generate"
        assert job.kwargs["id"] == job_id and job.created_at is not None
    assert counts(conn) == {"queued": 1, "started": 1, "finished": 1, "failed": 1, "canceled": 1}
    assert Queue("default", connection=conn).job_ids == ["queued-job"]
    finished = Job.fetch("finished-job", connection=conn, serializer=JSONSerializer)
    assert finished.return_value() == {"texts": ["sample 0", "sample 1"]}
    assert finished.ended_at >= finished.started_at >= finished.enqueued_at
    assert finished.description == "pagedq.generate('hello', max_tokens=3, n=2)"
    failed = Job.fetch("failed-job", connection=conn, serializer=JSONSerializer)
    assert failed.latest_result().exc_string == "asked to fail"
    started = Job.fetch("started-job", connection=conn, serializer=JSONSerializer)
    assert started.worker_name == "gpu-0"


def test_re_marking_is_harmless(redis_url: str, lifecycle: dict[str, str]) -> None:
    from redis_fixtures import mirror

    conn = redis.Redis.from_url(redis_url)
    mirror(conn, "default", lambda t: t.started("started-job", "gpu-1"))  # a peer reclaims it
    mirror(conn, "default", lambda t: t.finished("finished-job", {"again": True}))
    mirror(conn, "default", lambda t: t.canceled("canceled-job"))
    assert counts(conn) == {"queued": 1, "started": 1, "finished": 1, "failed": 1, "canceled": 1}
    mirror(conn, "default", lambda t: t.finished("started-job", {"done": 1}))  # reclaimed: ends
    assert counts(conn)["started"] == 0 and counts(conn)["finished"] == 2


def test_workers_register_beat_and_leave(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    rq_mirror.register_worker(conn, "gpu-0", ["default", "other"], ttl=30)
    [worker] = Worker.all(connection=conn)
    assert (worker.name, [q.name for q in worker.queues]) == ("gpu-0", ["default", "other"])
    assert worker.get_state() == "idle" and worker.birth_date and worker.last_heartbeat
    assert [w.name for w in Worker.all(queue=Queue("other", connection=conn))] == ["gpu-0"]
    assert rq_mirror.heartbeat(conn, "gpu-0", 30, state="busy")
    assert Worker.all(connection=conn)[0].get_state() == "busy"
    conn.delete("rq:worker:gpu-0")  # missed heartbeats: the record expired
    assert not rq_mirror.heartbeat(conn, "gpu-0", 30) and not conn.exists("rq:worker:gpu-0")
    rq_mirror.register_worker(conn, "gpu-0", ["default"], ttl=30)
    rq_mirror.unregister_worker(conn, "gpu-0")
    assert Worker.all(connection=conn) == [] and not conn.smembers("rq:workers:default")


def test_rq_dashboard_shows_the_mirror(redis_url: str, make_fake_worker,
                                       lifecycle: dict[str, str]) -> None:
    from rq_dashboard import web
    from rq_dashboard.cli import make_flask_app

    app = make_flask_app(None, None, None, "")
    app.config["RQ_DASHBOARD_REDIS_URL"] = redis_url
    web.setup_rq_connection(app)
    make_fake_worker(name="gpu-0")  # registered, as a live worker is
    serializer, web.config.serializer = web.config.serializer, JSONSerializer  # as --json does
    try:
        http = app.test_client()
        [queue] = http.get("/0/data/queues.json").get_json()["queues"]
        assert (queue["name"], queue["count"], queue["finished_job_registry_count"],
                queue["failed_job_registry_count"], queue["started_job_registry_count"],
                queue["canceled_job_registry_count"]) == ("default", 1, 1, 1, 1, 1)
        for registry, job_id in [("queued", "queued-job"), ("started", "started-job"),
                                 ("finished", "finished-job"), ("failed", "failed-job"),
                                 ("canceled", "canceled-job")]:
            page = http.get(f"/0/data/jobs/default/{registry}/8/asc/1.json").get_json()
            assert [j["id"] for j in page["jobs"]] == [job_id], registry
        failed = http.get("/0/data/jobs/default/failed/8/asc/1.json").get_json()["jobs"][0]
        assert failed["exc_info"] == "asked to fail"
        job = http.get("/0/data/job/finished-job.json").get_json()
        assert job["status"] == "finished"
        assert job["result"] == {"texts": ["sample 0", "sample 1"]}
        assert job["description"].startswith("pagedq.generate('hello'")
        [worker] = http.get("/0/data/workers.json").get_json()["workers"]
        assert (worker["name"], worker["queues"], worker["current_job"]) == \
            ("gpu-0", ["default"], "idle")
        for page in ("/0/view/queues", "/0/view/workers", "/0/view/jobs",
                     "/0/view/job/failed-job"):
            assert http.get(page, follow_redirects=True).status_code == 200, page
    finally:
        web.config.serializer = serializer


def test_workers_count_their_successful_and_failed_jobs(redis_url: str,
                                                        lifecycle: dict[str, str]) -> None:
    """rq-dashboard's worker columns: the lifecycle's worker finished one job and failed one
    (a canceled one counts as neither, as in RQ); re-applying an end changes no count."""
    conn = redis.Redis.from_url(redis_url)
    from redis_fixtures import mirror

    mirror(conn, "default", lambda t: t.finished(lifecycle["finished"], {}))
    worker = Worker.find_by_key(rq_mirror.worker_key("gpu-0"), connection=conn)
    assert (worker.successful_job_count, worker.failed_job_count) == (1, 1)
    mirror(conn, "default", lambda t: t.finished(lifecycle["started"], {}))
    worker.refresh()
    assert worker.successful_job_count == 2
