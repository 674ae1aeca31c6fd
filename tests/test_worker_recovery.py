"""Workers that share a queue, die, stop or lose Redis: every job still ends once, and each
reader sees every token exactly once (results equal LLM.generate)."""

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import redis
from test_worker import (
    QUEUE,
    check_stream,
    events_of,
    mixed_specs,
    one_torch_thread,  # noqa: F401
    reference,
    serving,
    wait_for,
)

from producer import Client
from producer.core import new_job
from producer.protocol import GROUP, JOB_FIELD, Chunk, End, dead_key, queue_key
from producer.rq_mirror import WORKERS

pytest_plugins = ["redis_fixtures"]  # a real redis-server per test
ROOT = Path(__file__).resolve().parent.parent


def long_specs(count: int, max_tokens: int) -> list[dict[str, Any]]:
    """Jobs that run for a while: greedy and seeded, some with two samples."""
    return [spec | {"max_tokens": max_tokens, "ignore_eos": True, "stop": []}
            for spec in mixed_specs(count)]


def spawn(url: str, model: Path, name: str, *flags: str) -> subprocess.Popen:
    """``python -m worker`` in a process of its own, ready (registered) on return."""
    cmd = [sys.executable, "-m", "worker", "--redis-url", url, "--queue", QUEUE, "--model",
           str(model), "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "256",
           "--threads", "1", "--consumer", name, "--reclaim-idle-ms", "1500", *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=os.environ | {"HF_HUB_OFFLINE": "1"})
    conn = redis.Redis.from_url(url, decode_responses=True)
    wait_for(lambda: proc.poll() is not None or conn.sismember(WORKERS, f"rq:worker:{name}"),
             timeout=60, what=f"worker {name} to start")
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    return proc


def chunks_in(conn: redis.Redis, job_id: str) -> int:
    return sum(isinstance(e, Chunk) for e in events_of(conn, job_id))


def test_two_workers_share_the_load(redis_url, tiny_llama) -> None:
    specs = mixed_specs(24)
    expected = reference(tiny_llama, [new_job(QUEUE, **spec) for spec in specs])
    client = Client(redis_url, queue=QUEUE)
    with serving(redis_url, tiny_llama, "w1", max_num_seqs=4) as w1, \
            serving(redis_url, tiny_llama, "w2", max_num_seqs=4) as w2:
        handles = client.submit_many(specs)
        results = [h.result(timeout=60) for h in handles]
    made = [w.engine.stats()["tokens_generated"] for w in (w1, w2)]
    assert all(made), f"one worker did all the work: {made}"
    # Every token was made once: no job ran twice, not even in part.
    assert sum(made) == sum(r.usage.completion_tokens for r in results)
    for handle, exp in zip(handles, expected, strict=True):
        check_stream(events_of(client.redis, handle.id), exp)


def test_kill_9_mid_generation_a_peer_finishes_every_job(redis_url, tiny_llama) -> None:
    specs = long_specs(6, max_tokens=500)
    expected = reference(tiny_llama, [new_job(QUEUE, **spec) for spec in specs])
    client = Client(redis_url, queue=QUEUE)
    doomed = spawn(redis_url, tiny_llama, "doomed")
    handles = client.submit_many(specs)
    streamed: dict[str, list] = {}
    readers = [threading.Thread(target=lambda h=h: streamed.setdefault(h.id, list(
        h.stream(timeout=60)))) for h in handles[:3]]
    for reader in readers:
        reader.start()
    wait_for(lambda: all(chunks_in(client.redis, h.id) >= 5 for h in handles),
             what="every job under way")
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(10)
    unfinished = [h for h in handles if not any(isinstance(e, End)
                                                for e in events_of(client.redis, h.id))]
    assert unfinished, "the worker finished before it was killed"
    with serving(redis_url, tiny_llama, "heir"):
        results = [h.result(timeout=90) for h in handles]
        for reader in readers:
            reader.join(60)
    for handle, result, exp in zip(handles, results, expected, strict=True):
        check_stream(events_of(client.redis, handle.id), exp)
        assert [o.token_ids for o in result.outputs] == [o.token_ids for o in exp.outputs]
    for handle, exp in zip(handles[:3], expected[:3], strict=True):  # live readers, across the kill
        check_stream(streamed[handle.id], exp)
    assert client.stats()["pending"] == 0


