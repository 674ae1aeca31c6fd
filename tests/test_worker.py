"""The worker against a real redis-server: results equal LLM.generate on the same jobs, chunks
stream in order, cancellation and deadlines end a job within one step, malformed jobs fail
alone. Also the helpers the other test_worker_* modules share."""

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from conftest import assert_pool_whole

from engine import LLM
from engine.outputs import RequestOutput
from producer import Client, Job
from producer.core import decode_entries, new_job
from producer.protocol import Chunk, Done, End, Error, Event, cancel_key, results_key
from producer.rq_mirror import job_key, worker_key
from worker.config import Settings, parse_args
from worker.connection import connect
from worker.job_params import engine_params, prompt_token_ids
from worker.publisher import CLOSE_WAIT_S, Batch, Publisher
from worker.service import Worker

pytest_plugins = ["redis_fixtures"]  # a real redis-server per test
QUEUE = "q"
KV_BLOCKS = 256


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Workers run beside the test (and each other) on two cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def settings(url: str, model: Path, name: str, **overrides: Any) -> Settings:
    return Settings(**{"redis_url": url, "queue": QUEUE, "model": str(model), "dtype": "float32",
                       "device": "cpu", "num_kv_blocks": KV_BLOCKS, "max_num_seqs": 16,
                       "consumer": name, "reclaim_idle_ms": 1500, "grace_period": 10.0,
                       **overrides})


@contextmanager
def serving(url: str, model: Path, name: str = "w1", **overrides: Any) -> Iterator[Worker]:
    """A worker running in a thread; stopped (gracefully) and checked whole on exit."""
    worker = Worker(settings(url, model, name, **overrides))
    thread = threading.Thread(target=worker.run, name=name, daemon=True)
    thread.start()
    try:
        wait_for(lambda: worker.conn.exists(worker_key(name)), what=f"worker {name} to start")
        yield worker
    finally:
        worker.stop()
        thread.join(60)
        assert not thread.is_alive(), f"worker {name} did not stop"
    assert_pool_whole(worker.engine)


def reference(model: Path, jobs: list[Job]) -> list[RequestOutput]:
    llm = LLM(str(model), dtype="float32", device="cpu", num_kv_blocks=KV_BLOCKS)
    prompts = [prompt_token_ids(llm.tokenizer, job) for job in jobs]
    params = [engine_params(job.sampling)[0] for job in jobs]
    return llm.generate(prompts, params, use_tqdm=False)


def events_of(conn: redis.Redis, job_id: str) -> list[Event]:
    return [event for _, event in decode_entries(conn.xrange(results_key(job_id)))]


def check_stream(events: list[Event], expected: RequestOutput) -> None:
    """What any reader of the stream sees: per sample, chunks numbered 0, 1, ... whose tokens
    and text are the reference's exactly once, then one `done`; one `end`, last."""
    assert sum(isinstance(e, End) for e in events) == 1 and isinstance(events[-1], End)
    assert not any(isinstance(e, Error) for e in events)
    for out in expected.outputs:
        mine = [e for e in events if isinstance(e, Chunk | Done) and e.sample == out.index]
        chunks, dones = mine[:-1], mine[-1:]
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        assert all(isinstance(c, Chunk) for c in chunks) and isinstance(dones[0], Done)
        assert [t for c in chunks for t in c.token_ids] == out.token_ids
        assert "".join(c.text for c in chunks) == out.text
        assert dones[0].finish_reason == out.finish_reason
        assert dones[0].usage.completion_tokens == len(out.token_ids)
        assert dones[0].usage.prompt_tokens == len(expected.prompt_token_ids)


