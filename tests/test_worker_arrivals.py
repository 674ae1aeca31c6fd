"""A busy worker notices new jobs (worker/arrivals.py) and starts them in the step after the one
under way when they landed, where reading them only in its overlapped round trip starts them a
step later; a real redis-server and SmolLM2 (steps of ~30 ms on one thread)."""

import random
import threading
import time

import redis
from test_worker import QUEUE, one_torch_thread, settings, wait_for  # noqa: F401 (fixture)

from producer import Client
from producer.protocol import queue_key
from worker.arrivals import BLOCK_MS, Arrivals
from worker.service import Worker

pytest_plugins = ["redis_fixtures"]  # a real redis-server per test


def test_arrivals_notes_each_landing_once_taken(redis_url) -> None:
    conn = redis.Redis.from_url(redis_url, decode_responses=True)
    arrivals = Arrivals(conn, queue_key(QUEUE))
    try:
        time.sleep(0.2)  # the watcher is blocked at the stream's end
        assert not arrivals.take()
        conn.xadd(queue_key(QUEUE), {"job": "1"})
        wait_for(lambda: arrivals._noticed, timeout=5, what="the landing to be noticed")
        assert arrivals.take() and not arrivals.take()  # one note per landing, taken once
        time.sleep(0.2)  # the watcher waits from the stream's end again
        for i in range(5):  # a burst: one note
            conn.xadd(queue_key(QUEUE), {"job": str(i)})
        wait_for(lambda: arrivals._noticed, timeout=5, what="the burst to be noticed")
        assert arrivals.take()
        time.sleep(0.2)  # entries from before a take are no news after it
        assert not arrivals._noticed and not arrivals.take()
    finally:
        arrivals.close()
    arrivals._thread.join(BLOCK_MS / 1000 + 2)
    assert not arrivals._thread.is_alive()


def test_arrivals_notes_a_landing_between_two_reads(redis_url) -> None:
    """An entry that lands after a read timed out and before the next is sent is noticed: the
    watcher waits past the end's id, not past '$' (which lost it, once in CI). The test holds
    the watcher between two reads by holding the lock it takes before each."""
    conn = redis.Redis.from_url(redis_url, decode_responses=True)
    arrivals = Arrivals(conn, queue_key(QUEUE), block_ms=50)
    try:
        time.sleep(0.1)  # the watcher is blocked at the stream's end
        with arrivals._cond:
            time.sleep(0.2)  # its read times out; it waits for the lock to send the next
            conn.xadd(queue_key(QUEUE), {"job": "1"})
        wait_for(lambda: arrivals._noticed, timeout=2, what="the landing to be noticed")
    finally:
        arrivals.close()


def steps_to_start(redis_url: str, model, watch: bool) -> list[int]:
    """For 6 jobs landing at random moments while a long job runs: how many steps began after
    the landing before the one that ran the job (1: the next step). A landing counts only
    where the step count read before the submit equals the one read after: a step that began
    between them (the test thread waiting for the GIL, say) would blur which step it landed
    in. The reclaim window is a minute, so no claims refresh (every 5 s then, the first before
    the long job) falls among the landings: a refresh reads the round trip in flight before
    the step, as a notice does; at the tests' 1.5 s window (one every 375 ms) the two causes
    started 3 of 6 unnoticed jobs a step early on a CI machine whose steps took ~60 ms. Without
    them, 1 of 30 here (5 runs, Zen 4): a landing before Redis ran the trip sent before."""
    worker = Worker(settings(redis_url, model, "w1", watch_arrivals=watch,
                             reclaim_idle_ms=60_000))
    steps, started = [0], {}
    step = worker.driver.step

    def counted(batch):
        steps[0] += 1
        for job_id in worker.engine.requests:
            started.setdefault(job_id, steps[0])
        return step(batch)

    worker.driver.step = counted
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    client = Client(redis_url, queue=QUEUE)
    gaps, rng = [], random.Random(0)
    try:
        long = client.submit("Once upon a time", max_tokens=2000, ignore_eos=True)
        wait_for(lambda: long.id in started, what="the long job to start")
        for _ in range(30):
            time.sleep(rng.uniform(0.05, 0.1))
            before = steps[0]
            job = client.submit("Hello", max_tokens=1)
            landed = steps[0]  # the step under way (or just ended) when it landed
            wait_for(lambda j=job: j.id in started, what="the job to start")
            if landed == before:
                gaps.append(started[job.id] - landed)
            if len(gaps) == 6:
                break
        long.cancel()
    finally:
        worker.stop()
        thread.join(60)
    assert len(gaps) == 6, f"only {len(gaps)} of 30 landings fell inside one step"
    return gaps


def test_a_busy_worker_starts_a_new_job_in_the_next_step(redis_url, smollm2) -> None:
    noticed = steps_to_start(redis_url, smollm2, watch=True)
    unnoticed = steps_to_start(redis_url, smollm2, watch=False)
    # the next step, but for a landing too close to the round trip's send to be noticed first
    assert sorted(noticed)[3] == 1, noticed
    assert sorted(unnoticed)[2] == 2, unnoticed  # the same: a trip sent late reads it early


def test_no_early_read_behind_a_backlog(redis_url, tiny_llama) -> None:
    """A job noticed while the engine has requests waiting to start is read as before (its
    reply after the next step): read early it would only lengthen the step that ends their
    prefill. The note is kept for the first send without a backlog. Ticks driven by hand: a
    step takes 64 tokens, each job's prompt is 20 distinct ones."""
    worker = Worker(settings(redis_url, tiny_llama, "w1", max_num_batched_tokens=64))
    worker.consumer.ensure_group()
    client = Client(redis_url, queue=QUEUE)

    def job(i: int) -> dict:
        return {"prompt": list(range(100 + 20 * i, 120 + 20 * i)), "max_tokens": 30}

    try:
        time.sleep(0.2)  # the watcher waits at the stream's end
        client.submit_many([job(i) for i in range(8)])
        wait_for(lambda: worker.arrivals._noticed, timeout=5, what="the burst to be noticed")
        worker._tick()  # an empty engine reads one job; the round trip then reads six more
        assert worker._news_in_flight  # noticed, no backlog: read before the next step
        time.sleep(0.5)  # the watcher waits at the stream's end again
        client.submit(**job(8))
        wait_for(lambda: worker.arrivals._noticed, timeout=5, what="the job to be noticed")
        worker._tick()  # the six join; the step's 64 tokens start four of them
        assert worker.engine.has_waiting() and worker.intake.count(len(worker._arrived)) > 0
        assert not worker._news_in_flight and worker.arrivals._noticed  # kept for later
        worker._tick()  # the two waiting start
        assert not worker.engine.has_waiting()
        assert worker._news_in_flight and not worker.arrivals._noticed
    finally:
        worker.stop()
        worker.stop()
        worker.run()  # stops at once: leaves the jobs pending, closes the watcher