def test_stop_finishes_in_flight_jobs_within_the_grace_period(redis_url, tiny_llama) -> None:
    client = Client(redis_url, queue=QUEUE)
    worker = spawn(redis_url, tiny_llama, "polite", "--grace-period", "30")
    handles = client.submit_many(long_specs(4, max_tokens=200))
    wait_for(lambda: all(chunks_in(client.redis, h.id) for h in handles), what="jobs running")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(60) == 0
    assert all(h.status() == "finished" for h in handles)
    stats = client.stats()
    assert stats["pending"] == 0 and not stats["consumers"]  # it left the group
    assert not client.redis.smembers(WORKERS)  # unregistered


def test_past_the_grace_period_jobs_stay_pending_for_a_peer(redis_url, tiny_llama) -> None:
    """Stopped with no grace, a worker leaves its jobs unacknowledged; a peer reclaims them
    and continues each stream where it stopped."""
    specs = long_specs(5, max_tokens=400)
    expected = reference(tiny_llama, [new_job(QUEUE, **spec) for spec in specs])
    client = Client(redis_url, queue=QUEUE)
    with serving(redis_url, tiny_llama, "quitter", grace_period=0) as quitter:
        handles = client.submit_many(specs)
        wait_for(lambda: all(chunks_in(client.redis, h.id) >= 3 for h in handles),
                 what="jobs under way")
        quitter.stop()
    stats = client.stats()
    assert stats["pending"] == len(handles) and stats["consumers"][0]["name"] == "quitter"
    assert all(h.status() == "started" for h in handles)
    with serving(redis_url, tiny_llama, "heir"):
        for handle, exp in zip(handles, expected, strict=True):
            handle.result(timeout=60)
            check_stream(events_of(client.redis, handle.id), exp)


def test_redis_restart_loses_no_job(redis_server_factory, tiny_llama) -> None:
    server = redis_server_factory(aof=True)
    specs = long_specs(8, max_tokens=250)
    expected = reference(tiny_llama, [new_job(QUEUE, **spec) for spec in specs])
    client = Client(server.url, queue=QUEUE)
    with serving(server.url, tiny_llama):
        handles = client.submit_many(specs)
        wait_for(lambda: sum(chunks_in(client.redis, h.id) for h in handles) >= 40,
                 what="jobs under way")
        server.restart()
        late = client.submit_many(mixed_specs(3))  # submitted after the restart
        results = [h.result(timeout=90) for h in handles + late]
    assert all(r.status == "finished" for r in results)
    for handle, exp in zip(handles, expected, strict=True):
        check_stream(events_of(client.redis, handle.id), exp)


def test_too_many_deliveries_go_to_the_dead_letter_stream(redis_url, tiny_llama) -> None:
    client = Client(redis_url, queue=QUEUE)
    conn = client.redis
    poison = new_job(QUEUE, "poison", job_id="poison")
    conn.xgroup_create(queue_key(QUEUE), GROUP, id="0", mkstream=True)
    entry = conn.xadd(queue_key(QUEUE), {JOB_FIELD: poison.model_dump_json()})
    conn.xreadgroup(GROUP, "crashed", {queue_key(QUEUE): ">"})
    # As if it had crashed three workers already: the next reclaim is its fourth delivery.
    conn.xclaim(queue_key(QUEUE), GROUP, "crashed", 0, [entry], idle=10_000, retrycount=3)
    with serving(redis_url, tiny_llama, max_deliveries=3):
        wait_for(lambda: events_of(conn, "poison"), what="the dead letter")
    (error,) = events_of(conn, "poison")
    assert error.type == "error" and error.code == "dead_letter"
    ((_, letter),) = conn.xrange(dead_key(QUEUE))
    assert letter[JOB_FIELD] == poison.model_dump_json() and letter["deliveries"] == "4"
    assert client.stats()["pending"] == 0
