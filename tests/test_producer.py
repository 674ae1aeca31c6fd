"""The producer: the sync and asyncio clients, against a real redis-server (the worker's side
played by redis_fixtures' FakeWorker or written by hand). The wire models: test_protocol.py."""

import asyncio
import json
import threading
import time

import pytest
import redis
from pydantic import ValidationError

from producer import AsyncClient, Client, InvalidJob, JobFailed, QueueFull
from producer.core import new_job
from producer.protocol import (
    GROUP,
    Chunk,
    Done,
    End,
    Job,
    Usage,
    cancel_key,
    queue_key,
    results_key,
)

pytest_plugins = ["redis_fixtures"]  # a real redis-server per test

def test_submit_writes_the_stream_entry_and_the_rq_record(redis_url: str) -> None:
    client = Client(redis_url)
    job = client.submit([5, 6, 7], n=2, max_tokens=8, seed=1, priority=-1, job_id="job-1")
    assert job.id == "job-1"
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    [(_, fields)] = r.xrange(queue_key("default"))
    wire = Job.model_validate_json(fields["job"])
    assert (wire.prompt, wire.sampling.n, wire.sampling.seed) == ([5, 6, 7], 2, 1)
    assert wire.priority == -1 and wire.sampling.max_tokens == 8
    record = r.hgetall("rq:job:job-1")
    assert record["status"] == "queued" and record["origin"] == "default"
    func, _, _, kwargs = json.loads(record["data"])
    assert func == "pagedq.generate" and kwargs["id"] == "job-1"
    assert r.lrange("rq:queue:default", 0, -1) == ["job-1"]
    # the group exists from id 0: the first worker to come sees the job
    [group] = r.xinfo_groups(queue_key("default"))
    assert group["name"] == GROUP and group["lag"] == 1


def test_queue_full_counts_undelivered_jobs_and_adds_nothing(redis_url: str) -> None:
    client = Client(redis_url, max_queue_len=3)
    client.submit_many([{"prompt": f"p{i}"} for i in range(2)])
    with pytest.raises(QueueFull, match=r"2 jobs not yet delivered to a worker, limit 3"):
        client.submit_many([{"prompt": "a", "job_id": "x1"}, {"prompt": "b", "job_id": "x2"}])
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    assert r.xlen(queue_key("default")) == 2 and not r.exists("rq:job:x1", "rq:job:x2")
    client.submit("fits")
    with pytest.raises(QueueFull):
        client.submit("one too many")
    # delivered (not yet finished) jobs no longer count
    r.xreadgroup(GROUP, "w", {queue_key("default"): ">"}, count=2)
    client.submit_many([{"prompt": "a"}, {"prompt": "b"}])
    assert r.xlen(queue_key("default")) == 5


def test_a_job_id_is_an_idempotency_key(redis_url: str) -> None:
    client = Client(redis_url)
    first = client.submit("hello", job_id="same")
    again = client.submit("something else", job_id="same")
    assert again.id == first.id == "same"
    assert client.redis.xlen(queue_key("default")) == 1
    with pytest.raises(ValueError, match="distinct job ids"):
        client.submit_many([{"prompt": "a", "job_id": "d"}, {"prompt": "b", "job_id": "d"}])


