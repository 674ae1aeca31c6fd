"""The stream interval (``stream_interval_ms``, worker/service.py ``_due``): a running job's
later chunks wait for the interval, its first chunk and its end go at once, and a cancel is
learnt from its notice on ``pagedq:cancels``, within a step, without a round trip each step;
unset, it holds chunks only where the engine's threads take every core (``stream_interval_s``)."""

import os
import time

import torch
from test_worker import (  # noqa: F401 (fixture)
    QUEUE,
    events_of,
    one_torch_thread,
    reference,
    serving,
    settings,
    wait_for,
)

from producer import Client
from producer.core import new_job
from producer.protocol import Chunk, results_key
from worker.service import stream_interval_s

pytest_plugins = ["redis_fixtures"]  # a real redis-server per test
HOLD_MS = 60_000.0  # longer than any test: nothing but urgent events and notices send


def landings(conn, job_id: str) -> list[int]:
    """The millisecond of each event's landing, from its stream entry id."""
    return [int(entry_id.split("-")[0]) for entry_id, _ in conn.xrange(results_key(job_id))]


def test_the_default_holds_chunks_where_the_step_takes_every_core(redis_url, tiny_llama) -> None:
    """Unset: 50 ms with a torch thread on every core the worker may use, else 0 (a spare core
    runs the round trip without slowing the step); set, as set. The worker's own engine."""
    cores = len(os.sched_getaffinity(0))
    with serving(redis_url, tiny_llama) as worker:
        assert worker.stream_interval_s == (0.05 if cores == 1 else 0.0)  # one torch thread
        torch.set_num_threads(cores)  # restored by one_torch_thread
        assert stream_interval_s(worker.settings, worker.engine) == 0.05
        for ms in (0.0, 20.0):
            chosen = settings(redis_url, tiny_llama, "w", stream_interval_ms=ms)
            assert stream_interval_s(chosen, worker.engine) == ms / 1000


def test_later_chunks_wait_for_the_interval(redis_url, tiny_llama) -> None:
    client = Client(redis_url, queue=QUEUE)
    job = new_job(QUEUE, "A held stream", n=2, max_tokens=120, ignore_eos=True, temperature=0)
    exp = reference(tiny_llama, [job])[0]
    with serving(redis_url, tiny_llama, stream_interval_ms=HOLD_MS):
        handle = client.submit(job.prompt, job_id=job.id, **job.sampling.model_dump())
        result = handle.result(timeout=60)
    for out, ref in zip(result.outputs, exp.outputs, strict=True):
        assert (out.text, out.token_ids) == (ref.text, ref.token_ids)
    events = events_of(client.redis, job.id)
    chunks = [e for e in events if isinstance(e, Chunk)]
    assert len(chunks) > 100  # a chunk per step and sample, as without the interval...
    at = landings(client.redis, job.id)
    # ...but written with the end (one script, which may cross a millisecond), not step by
    # step: the first chunks go at once, and a round trip due for another reason (a notice
    # read) takes the chunks made since (a slow VM of an AMD EPYC Zen 3 landed one step's two
    # later chunks 3 ms after the first chunks, the rest with the end: session 68)
    later = [t for e, t in zip(events, at, strict=True) if isinstance(e, Chunk) and e.seq > 0]
    early = [t for t in later if at[-1] - t > 5]
    assert len(set(at)) <= 4 and len(early) <= 2 * 2, sorted(set(at))


def test_every_step_without_the_interval(redis_url, tiny_llama) -> None:
    """The control: with ``stream_interval_ms=0`` the same job's chunks land step by step."""
    client = Client(redis_url, queue=QUEUE)
    with serving(redis_url, tiny_llama, stream_interval_ms=0):
        handle = client.submit("A held stream", n=2, max_tokens=120, ignore_eos=True,
                               temperature=0)
        handle.result(timeout=60)
    assert len(set(landings(client.redis, handle.id))) > 10


def test_a_cancel_notice_stops_the_job_within_a_step(redis_url, smollm2) -> None:
    """No round trip is due for a minute: only the notice can stop the job. Tokens made after
    the cancel: the step under way when it landed, or one more when the notice reached the
    watcher as that step ended. SmolLM2 (~30 ms steps on one thread), not the tiny model: the
    notice takes a wake-up or two on busy cores, milliseconds at worst, and the tiny model's
    sub-millisecond steps ran 8-25 past a cancel in 6 of 60 runs (RESULTS, session 60)."""
    client = Client(redis_url, queue=QUEUE)
    with serving(redis_url, smollm2, stream_interval_ms=HOLD_MS) as worker:
        job = client.submit("The queue", n=2, max_tokens=1500, ignore_eos=True, temperature=0,
                            stop=["<no stop string>"])  # holds text back: sent at the end
        wait_for(lambda: events_of(client.redis, job.id), what="the first chunks")
        state = worker.driver.jobs[job.id]
        wait_for(lambda: min(map(len, state.token_ids)) >= 20, what="tokens")
        made = [len(ids) for ids in state.token_ids]  # the tokens emitted when it lands
        started = time.monotonic()
        job.cancel()
        result = job.result(timeout=10)
        assert time.monotonic() - started < 5  # not the interval's minute
        wait_for(lambda: not worker.driver.jobs, what="the worker to forget the job")
        assert worker.engine.block_manager.num_used_blocks == 0  # freed at once
    for out, before in zip(result.outputs, made, strict=True):
        assert before <= len(out.token_ids) <= before + 2
        assert out.finish_reason == "abort"
        assert out.text == worker.engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert result.status == "canceled" and job.status() == "canceled"