def wait_for(condition: Any, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def mixed_specs(count: int, max_tokens: int = 40) -> list[dict[str, Any]]:
    """Text, token-id and chat prompts; greedy and seeded sampling; n up to 3; stop strings,
    penalties, logprobs and priorities."""
    texts = ["The queue worker pulls a job", "深度学习模型把文本切分成词元", "Hello! How are",
             "def add(a, b):", "She sells sea shells by", "In 1969, people watched"]
    specs = []
    for i in range(count):
        spec: dict[str, Any] = {"job_id": f"job-{i}", "n": 1 + i % 3, "priority": i % 4,
                                "max_tokens": 4 + (i * 7) % max_tokens}
        text = texts[i % len(texts)]
        if i % 3 == 0:
            spec["prompt"] = text
        elif i % 3 == 1:
            spec["prompt"] = [5 + (i * j) % 900 for j in range(3 + i % 20)]
        else:
            spec["messages"] = [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": text}]
        if i % 2:
            spec["temperature"] = 0.0
        else:
            spec |= {"temperature": 0.8, "seed": i, "top_p": 0.9, "top_k": 50 * (i % 3)}
        if i % 5 == 0:
            spec["stop"] = ["e", "的"]
        if i % 7 == 0:
            spec |= {"presence_penalty": 0.5, "repetition_penalty": 1.2}
        if i % 4 == 3:
            spec["logprobs"] = 2
        specs.append(spec)
    return specs


def test_results_equal_llm_generate_and_stream_in_order(redis_url, tiny_llama) -> None:
    specs = mixed_specs(50)
    expected = reference(tiny_llama, [new_job(QUEUE, **spec) for spec in specs])
    client = Client(redis_url, queue=QUEUE)
    with serving(redis_url, tiny_llama):
        handles = client.submit_many(specs)
        results = [h.result(timeout=60) for h in handles]
    for handle, result, exp in zip(handles, results, expected, strict=True):
        check_stream(events_of(client.redis, handle.id), exp)
        assert result.status == "finished"
        for out, ref in zip(result.outputs, exp.outputs, strict=True):
            assert (out.text, out.token_ids) == (ref.text, ref.token_ids)
            if ref.logprobs is not None:
                assert len(out.logprobs) == len(ref.logprobs)
                for mine, theirs in zip(out.logprobs, ref.logprobs, strict=True):
                    assert mine == pytest.approx(theirs, abs=1e-4)
    assert client.stats()["pending"] == 0


def test_cancel_aborts_within_one_step(redis_url, tiny_llama) -> None:
    """A round trip each step (no stream interval), so each event is one step's and the events
    after the cancel count the steps after it; the cancel key alone, as producers before the
    notices set it (the held chunks and the notices: test_worker_stream_interval.py)."""
    client = Client(redis_url, queue=QUEUE)
    with serving(redis_url, tiny_llama, stream_interval_ms=0) as worker:
        job = client.submit("The queue", n=2, max_tokens=1500, ignore_eos=True, temperature=0,
                            stop=["<no stop string>"])  # holds text back: sent at the end
        wait_for(lambda: len(events_of(client.redis, job.id)) >= 6, what="first chunks")
        with client.redis.pipeline(transaction=True) as pipe:  # where the stream was then
            pipe.set(cancel_key(job.id), 1).xlen(results_key(job.id))
            mark = pipe.execute()[1]
        result = job.result(timeout=10)
        wait_for(lambda: not worker.driver.jobs, what="the worker to forget the job")
        assert worker.engine.block_manager.num_used_blocks == 0  # freed at once
    late = [e for e in events_of(client.redis, job.id)[mark:] if isinstance(e, Chunk)]
    for sample in (0, 1):  # the step under way when the cancel landed, and no more
        assert sum(1 for c in late if c.sample == sample and c.token_ids) <= 1
    assert [o.finish_reason for o in result.outputs] == ["abort", "abort"]
    assert result.status == "canceled" and job.status() == "canceled"
    assert all(0 < len(o.token_ids) < 1500 for o in result.outputs)
    for out in result.outputs:  # the text held back is sent, that of tokens not sent is not
        assert out.text == worker.engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_deadline_ends_the_job(redis_url, tiny_llama) -> None:
    client = Client(redis_url, queue=QUEUE)
    with serving(redis_url, tiny_llama):
        past = client.submit("late", n=3, deadline=time.time() - 1, max_tokens=50)
        soon = client.submit("soon", deadline=time.time() + 0.5, max_tokens=2000,
                             ignore_eos=True)
        done_past, done_soon = past.result(timeout=10), soon.result(timeout=10)
    assert [o.finish_reason for o in done_past.outputs] == ["deadline"] * 3
    assert done_soon.outputs[0].finish_reason == "deadline"
    assert 0 < len(done_soon.outputs[0].token_ids) < 2000


def test_publisher_fence_applies_a_resent_write_once(redis_url, monkeypatch) -> None:
    publisher = Publisher(connect(redis_url), QUEUE, 60, give_up=lambda: False)
    execute, lost = Publisher._execute, []

    def lose_first_reply(self: Publisher, sent: Any, resent: bool) -> list:
        reply = execute(self, sent, resent)
        if not lost:
            lost.append(reply)
            raise redis.ConnectionError("the reply was lost")
        return reply

    monkeypatch.setattr(Publisher, "_execute", lose_first_reply)
    batch = Batch()
    batch.mirror.started("j", "w1", fence=0)
    for seq in range(2):
        batch.event("j", seq, Chunk(sample=0, seq=seq, text="x", token_ids=[seq]))
    publisher.send(batch, [])
    assert not publisher.collect().superseded  # applied, then re-sent: a no-op
    assert lost and [e.seq for e in events_of(publisher.conn, "j")] == [0, 1]
    assert publisher.conn.hget(job_key("j"), "status") == "started"
    stale = Batch()  # a stalled worker that missed a peer's write
    stale.event("j", 1, Chunk(sample=0, seq=1, text="y", token_ids=[9]))
    stale.mirror.finished("j", {"outputs": []})  # fenced as its events: not applied either
    publisher.send(stale, [])
    assert publisher.collect().superseded == {"j"}
    assert [e.seq for e in events_of(publisher.conn, "j")] == [0, 1]
    assert publisher.conn.hget(job_key("j"), "status") == "started"
    assert publisher.conn.ttl(results_key("j")) > 0
    publisher.close()


def test_close_does_not_wait_for_a_redis_that_is_down(redis_server) -> None:
    """As when the loop raised: nothing tells the publisher to give up, yet close() returns."""
    publisher = Publisher(connect(redis_server.url), QUEUE, 60, give_up=lambda: False)
    redis_server.stop()
    batch = Batch()
    batch.event("j", 0, Chunk(sample=0, seq=0, text="x", token_ids=[1]))
    publisher.send(batch, [])
    start = time.monotonic()
    publisher.close()
    assert time.monotonic() - start < CLOSE_WAIT_S + 1


def test_flags_override_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("PAGEDQ_QUEUE", "from-env")
    monkeypatch.setenv("PAGEDQ_MAX_NUM_SEQS", "7")
    s = parse_args(["--queue", "from-flag", "--redis-url", "rediss://:secret@host:6380/1"])
    assert (s.queue, s.max_num_seqs, s.redis_url) == ("from-flag", 7,
                                                      "rediss://:secret@host:6380/1")
    assert s.engine_config().max_num_seqs == 7
    with pytest.raises(ValueError, match="redis_url"):
        parse_args(["--redis-url", "http://host"])
