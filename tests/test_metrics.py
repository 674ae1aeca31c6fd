"""The worker's /metrics, /healthz and /readyz over real HTTP against a real redis-server: job
counts by outcome, the engine's figures equal ``engine.stats()``, latency histograms count what
ran, queue depth and pending follow the stream, and two workers in one process keep apart."""

import time
import urllib.error
import urllib.request

import prometheus_client
import redis
from prometheus_client.parser import text_string_to_metric_families
from test_worker import QUEUE, events_of, one_torch_thread, serving, wait_for  # noqa: F401

from producer import Client
from producer.protocol import GROUP, End, queue_key
from worker.healthcheck import main as healthcheck
from worker.metrics import ENGINE_METRICS, Metrics
from worker.redis_server import RedisServer, free_port

pytest_plugins = ["redis_fixtures"]  # a real redis-server per test
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(port: int) -> Samples:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    status, text = get(port, "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def engine_figures(samples: Samples) -> dict[str, float]:
    """The engine's stats() keys, as /metrics shows them."""
    suffix = {"gauge": "", "counter": "_total"}
    return {key: value(samples, name + suffix[kind])
            for key, (name, kind, _) in ENGINE_METRICS.items()}


def completion_tokens(conn: redis.Redis, job_id: str) -> int:
    [end] = [e for e in events_of(conn, job_id) if isinstance(e, End)]
    return end.usage.completion_tokens


def test_two_workers_report_their_own_figures(redis_url, tiny_llama) -> None:
    client = Client(redis_url, queue=QUEUE)
    ports = [free_port(), free_port()]
    with serving(redis_url, tiny_llama, "w1", metrics_port=ports[0]) as w1, \
            serving(redis_url, tiny_llama, "w2", metrics_port=ports[1]) as w2:
        assert [get(p, "/healthz")[0] for p in ports] == [200, 200]
        assert [get(p, "/readyz") for p in ports] == [(200, "ok\n")] * 2
        prompt = list(range(5, 5 + 40))  # 2 full blocks: the repeats hit the prefix cache
        handles = []
        for i in range(8):  # one after the other: a worker's first job fills its cache
            handles.append(client.submit(prompt, max_tokens=6 + i, ignore_eos=True))
            handles[-1].result(timeout=60)
        tokens = sum(completion_tokens(client.redis, h.id) for h in handles)
        workers = {p: w for p, w in zip(ports, (w1, w2), strict=True)}
        wait_for(lambda: _settled(workers), what="the engine snapshots")
        finished = []
        for port, worker in workers.items():
            samples = scrape(port)
            stats = worker.engine.stats()
            assert engine_figures(samples) == {k: stats[k] for k in ENGINE_METRICS}
            assert stats["kv_blocks_total"] == 256 and stats["kv_blocks_used"] == 0
            finished.append(value(samples, "pagedq_jobs_total", outcome="finished"))
            jobs = int(finished[-1])
            # every job got its first token once, then one more token per step
            assert value(samples, "pagedq_time_to_first_token_seconds_count") == jobs
            assert value(samples, "pagedq_inter_token_latency_seconds_count") == \
                stats["tokens_generated"] - jobs
            assert value(samples, "pagedq_queue_depth", queue=QUEUE) == 0
            assert value(samples, "pagedq_redis_up") == 1
        assert sum(finished) == len(handles)
        assert sum(w.engine.stats()["tokens_generated"] for w in workers.values()) == tokens
        assert sum(w.engine.stats()["prefix_cache_hits"] for w in workers.values()) >= 32 * 6
    assert not [f.name for f in prometheus_client.REGISTRY.collect()
                if f.name.startswith("pagedq")]  # never the process-wide registry


def _settled(workers: dict) -> bool:
    """The snapshot is taken at most every second: equal once the idle loops took one."""
    return all(engine_figures(scrape(p)) == {k: w.engine.stats()[k] for k in ENGINE_METRICS}
               for p, w in workers.items())


def test_outcomes_are_counted(redis_url, tiny_llama) -> None:
    client = Client(redis_url, queue=QUEUE)
    dead = client.submit("delivered to a worker that died")
    client.redis.xreadgroup(GROUP, "crashed", {queue_key(QUEUE): ">"})  # never acknowledged
    port = free_port()
    with serving(redis_url, tiny_llama, metrics_port=port, max_deliveries=1):
        ok = client.submit("fine", max_tokens=3)
        failed = [client.submit([99_999]), client.submit("x", max_tokens=5000)]
        canceled = client.submit("cancel me", max_tokens=2000, ignore_eos=True)
        wait_for(lambda: events_of(client.redis, canceled.id), what="the long job to start")
        canceled.cancel()
        for handle in (ok, canceled, dead, *failed):
            wait_for(lambda h=handle: h.status() in ("finished", "failed", "canceled"),
                     what=f"{handle.id} to end")
        samples = scrape(port)
    assert {o: value(samples, "pagedq_jobs_total", outcome=o)
            for o in ("finished", "failed", "canceled", "dead_letter")} == \
        {"finished": 1, "failed": 2, "canceled": 1, "dead_letter": 1}
    assert value(samples, "pagedq_dead_letters", queue=QUEUE) == 1
    assert value(samples, "pagedq_time_to_first_token_seconds_count") == 2  # ok and canceled


def test_queue_figures_and_probes(redis_server_factory, monkeypatch) -> None:
    server: RedisServer = redis_server_factory()
    client = Client(server.url, queue="q2")
    metrics = Metrics(server.url, "q2", stall_timeout=0.3)
    port = free_port()
    metrics.serve("127.0.0.1", port)
    try:
        assert get(port, "/healthz") == (200, "starting\n")
        assert get(port, "/readyz") == (503, "model loading\n")
        monkeypatch.setenv("PAGEDQ_METRICS_PORT", str(port))  # the image's HEALTHCHECK
        assert (healthcheck(["healthz"]), healthcheck(["readyz"])) == (0, 1)
        assert get(port, "/nope")[0] == 404
        client.submit_many([{"prompt": f"job {i}"} for i in range(5)])
        client.redis.xreadgroup(GROUP, "someone", {queue_key("q2"): ">"}, count=2)
        samples = scrape(port)
        assert (value(samples, "pagedq_queue_depth", queue="q2"),
                value(samples, "pagedq_queue_pending", queue="q2")) == (3, 2)
        assert all(("pagedq_jobs_total", (("outcome", o),)) in samples
                   for o in ("finished", "failed", "canceled", "dead_letter"))
        metrics.loaded = True
        metrics.tick(lambda: {"kv_blocks_total": 7, "kv_cache_dtype": "fp8",
                              "kv_bytes_per_token": 128})
        assert get(port, "/readyz") == (200, "ok\n") and get(port, "/healthz") == (200, "ok\n")
        samples = scrape(port)
        assert value(samples, "pagedq_kv_pool_blocks") == 7
        assert value(samples, "pagedq_kv_bytes_per_token") == 128
        assert value(samples, "pagedq_kv_cache_info", kv_cache_dtype="fp8") == 1
        server.stop()  # Redis goes away: not ready, still alive
        status, text = get(port, "/readyz")
        assert status == 503 and text.startswith("redis unreachable")
        assert get(port, "/healthz")[0] == 200
        samples = scrape(port)
        assert value(samples, "pagedq_redis_up") == 0
        assert ("pagedq_queue_depth", (("queue", "q2"),)) not in samples
        time.sleep(0.4)  # no tick for longer than the stall timeout: the loop is stuck
        status, text = get(port, "/healthz")
        assert status == 503 and text.startswith("loop stuck")
        assert healthcheck(["healthz"]) == 1
        metrics.stopping = True
        assert get(port, "/readyz") == (503, "stopping\n")
    finally:
        metrics.close()
