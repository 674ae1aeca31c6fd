"""The worker's Prometheus metrics (prometheus-client, text format) with ``/healthz`` and
``/readyz`` beside them, on ``--metrics-port``.

Each worker has its own ``CollectorRegistry`` (never the process-wide one), so that several
workers in one process (the tests) each report their own figures. What is exposed:

- counters kept here, from the driver's hooks: ``pagedq_jobs_total{outcome}`` (``finished``,
  ``failed``, ``canceled``, ``dead_letter``: jobs this worker ended; a deadline counts as
  finished, as in the RQ mirror) and two histograms: ``pagedq_time_to_first_token_seconds``
  (from the worker admitting a job to the engine step giving its first token: queue wait is
  not in it) and ``pagedq_inter_token_latency_seconds`` (per job, between consecutive steps
  that gave it tokens, as vLLM measures it);
- the engine's ``stats()``, copied by the worker loop at most every ``SNAPSHOT_S`` seconds
  (it walks every block table, too slow for each step; the HTTP thread never touches the
  engine): running and waiting sequences, KV blocks used and total, KV utilisation, and the
  engine's own counters (prefix-cache queries and hits in tokens, preemptions, generated
  tokens), KV bytes per token and ``pagedq_kv_cache_info{kv_cache_dtype}`` (always 1);
- the queue, read from Redis at scrape time (``producer.Client.stats``): depth (entries not
  yet delivered to any worker), pending (delivered, not acknowledged), dead letters, and
  ``pagedq_redis_up``.

``/healthz``: 200 while the process serves and its loop is not stuck (it ticks at least every
half second when idle; a tick older than ``--stall-timeout`` means a hung step or Redis call);
200 while the model loads too. ``/readyz``: 200 once the model is loaded and the loop runs,
while Redis answers and the worker is not stopping; 503 with the reason otherwise.
"""

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from producer.client import Client

OUTCOMES = ("finished", "failed", "canceled", "dead_letter")
SNAPSHOT_S = 1.0
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5)
# engine stats() key -> (metric, kind, help)
ENGINE_METRICS = {
    "num_running": ("pagedq_running_sequences", "gauge", "Sequences in the running batch"),
    "num_waiting": ("pagedq_waiting_sequences", "gauge", "Sequences waiting to be scheduled"),
    "kv_blocks_used": ("pagedq_kv_blocks_used", "gauge", "KV blocks referenced now"),
    "kv_blocks_total": ("pagedq_kv_pool_blocks", "gauge", "KV blocks in the pool"),
    "kv_bytes_per_token": ("pagedq_kv_bytes_per_token", "gauge",
                           "KV cache bytes one token takes (K and V, every layer)"),
    "kv_utilization": ("pagedq_kv_utilization", "gauge",
                       "Slots holding KV over slots in allocated blocks"),
    "prefix_cache_queries": ("pagedq_prefix_cache_queries", "counter",
                             "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("pagedq_prefix_cache_hits", "counter",
                          "Prompt tokens found in the prefix cache"),
    "preemptions": ("pagedq_preemptions", "counter", "Sequences preempted (recomputed later)"),
    "tokens_generated": ("pagedq_generated_tokens", "counter", "Tokens sampled by the engine"),
    "beam_searches": ("pagedq_beam_searches", "counter", "Beam search requests finished"),
}
# Client.stats() key -> (metric, help)
QUEUE_METRICS = {
    "lag": ("pagedq_queue_depth", "Jobs in the stream not yet delivered to any worker"),
    "pending": ("pagedq_queue_pending", "Jobs delivered to a worker, not acknowledged yet"),
    "dead_letters": ("pagedq_dead_letters", "Entries in the queue's dead-letter stream"),
}


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass  # a scrape every few seconds is not worth a log line


