"""One client reader for many streams: an AsyncClient holds 10,000 concurrent result streams
(tasks), a Client 1,000 (threads: 10,000 threads would measure the machine's scheduler on two
shared cores, not the client), on a few connections; every handle gets exactly its events.
Prints the client's CPU time per event delivered."""

import asyncio
import resource
import threading
import time

import redis

from producer import AsyncClient, Client
from producer.protocol import EVENT_FIELD, Chunk, Done, End, Usage, results_key

pytest_plugins = ["redis_fixtures"]  # a real redis-server per test
STREAMS = 10_000
THREADS = 1_000
MAX_CONNECTIONS = 8
# Writes, server side, chunk / done / end (ARGV 2..) to each result stream named in KEYS; the
# chunk's text names the stream's number (its place in KEYS plus ARGV[1]).
_PUBLISH = f"""
for i, key in ipairs(KEYS) do
  for e = 2, #ARGV do
    local event = string.gsub(ARGV[e], '@', tostring(i + tonumber(ARGV[1])))
    redis.call('XADD', key, '*', '{EVENT_FIELD}', event)
  end
end
"""
EVENTS = [Chunk(sample=0, seq=0, text="t@", token_ids=[1]).model_dump_json(),
          Done(sample=0, finish_reason="length", usage=Usage()).model_dump_json(),
          End(usage=Usage(completion_tokens=1)).model_dump_json()]


def publish(url: str, job_ids: list[str]) -> None:
    conn = redis.Redis.from_url(url)
    for i in range(0, len(job_ids), 1000):  # a few scripts, not one long one
        keys = [results_key(j) for j in job_ids[i:i + 1000]]
        conn.eval(_PUBLISH, len(keys), *keys, i, *EVENTS)
    conn.close()


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def connections(url: str) -> int:
    """Client connections to the server, this test's own admin connection excluded."""
    return len(redis.Redis.from_url(url).client_list()) - 1


def report(what: str, seconds: float, events: int) -> None:
    print(f"\n{what}: {events // 3} streams, {events} events, client CPU {seconds:.2f} s, "
          f"{seconds / events * 1e6:.1f} us/event")


def test_a_client_holds_1000_threads_streams_on_few_connections(redis_url) -> None:
    job_ids = [f"job{i}" for i in range(THREADS)]
    texts: dict[str, str] = {}
    client = Client(redis_url, max_connections=MAX_CONNECTIONS)
    threading.stack_size(256 * 1024)
    try:
        def wait(job_id: str) -> None:
            texts[job_id] = client.job(job_id).result(timeout=120).outputs[0].text

        threads = [threading.Thread(target=wait, args=(j,), daemon=True) for j in job_ids]
        for t in threads:
            t.start()
        while len(client.mux.streams.subs) < THREADS:
            assert all(t.is_alive() for t in threads), "a waiter died before it subscribed"
            time.sleep(0.05)
        assert connections(redis_url) <= MAX_CONNECTIONS
        start = cpu()
        publish(redis_url, job_ids)
        for t in threads:
            t.join(120)
        report("Client (threads)", cpu() - start, 3 * THREADS)
    finally:
        threading.stack_size(0)
        client.close()
    assert texts == {j: f"t{i + 1}" for i, j in enumerate(job_ids)}


def test_an_async_client_holds_10000_streams(redis_url) -> None:
    job_ids = [f"job{i}" for i in range(STREAMS)]

    async def scenario() -> list[str]:
        async with AsyncClient(redis_url, max_connections=MAX_CONNECTIONS) as client:
            async def wait(job_id: str) -> str:
                return (await client.job(job_id).result(timeout=120)).outputs[0].text

            tasks = [asyncio.create_task(wait(j)) for j in job_ids]
            while len(client.mux.streams.subs) < STREAMS:
                failed = [t for t in tasks if t.done()]  # a waiter that died never subscribes
                assert not failed, failed[0].exception()
                await asyncio.sleep(0.05)
            assert connections(redis_url) <= MAX_CONNECTIONS
            start = cpu()
            await asyncio.to_thread(publish, redis_url, job_ids)
            texts = await asyncio.gather(*tasks)
            report("AsyncClient (tasks)", cpu() - start, 3 * STREAMS)
            return texts

    assert asyncio.run(scenario()) == [f"t{i + 1}" for i in range(STREAMS)]


def test_a_reader_joining_mid_read_gets_every_entry_in_order() -> None:
    """A second reader of a job subscribes while a read is in flight that starts past its
    cursor (the first reader's): it must not take that reply's later entries as its first ones
    (seen as a result() holding only the last tokens while a stream() of the same job ran)."""
    import queue as stdlib_queue

    from producer.mux import Streams, Subscription

    streams, key = Streams(), results_key("j")
    first = Subscription("j", stdlib_queue.SimpleQueue())
    streams.add(first)
    first.cursor = streams.cursors[key] = "5-0"  # it has read entries 1..5
    assert streams.request()["streams"][key] == "5-0"
    late = Subscription("j", stdlib_queue.SimpleQueue())
    streams.add(late)
    got = streams.dispatch([[key, [("6-0", {}), ("7-0", {})]]])
    assert [(sub is first, [e[0] for e in entries]) for sub, entries in got] == [
        (True, ["6-0", "7-0"])]
    assert streams.request()["streams"][key] == "0-0"  # the next read serves the late one
    got = streams.dispatch([[key, [(f"{i}-0", {}) for i in range(1, 8)]]])
    assert [(sub is late, len(entries)) for sub, entries in got] == [(True, 7)]


def test_result_of_an_ended_job_reads_its_backlog_without_the_reader(redis_url) -> None:
    """``result()`` first reads what the stream holds (one XRANGE): a job that has ended never
    starts the reader; one still running gets the rest from the reader, past the backlog, each
    event once."""
    conn = redis.Redis.from_url(redis_url)
    publish(redis_url, ["ended"])
    with Client(redis_url) as client:
        assert client.job("ended").result(timeout=5).outputs[0].text == "t1"
        assert client.mux.thread is None
        conn.xadd(results_key("running"), {EVENT_FIELD: EVENTS[0].replace("@", "a")})
        later = threading.Timer(0.3, lambda: [conn.xadd(results_key("running"), {
            EVENT_FIELD: e.replace("@", "b")}) for e in EVENTS])
        later.start()
        result = client.job("running").result(timeout=5)
        later.join()
        assert result.outputs[0].text == "tatb"  # backlog "ta", then the reader's "tb", once
        assert result.usage.completion_tokens == 1

    async def both() -> None:
        async with AsyncClient(redis_url) as aclient:
            assert (await aclient.job("ended").result(timeout=5)).outputs[0].text == "t1"
            assert aclient.mux.task is None
            assert (await aclient.job("running").result(timeout=5)).outputs[0].text == "tatb"

    asyncio.run(both())
