"""Malformed jobs, raw or through the client, each end in an `error` event and a failed RQ
record, while the good jobs between them run and the worker keeps serving."""

import json

import pytest
from rq.registry import FailedJobRegistry
from test_worker import QUEUE, events_of, one_torch_thread, serving, wait_for  # noqa: F401

from producer import Client, Job, JobFailed
from producer.protocol import JOB_FIELD, Error, queue_key
from worker import driver

pytest_plugins = ["redis_fixtures"]  # a real redis-server per test


def _job(job_id: str, **fields: object) -> str:
    return json.dumps({"id": job_id, "prompt": "hello", **fields})


def _sampling(job_id: str, **sampling: object) -> str:
    return _job(job_id, sampling=sampling)


# (the raw `job` field, or None for an entry without one; the job id its error goes to, or
# None for the entry id; the error code)
RAW = [
    ("not json at all", None, "invalid_job"),
    ("[1, 2, 3]", None, "invalid_job"),
    ("{}", None, "invalid_job"),
    (None, None, "invalid_job"),
    (json.dumps({"id": "no-prompt"}), "no-prompt", "invalid_job"),
    (_job("unknown-field", colour="blue"), "unknown-field", "invalid_job"),
    (_job("prompt-type", prompt=123), "prompt-type", "invalid_job"),
    (_job("empty-prompt", prompt=""), "empty-prompt", "invalid_job"),
    (_job("float-token", prompt=[1, 2.5]), "float-token", "invalid_job"),
    (_job("negative-token", prompt=[-3]), "negative-token", "invalid_job"),
    (_job("both", messages=[{"role": "user", "content": "hi"}]), "both", "invalid_job"),
    (json.dumps({"id": "no-messages", "messages": []}), "no-messages", "invalid_job"),
    (json.dumps({"id": "bad-role", "messages": [{"role": "robot", "content": "x"}]}),
     "bad-role", "invalid_job"),
    (_job("version", v=2), "version", "invalid_job"),
    (_job("x" * 200), None, "invalid_job"),
    (_job("colon:id"), None, "invalid_job"),
    (_job("sampling-type", sampling="fast"), "sampling-type", "invalid_job"),
    (_sampling("n-type", n="many"), "n-type", "invalid_job"),
    (_sampling("n-zero", n=0), "n-zero", "invalid_job"),
    (_sampling("n-absurd", n=100_000), "n-absurd", "invalid_job"),
    (_sampling("max-zero", max_tokens=0), "max-zero", "invalid_job"),
    (_sampling("max-absurd", max_tokens=10**12), "max-absurd", "invalid_job"),
    (_sampling("cold", temperature=-1), "cold", "invalid_job"),
    (_sampling("top-p", top_p=2), "top-p", "invalid_job"),
    (_sampling("stop-id", stop_token_ids=[-1]), "stop-id", "invalid_job"),
    (_sampling("logprobs", logprobs=50), "logprobs", "invalid_job"),
    (_sampling("min-max", min_tokens=10, max_tokens=5), "min-max", "invalid_job"),
    (_sampling("beam-zero", beam_width=0), "beam-zero", "invalid_job"),
    (_sampling("beam-n", beam_width=2, n=2), "beam-n", "invalid_job"),
    (_sampling("beam-hot", beam_width=2, temperature=0.7), "beam-hot", "invalid_job"),
    (_sampling("beam-stopping", beam_width=2, early_stopping="soon"), "beam-stopping",
     "invalid_job"),
]
# Valid for the protocol, refused by the engine: submitted through the client.
REFUSED = [
    {"prompt": [5000], "job_id": "out-of-vocab"},
    {"prompt": [7] * 3000, "job_id": "too-long"},
    {"prompt": [7] * 100, "max_tokens": 2000, "job_id": "past-context"},
    {"prompt": "hi", "n": 20, "job_id": "n-over-slots"},  # max_num_seqs is 16
    {"prompt": "hi", "beam_width": 20, "job_id": "beams-over-slots"},
]


def test_malformed_jobs_fail_alone(redis_url, tiny_llama) -> None:
    client = Client(redis_url, queue=QUEUE)
    conn = client.redis
    good, failed = [], {}
    with serving(redis_url, tiny_llama):
        for i, (raw, job_id, code) in enumerate(RAW):
            fields = {"payload": "x"} if raw is None else {JOB_FIELD: raw}
            entry_id = conn.xadd(queue_key(QUEUE), fields)
            failed[job_id or entry_id] = code
            good.append(client.submit(f"good {i}", max_tokens=8, temperature=0))
        for spec in REFUSED:
            handle = client.submit(**spec)
            failed[handle.id] = "invalid_request"
            good.append(client.submit("good again", max_tokens=8, temperature=0))
        assert all(g.result(timeout=30).status == "finished" for g in good)
        for job_id, code in failed.items():
            with pytest.raises(JobFailed) as info:
                client.job(job_id).result(timeout=10)
            assert info.value.code == code, (job_id, info.value.message)
            (event,) = events_of(conn, job_id)
            assert isinstance(event, Error) and event.message
    assert len(failed) == len(RAW) + len(REFUSED) >= 20
    registry = FailedJobRegistry(QUEUE, connection=conn)
    assert registry.count == len(failed)
    assert set(registry.get_job_ids()) == set(failed)
    assert client.stats()["pending"] == 0


def test_unexpected_errors_fail_the_job_not_the_worker(redis_url, tiny_llama,
                                                        monkeypatch) -> None:
    client = Client(redis_url, queue=QUEUE)
    render = driver.prompt_token_ids

    def render_or_explode(tokenizer: object, job: Job) -> list[int]:
        if job.prompt == "boom":
            raise RuntimeError("the tokenizer exploded")
        return render(tokenizer, job)

    monkeypatch.setattr(driver, "prompt_token_ids", render_or_explode)
    with serving(redis_url, tiny_llama) as worker:
        with pytest.raises(JobFailed, match="exploded") as info:
            client.submit("boom").result(timeout=10)
        assert info.value.code == "internal"

        def fault_once() -> None:
            del worker.engine.step  # the next step is the engine's own again
            raise RuntimeError("kernel fault")

        worker.engine.step = fault_once
        with pytest.raises(JobFailed, match="kernel fault"):
            client.submit("unlucky", max_tokens=50).result(timeout=10)
        assert client.submit("fine", max_tokens=5).result(timeout=10).status == "finished"


def test_a_job_id_that_already_ran_is_not_run_again(redis_url, tiny_llama) -> None:
    client = Client(redis_url, queue=QUEUE)
    with serving(redis_url, tiny_llama):
        first = client.submit("once", job_id="once", max_tokens=5).result(timeout=10)
        raw = Job(id="once", queue=QUEUE, prompt="twice").model_dump_json()
        client.redis.xadd(queue_key(QUEUE), {JOB_FIELD: raw})  # past the client's id check
        # Its first write finds the stream written: it stays pending until reclaimed, when
        # the `end` already there has it acknowledged.
        wait_for(lambda: (s := client.stats())["pending"] == 0 and s["lag"] == 0,
                 what="the repeat to be acknowledged")
    assert client.job("once").result(timeout=1) == first
