"""Chaos: 120 jobs (greedy and seeded, n = 1..3) streamed live by 120 threads on one Client,
while workers are killed (-9) and replaced, one is SIGSTOPped past the reclaim time and
resumed, every client connection is cut (CLIENT KILL) and Redis restarts from its AOF. Every
stream, as its reader saw it live and as Redis holds it, equals LLM.generate: 0 lost,
0 repeated, 0 wrong tokens. Prints the figures."""

import signal
import threading
import time

import pytest
from test_worker import QUEUE, check_stream, events_of, reference, wait_for
from test_worker_recovery import chunks_in, long_specs, spawn

from producer import Client
from producer.core import new_job
from producer.protocol import Chunk, End

pytest_plugins = ["redis_fixtures"]  # a real redis-server per test
JOBS = 120
FLAGS = ("--max-deliveries", "20", "--max-num-seqs", "128")


@pytest.mark.slow
def test_chaos_loses_repeats_and_corrupts_nothing(redis_server_factory, tiny_llama) -> None:
    server = redis_server_factory(aof=True)
    specs = long_specs(JOBS, max_tokens=120)
    expected = reference(tiny_llama, [new_job(QUEUE, **spec) for spec in specs])
    client = Client(server.url, queue=QUEUE)
    workers = {name: spawn(server.url, tiny_llama, name, *FLAGS) for name in ("w1", "w2")}
    handles = client.submit_many(specs)
    streamed: dict[str, list] = {}
    failures: list[BaseException] = []

    def read(handle) -> None:
        try:
            streamed[handle.id] = list(handle.stream(timeout=180))
        except BaseException as exc:  # reported below, with the job
            failures.append(exc)

    readers = [threading.Thread(target=read, args=(h,), daemon=True) for h in handles]
    for reader in readers:
        reader.start()
    start, chaos = time.monotonic(), []

    def progress(tokens: int) -> None:
        wait_for(lambda: sum(chunks_in(client.redis, h.id) for h in handles[:20]) >= tokens,
                 timeout=120, what=f"{tokens} chunks")

    progress(100)
    workers["w1"].send_signal(signal.SIGKILL)
    workers["w1"].wait(10)
    workers["w3"] = spawn(server.url, tiny_llama, "w3", *FLAGS)
    chaos.append("kill -9 w1, start w3")
    progress(300)
    killed = client.redis.client_kill_filter(_type="normal", skipme=True)
    chaos.append(f"CLIENT KILL: {killed} connections")
    workers["w2"].send_signal(signal.SIGSTOP)
    time.sleep(3.5)  # past --reclaim-idle-ms 1500 and a claim refresh: w3 takes its jobs over
    workers["w2"].send_signal(signal.SIGCONT)
    chaos.append("SIGSTOP w2 for 3.5 s")
    progress(600)
    server.restart()
    chaos.append("redis restart (AOF)")
    progress(900)
    workers["w3"].send_signal(signal.SIGKILL)
    workers["w3"].wait(10)
    workers["w4"] = spawn(server.url, tiny_llama, "w4", *FLAGS)
    chaos.append("kill -9 w3, start w4")
    for reader in readers:
        reader.join(180)
    seconds = time.monotonic() - start
    try:
        assert not failures, failures[:3]
        tokens = 0
        for handle, exp in zip(handles, expected, strict=True):
            check_stream(streamed[handle.id], exp)  # live, across every fault
            stored = events_of(client.redis, handle.id)
            check_stream(stored, exp)
            tokens += sum(len(e.token_ids) for e in stored if isinstance(e, Chunk))
        assert all(isinstance(streamed[h.id][-1], End) for h in handles)
        assert client.stats()["pending"] == 0
    finally:
        for proc in workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
    print(f"\nchaos: {JOBS} streams on one Client, {tokens} tokens in {seconds:.0f} s through "
          f"{'; '.join(chaos)}: 0 lost, 0 repeated, 0 wrong against LLM.generate")
