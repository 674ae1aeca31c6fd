"""The RQ mirror after a run, read with rq's own classes: queued, started, finished, failed and
canceled each count exactly, and the worker registers and unregisters itself."""

import redis
from rq import Queue, Worker
from rq.job import Job as RQJob
from rq.registry import (
    CanceledJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    StartedJobRegistry,
)
from rq.serializers import JSONSerializer
from test_worker import QUEUE, events_of, mixed_specs, one_torch_thread, serving, wait_for  # noqa: F401

from producer import Client
from producer.protocol import JOB_FIELD, Chunk, queue_key

pytest_plugins = ["redis_fixtures"]  # a real redis-server per test


def test_rq_registries_count_every_state(redis_url, tiny_llama) -> None:
    client = Client(redis_url, queue=QUEUE)
    rq_conn = redis.Redis.from_url(redis_url)  # rq reads bytes
    with serving(redis_url, tiny_llama, grace_period=0) as worker:
        assert [w.name for w in Worker.all(connection=rq_conn)] == ["w1"]
        finished = client.submit_many(mixed_specs(6))
        failed = [client.submit([99_999]), client.submit("x", max_tokens=5000)]
        client.redis.xadd(queue_key(QUEUE), {JOB_FIELD: "{broken"})
        canceled = client.submit("cancel me", max_tokens=2000, ignore_eos=True)
        wait_for(lambda: events_of(client.redis, canceled.id), what="the job to start")
        canceled.cancel()
        for handle in finished + [canceled]:
            handle.result(timeout=30)
        wait_for(lambda: all(events_of(client.redis, h.id) for h in failed))
        running = client.submit_many([{"prompt": f"long {i}", "max_tokens": 2000,
                                       "ignore_eos": True} for i in range(3)])
        wait_for(lambda: all(any(isinstance(e, Chunk) for e in events_of(client.redis, h.id))
                             for h in running), what="long jobs under way")
        assert [w.name for w in Worker.all(connection=rq_conn)] == [worker.name]
    # Stopped with no grace: the long jobs stay started (pending for a peer).
    queued = client.submit_many([{"prompt": f"queued {i}"} for i in range(4)])
    counts = {
        "queued": Queue(QUEUE, connection=rq_conn, serializer=JSONSerializer).count,
        "started": StartedJobRegistry(QUEUE, connection=rq_conn).count,
        "finished": FinishedJobRegistry(QUEUE, connection=rq_conn).count,
        "failed": FailedJobRegistry(QUEUE, connection=rq_conn).count,
        "canceled": CanceledJobRegistry(QUEUE, connection=rq_conn).count,
    }
    assert counts == {"queued": len(queued), "started": len(running),
                      "finished": len(finished), "failed": len(failed) + 1, "canceled": 1}
    job = RQJob.fetch(finished[0].id, connection=rq_conn, serializer=JSONSerializer)
    assert job.get_status() == "finished"
    assert job.return_value()["outputs"][0]["text"] == finished[0].result().outputs[0].text
    assert RQJob.fetch(running[0].id, connection=rq_conn,
                       serializer=JSONSerializer).get_status() == "started"
    assert Worker.all(connection=rq_conn) == []
