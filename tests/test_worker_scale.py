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
