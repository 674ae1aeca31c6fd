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


def steps_to_start(redis_url: str, model, watch: bool) -> list[int]:
    """For 6 jobs landing at random moments while a long job runs: how many steps began after
    the landing before the one that ran the job (1: the next step)."""
    worker = Worker(settings(redis_url, model, "w1", watch_arrivals=watch))
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
        for _ in range(6):
            time.sleep(rng.uniform(0.05, 0.1))
            job = client.submit("Hello", max_tokens=1)
            landed = steps[0]  # the step under way (or just ended) when it landed
            wait_for(lambda j=job: j.id in started, what="the job to start")
            gaps.append(started[job.id] - landed)
        long.cancel()
    finally:
        worker.stop()
        thread.join(60)
    return gaps


def test_a_busy_worker_starts_a_new_job_in_the_next_step(redis_url, smollm2) -> None:
    noticed = steps_to_start(redis_url, smollm2, watch=True)
    unnoticed = steps_to_start(redis_url, smollm2, watch=False)
    # the next step, but for a landing too close to the round trip's send to be noticed first
    assert sorted(noticed)[3] == 1, noticed
    assert sorted(unnoticed)[2] == 2, unnoticed  # a claims refresh can collect early