def test_stream_result_and_status_follow_the_worker(redis_url: str, make_fake_worker) -> None:
    client, worker = Client(redis_url), make_fake_worker()
    job = client.submit("hi", n=2, max_tokens=3)
    assert job.status() == "queued"
    assert worker.step()
    events = list(job.stream(timeout=5))
    assert [type(e) for e in events] == ([Chunk] * 3 + [Done]) * 2 + [End]
    assert [(e.sample, e.seq) for e in events if isinstance(e, Chunk)] == \
        [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    result = job.result(timeout=5)
    assert result.status == "finished" == job.status()
    assert [o.text for o in result.outputs] == [" s0t0 s0t1 s0t2", " s1t0 s1t1 s1t2"]
    assert result.outputs[1].token_ids == [100, 101, 102]
    assert [o.finish_reason for o in result.outputs] == ["length", "length"]
    assert result.usage.completion_tokens == 6
    # later, from another client, until the result stream expires
    assert Client(redis_url).job(job.id).result(timeout=1).outputs[0].text == " s0t0 s0t1 s0t2"
    client.redis.pexpire(results_key(job.id), 1)
    time.sleep(0.05)
    with pytest.raises(TimeoutError):
        client.job(job.id).result(timeout=0.2)


def test_events_stream_as_they_are_written(redis_url: str) -> None:
    client = Client(redis_url)
    job = client.submit("hi")
    key = results_key(job.id)
    stream = job.stream(timeout=5)
    client.redis.xadd(key, {"event": Chunk(sample=0, seq=0, text="a", token_ids=[1])
                            .model_dump_json()})
    assert next(stream).text == "a"  # before the job ends
    assert job.status() == "started"
    for event in [Chunk(sample=0, seq=1, text="b", token_ids=[2]),
                  Done(sample=0, finish_reason="stop", usage=Usage(completion_tokens=2)),
                  End(usage=Usage(completion_tokens=2))]:
        client.redis.xadd(key, {"event": event.model_dump_json()})
    assert [e.type for e in stream] == ["chunk", "done", "end"]


def test_timeouts_are_clear(redis_url: str) -> None:
    job = Client(redis_url).submit("nobody is listening")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not finish within 0.3 s \(status 'queued'"):
        job.result(timeout=0.3)
    assert 0.25 < time.monotonic() - start < 2
    with pytest.raises(TimeoutError, match="no event within 0.2 s"):
        next(job.stream(timeout=0.2))


def test_a_failed_job_raises_job_failed(redis_url: str, make_fake_worker) -> None:
    client, worker = Client(redis_url), make_fake_worker()
    job = client.submit("please FAIL")
    worker.step()
    with pytest.raises(JobFailed, match="invalid_request") as failed:
        job.result(timeout=5)
    assert failed.value.code == "invalid_request" and failed.value.job_id == job.id
    with pytest.raises(JobFailed):
        list(job.stream(timeout=5))
    assert job.status() == "failed"


def test_cancel_aborts_a_running_job(redis_url: str, make_fake_worker) -> None:
    client = Client(redis_url, cancel_ttl=60)
    make_fake_worker(delay=0.2).start()
    job = client.submit("a long one", max_tokens=4)
    assert next(job.stream(timeout=5)).seq == 0
    job.cancel()
    assert 0 < client.redis.ttl(cancel_key(job.id)) <= 60
    result = job.result(timeout=5)
    assert result.outputs[0].finish_reason == "abort" and len(result.outputs[0].token_ids) < 4
    assert result.status == "canceled" == job.status()


def test_a_job_canceled_after_some_samples_finished_is_canceled(redis_url: str) -> None:
    """As the worker's RQ record says: one sample finished before the cancel, one aborted."""
    client = Client(redis_url)
    job = client.submit("two samples", n=2)
    usage = Usage(prompt_tokens=2, completion_tokens=1)
    for event in (Chunk(sample=0, seq=0, text="a", token_ids=[5]),
                  Done(sample=0, finish_reason="length", usage=usage),
                  Done(sample=1, finish_reason="abort", usage=Usage(prompt_tokens=2)),
                  End(usage=usage)):
        client.redis.xadd(results_key(job.id), {"event": event.model_dump_json()})
    result = job.result(timeout=5)
    assert [o.finish_reason for o in result.outputs] == ["length", "abort"]
    assert result.status == "canceled" == job.status()


def test_connection_loss_is_retried_and_reads_resume(redis_server_factory) -> None:
    server = redis_server_factory(aof=True)
    client = Client(server.url)
    job = client.submit("survive a restart", job_id="r1")
    key = results_key(job.id)
    events = [Chunk(sample=0, seq=i, text=f"t{i}", token_ids=[i]) for i in range(4)]
    for event in events[:2]:
        client.redis.xadd(key, {"event": event.model_dump_json()})
    stream = job.stream(timeout=10)
    assert [next(stream).seq, next(stream).seq] == [0, 1]

    def come_back() -> None:
        time.sleep(0.4)
        server.start()
        writer = redis.Redis.from_url(server.url)
        for event in [*events[2:], Done(sample=0, finish_reason="stop", usage=Usage()),
                      End(usage=Usage())]:
            writer.xadd(key, {"event": event.model_dump_json()})

    server.stop()
    thread = threading.Thread(target=come_back)
    thread.start()
    try:
        assert [e.seq for e in stream if isinstance(e, Chunk)] == [2, 3]  # none lost, none twice
        server.stop()
        thread.join()
        thread = threading.Thread(target=lambda: (time.sleep(0.3), server.start()))
        thread.start()
        client.submit("and a submit", job_id="r2")  # retried until the server is back
    finally:
        thread.join()
    assert client.redis.xlen(queue_key("default")) == 2
    with pytest.raises(redis.ConnectionError):  # bounded: a server that stays away is an error
        server.stop()
        Client(server.url, retries=2, backoff_cap=0.05).submit("nobody home")


def test_async_client(redis_url: str, make_fake_worker) -> None:
    make_fake_worker(delay=0.05).start()

    async def scenario() -> None:
        async with AsyncClient(redis_url, max_queue_len=5) as client:
            job = await client.submit(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            events = [event async for event in job.stream(timeout=5)]
            assert [e.type for e in events] == ["chunk", "chunk", "done", "end"]
            assert (await job.result(timeout=5)).outputs[0].text == " s0t0 s0t1"
            assert await job.status() == "finished"
            jobs = await client.submit_many([{"prompt": "FAIL"}, {"prompt": "x", "max_tokens": 4}])
            with pytest.raises(JobFailed):
                await jobs[0].result(timeout=5)
            assert (await anext(jobs[1].stream(timeout=5))).type == "chunk"
            await jobs[1].cancel()
            assert (await jobs[1].result(timeout=5)).status == "canceled"
            assert await client.job(jobs[1].id).status() == "canceled"
            with pytest.raises(TimeoutError):
                await client.job("nope").result(timeout=0.2)
            with pytest.raises(QueueFull):
                await client.submit_many([{"prompt": str(i)} for i in range(6)])

    asyncio.run(scenario())


def test_submit_explains_a_bad_job_and_takes_stop_none(redis_url: str) -> None:
    """Newcomers: a clear error (not pydantic's raw ValidationError) and vLLM's stop=None."""
    client = Client(redis_url)
    with pytest.raises(InvalidJob) as bad:
        client.submit("x", temperature=-1, top_p=0)
    assert not isinstance(bad.value, ValidationError) and isinstance(bad.value, ValueError)
    assert str(bad.value).startswith("invalid job: temperature: Input should be greater")
    assert "; top_p: Input should be greater than 0" in str(bad.value)
    assert [e["loc"] for e in bad.value.errors] == [("temperature",), ("top_p",)]
    assert not redis.Redis.from_url(redis_url).exists(queue_key("default"))
    job = new_job("default", "x", stop=None)
    assert job.sampling.stop == []