class Metrics:
    """The loop calls ``tick``, the driver the ``job_*`` hooks; ``serve`` starts the HTTP
    server (a daemon thread), ``close`` stops it."""

    def __init__(self, redis_url: str, queue: str, stall_timeout: float = 300.0) -> None:
        self.queue = queue
        self.stall_timeout = stall_timeout
        self.registry = CollectorRegistry()
        self.jobs = Counter("pagedq_jobs", "Jobs this worker ended, by outcome", ["outcome"],
                            registry=self.registry)
        for outcome in OUTCOMES:
            self.jobs.labels(outcome)  # every outcome shows, at 0, from the start
        self.ttft = Histogram("pagedq_time_to_first_token_seconds",
                              "From admitting a job to the step giving its first token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("pagedq_inter_token_latency_seconds",
                             "Per job, between consecutive steps that gave it tokens",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.registry.register(_Snapshot(self))
        self.client = Client(redis_url, queue, retries=0)
        self.stats: dict[str, float | str] = {}
        self.loaded = self.stopping = False
        self.last_tick: float | None = None
        self._next_snapshot = 0.0
        self._timing: dict[str, tuple[float, float | None]] = {}  # job: (admitted, last token)
        self._server: ThreadingWSGIServer | None = None

    # hooks -------------------------------------------------------------------------------
    def tick(self, stats: Callable[[], dict[str, float | str]]) -> None:
        """Called by the loop each tick with ``engine.stats`` (called at most every
        SNAPSHOT_S seconds)."""
        self.last_tick = now = time.monotonic()
        if now >= self._next_snapshot:
            self._next_snapshot = now + SNAPSHOT_S
            self.stats = stats()  # replaced whole: the HTTP thread reads one or the other

    def job_started(self, job_id: str) -> None:
        self._timing[job_id] = (time.monotonic(), None)

    def job_tokens(self, job_ids: Iterable[str]) -> None:
        """The jobs that got tokens in this step."""
        now = time.monotonic()
        for job_id in job_ids:
            admitted, last = self._timing.get(job_id, (now, now))
            (self.ttft if last is None else self.itl).observe(now - (last or admitted))
            self._timing[job_id] = (admitted, now)

    def job_ended(self, job_id: str, outcome: str | None) -> None:
        """``outcome``: one of OUTCOMES, or None for a job dropped (left to a peer)."""
        self._timing.pop(job_id, None)
        if outcome is not None:
            self.jobs.labels(outcome).inc()

    # probes ------------------------------------------------------------------------------
    def healthy(self) -> tuple[bool, str]:
        if self.last_tick is None:
            return True, "starting"
        idle = time.monotonic() - self.last_tick
        if idle > self.stall_timeout:
            return False, f"loop stuck: no tick for {idle:.0f} s"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        if not self.loaded:
            return False, "model loading"
        if self.stopping:
            return False, "stopping"
        try:
            self.client.redis.ping()
        except redis.RedisError as exc:
            return False, f"redis unreachable: {exc}"
        return True, "ok"

    # HTTP --------------------------------------------------------------------------------
    def serve(self, host: str, port: int) -> None:
        metrics_app = make_wsgi_app(self.registry)

        def app(environ: dict, start_response: Any) -> list[bytes]:
            path = environ.get("PATH_INFO", "/")
            if path in ("/", "/metrics"):
                return metrics_app(environ, start_response)
            probe = {"/healthz": self.healthy, "/readyz": self.ready}.get(path)
            ok, text = probe() if probe else (False, "not found")
            code = "200 OK" if ok else "404 Not Found" if not probe else "503 Unavailable"
            start_response(code, [("Content-Type", "text/plain; charset=utf-8")])
            return [text.encode() + b"\n"]

        self._server = make_server(host, port, app, ThreadingWSGIServer, handler_class=_Quiet)
        threading.Thread(target=self._server.serve_forever, name=f"metrics:{port}",
                         daemon=True).start()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.client.close()


class _Snapshot(Collector):
    """The engine's last snapshot and the queue's figures, gathered at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        stats = self.metrics.stats
        for key, (name, kind, text) in ENGINE_METRICS.items():
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, text)
            if key in stats:
                family.add_metric([], float(stats[key]))
            yield family
        info = GaugeMetricFamily("pagedq_kv_cache_info", "The KV cache's element type (label)",
                                 labels=["kv_cache_dtype"])
        if "kv_cache_dtype" in stats:
            info.add_metric([str(stats["kv_cache_dtype"])], 1)
        yield info
        try:
            queue = self.metrics.client.stats()
        except redis.RedisError:
            queue = None
        for key, (name, text) in QUEUE_METRICS.items():
            family = GaugeMetricFamily(name, text, labels=["queue"])
            if queue is not None:
                family.add_metric([self.metrics.queue], queue[key])
            yield family
        quant = GaugeMetricFamily("pagedq_weight_quantization",
                                  "1, labelled with the model's weight quantization",
                                  labels=["quantization"])
        if "quantization" in stats:
            quant.add_metric([str(stats["quantization"])], 1)
        yield quant
        up = GaugeMetricFamily("pagedq_redis_up", "1 when Redis answered this scrape")
        up.add_metric([], int(queue is not None))
        yield up
