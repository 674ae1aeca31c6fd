"""A worker takes only the jobs its engine could start soon, counted in sequences (each sample
of a job counts): the rest stay in the stream, and a second worker takes them within its
first read. Retention: every acknowledged job leaves the stream."""

import threading
import time

from test_worker import QUEUE, events_of, one_torch_thread, serving, wait_for  # noqa: F401

from producer import Client
from producer.protocol import GROUP, End, queue_key
from producer.rq_mirror import job_key

pytest_plugins = ["redis_fixtures"]  # a real redis-server per test
MAX_NUM_SEQS = 8
N = 4  # samples per job: two jobs fill a worker


def burst(count: int) -> list[dict]:
    return [{"prompt": f"job {i} of the burst", "n": N, "max_tokens": 24, "ignore_eos": True,
             "temperature": 0.8, "seed": i} for i in range(count)]


class PendingWatch:
    """Samples, every 10 ms, how many entries each consumer holds pending and how many are
    waiting in the stream."""

    def __init__(self, client: Client) -> None:
        self.client, self.most, self.lag_seen = client, {}, 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        r = self.client.redis
        while not self.stopped.is_set():
            if r.exists(queue_key(QUEUE)):
                for c in r.xinfo_consumers(queue_key(QUEUE), GROUP):
                    self.most[c["name"]] = max(self.most.get(c["name"], 0), c["pending"])
                self.lag_seen = max(self.lag_seen, self.client.stats()["lag"])
            time.sleep(0.01)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(5)


def test_a_worker_holds_only_what_it_can_start_and_a_peer_takes_the_rest(
        redis_url, tiny_llama) -> None:
    client = Client(redis_url, queue=QUEUE)
    watch = PendingWatch(client)
    with serving(redis_url, tiny_llama, "w1", max_num_seqs=MAX_NUM_SEQS):
        handles = client.submit_many(burst(16))
        wait_for(lambda: any(events_of(client.redis, h.id) for h in handles), what="a start")
        with serving(redis_url, tiny_llama, "w2", max_num_seqs=MAX_NUM_SEQS):
            results = [h.result(timeout=120) for h in handles]
    watch.stop()
    split = {name: sum(client.redis.hget(job_key(h.id), "worker_name") == name
                       for h in handles) for name in ("w1", "w2")}
    print(f"\nburst of 16 jobs (n={N}, max_num_seqs={MAX_NUM_SEQS}): split {split}, most "
          f"pending per worker {watch.most}, most waiting in the stream {watch.lag_seen}")
    assert all(r.status == "finished" for r in results)
    assert max(watch.most.values()) <= MAX_NUM_SEQS // N  # never more than it could start
    assert watch.lag_seen >= 16 - 2 * MAX_NUM_SEQS // N  # the rest waited in the stream
    assert split["w2"] >= 4, f"the peer took too little: {split}"
    assert client.redis.xlen(queue_key(QUEUE)) == 0  # every acknowledged entry was deleted
    assert all(isinstance(events_of(client.redis, h.id)[-1], End) for h in handles)


def test_a_busy_read_takes_only_its_share_of_the_jobs(redis_url) -> None:
    """Two live consumers holding nothing and 10 waiting jobs: a busy worker's read takes 5,
    however many it has room for, then none while it holds its share; once its peer is silent
    past the live time, the rest, up to its room."""
    import redis

    from producer.core import new_job
    from worker.consumer import Consumer

    conn = redis.Redis.from_url(redis_url, decode_responses=True)
    mine, peer = (Consumer(conn, QUEUE, name, lambda: False) for name in ("mine", "peer"))
    mine.ensure_group()
    peer.ensure_group()  # the peer joins the group, before it has read anything
    for i in range(10):
        conn.xadd(queue_key(QUEUE), {"job": new_job(QUEUE, prompt=f"job {i}").model_dump_json()})

    def read(count: int, live_ms: int) -> list:
        with conn.pipeline(transaction=True) as pipe:
            mine.read_in(pipe, count, live_ms)
            return mine.arrived(pipe.execute(raise_on_error=False)[0])

    first = read(100, live_ms=60_000)
    assert len(first) == 5 and all(d.job is not None for d in first)
    assert read(100, live_ms=60_000) == []  # it holds 5 of 10: its share
    time.sleep(0.05)
    assert len(read(2, live_ms=20)) == 2  # the peer is silent past 20 ms: its room caps it
    assert len(read(100, live_ms=20)) == 3
    assert read(100, live_ms=20) == []
