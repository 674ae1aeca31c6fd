"""Soak: 20,000 one-token jobs through one worker with a 2 s result TTL. Once the TTLs pass,
the job stream is empty and Redis holds about what it held before: used memory within
``BOUND`` of the baseline (the RQ finished registry keeps the members of the jobs that ended
in the last TTL before the last transition; each transition drops the expired ones)."""

import time

import pytest
from test_worker import QUEUE, one_torch_thread, serving  # noqa: F401

from producer import Client
from producer.protocol import queue_key

pytest_plugins = ["redis_fixtures"]  # a real redis-server per test
JOBS, BATCH, TTL = 20_000, 500, 2
BOUND = 2 * 1024 * 1024  # bytes above the baseline


def used_memory(client: Client) -> int:
    for _ in client.redis.scan_iter(count=1000):  # a visit deletes a key whose TTL is past
        pass
    return client.redis.info("memory")["used_memory"]


@pytest.mark.slow
def test_tens_of_thousands_of_jobs_leave_redis_as_it_was(redis_url, tiny_llama) -> None:
    client = Client(redis_url, queue=QUEUE, max_queue_len=None)
    with serving(redis_url, tiny_llama, "soak", max_num_seqs=256, result_ttl=TTL,
                 failure_ttl=TTL):
        baseline, keys = used_memory(client), client.redis.dbsize()
        start, most = time.monotonic(), 0
        for i in range(0, JOBS, BATCH):
            client.submit_many([{"prompt": [5 + (i + j) % 400, 7, 9], "max_tokens": 1}
                                for j in range(BATCH)])
            most = max(most, client.redis.xlen(queue_key(QUEUE)))
        while (stats := client.stats())["lag"] or stats["pending"]:
            most = max(most, stats["length"])
            time.sleep(0.2)
        seconds = time.monotonic() - start
        peak = client.redis.info("memory")["used_memory"]
        assert client.redis.xlen(queue_key(QUEUE)) == 0
        time.sleep(TTL + 1)
        after = used_memory(client)
        print(f"\nsoak: {JOBS} jobs in {seconds:.1f} s ({JOBS / seconds:.0f} jobs/s); stream "
              f"length at most {most}, 0 at the end; used memory {baseline / 2**20:.2f} MiB "
              f"before, {peak / 2**20:.2f} at the end of the run, {after / 2**20:.2f} after "
              f"the TTL; keys {keys} before, {client.redis.dbsize()} after")
        assert after - baseline < BOUND
        assert client.redis.dbsize() <= keys + 4  # the finished registry, rq:queue, scripts
