"""The worker's loop: take what the engine can admit, step it while Redis applies the previous
step's round trip, publish the step in one round trip; keep in-flight jobs claimed, take over
silent peers' jobs, heartbeat; stop gracefully."""

import time

import structlog

from engine.default_model import DEFAULT_MODEL
from engine.llm_engine import LLMEngine
from producer import rq_mirror
from worker.config import Settings
from worker.connection import DOWN, GaveUp, connect, retry
from worker.consumer import Consumer, Delivery
from worker.driver import Driver
from worker.metrics import Metrics
from worker.publisher import Batch, Flushed, Publisher

log = structlog.get_logger()
IDLE_BLOCK_MS = 500  # how long an idle worker waits for a job before looking around again
HEARTBEAT_S = 5.0
WORKER_TTL_S = 30  # RQ's worker record outlives a few missed heartbeats, not a dead worker


class Worker:
    def __init__(self, settings: Settings, engine: LLMEngine | None = None) -> None:
        self.settings = settings
        self.name = settings.consumer
        self.conn = connect(settings.redis_url)
        self.metrics = Metrics(settings.redis_url, settings.queue, settings.stall_timeout)
        if settings.metrics_port:  # up while the model loads: /healthz 200, /readyz 503
            self.metrics.serve(settings.metrics_host, settings.metrics_port)
        try:
            self.engine = engine or LLMEngine(settings.engine_config())
        except BaseException:
            self.metrics.close()
            raise
        self.consumer = Consumer(self.conn, settings.queue, self.name, self._past_grace)
        self.driver = Driver(self.engine, self.consumer, settings.max_deliveries, self.metrics)
        self.publisher = Publisher(self.conn, settings.queue, settings.result_ttl,
                                   self._past_grace)
        self.log = log.bind(worker=self.name, queue=settings.queue)
        self._batch = Batch()  # what the next round trip writes
        self._arrived: list[Delivery] = []  # jobs read, not admitted yet
        self._stop_at: float | None = None
        self._next_heartbeat = self._next_claims = 0.0

    def stop(self) -> None:
        """Stop taking jobs and finish those in flight within the grace period; called again,
        stop now. Safe from a signal handler."""
        now = time.monotonic()
        self._stop_at = now if self._stop_at is not None else now + self.settings.grace_period
        self.metrics.stopping = True

    def _past_grace(self) -> bool:
        return self._stop_at is not None and time.monotonic() >= self._stop_at

    def run(self) -> None:
        """Serves the queue until stopped; jobs still running then are left pending (not
        acknowledged) for a peer to reclaim."""
        try:
            self.consumer.ensure_group()
            self._register()
            self.metrics.loaded = True
            self.log.info("worker ready", max_num_seqs=self.engine.config.max_num_seqs,
                          kv_blocks_total=self.engine.stats()["kv_blocks_total"],
                          metrics_port=self.settings.metrics_port)
            while not self._past_grace() and (
                    self._stop_at is None or self.driver.jobs or self._batch
                    or self.publisher.in_flight):
                self._tick()
        except GaveUp as exc:
            self.log.error("redis stayed unavailable until the grace period ended",
                           during=str(exc))
        finally:
            for job_id in list(self.driver.jobs):
                self.driver.drop(job_id, "worker stopping: left pending for a peer")
            try:
                self.publisher.close()
                self.consumer.leave()
                rq_mirror.unregister_worker(self.conn, self.name)
            except (*DOWN, GaveUp):
                self.log.warning("could not unregister: redis unavailable")
            self.metrics.close()
            self.log.info("worker stopped")

    def _register(self) -> None:
        model = self.settings.model or DEFAULT_MODEL  # what the gateway's /v1/models shows
        retry(lambda: rq_mirror.register_worker(self.conn, self.name, [self.consumer.queue],
                                                WORKER_TTL_S, model), "register", self._past_grace)

    def _heartbeat(self) -> None:
        state = "busy" if self.driver.jobs else "idle"
        if not retry(lambda: rq_mirror.heartbeat(self.conn, self.name, WORKER_TTL_S, state),
                     "heartbeat", self._past_grace):
            self._register()  # the record expired (a long stall, or Redis lost its data)

    def _tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + HEARTBEAT_S
            self._heartbeat()
        taking = self._stop_at is None
        if now >= self._next_claims:
            self._next_claims = now + self.settings.claim_refresh_s
            self._settle(self.publisher.collect(), stepped=False)  # its acks land first
            self.consumer.refresh(self.driver.entry_ids())
            free = self.driver.free_slots() - len(self._arrived)
            if taking and free > 0:
                reclaimed = self.consumer.reclaim(free, self.settings.reclaim_idle_ms)
                self.consumer.inspect(reclaimed)
                self._arrived += reclaimed
        if taking and not (self.driver.jobs or self._batch or self._arrived
                           or self.publisher.in_flight):
            self._arrived = self.consumer.read(self.driver.free_slots(), IDLE_BLOCK_MS)
        if self._arrived and taking:  # once stopping, they stay pending for a peer
            self.driver.admit(self._arrived, self._batch)
            self._arrived = []
        self.driver.stop_overdue(self._batch)
        deltas = self.driver.step(self._batch) if self.engine.has_unfinished() else []
        self._settle(self.publisher.collect(), stepped=True)  # the trip that overlapped the step
        self.driver.emit(deltas, self._batch)
        if self._batch or self.driver.jobs:
            self._publish(self.driver.free_slots() - len(self._arrived) if taking else 0)
        self.metrics.tick(self.engine.stats)

    def _publish(self, free: int) -> None:
        """Sends the step's batch; in the same round trip, checks for cancellations and reads
        as many new jobs as there are free slots. Its reply is read after the next step."""
        batch, self._batch = self._batch, Batch()
        self.publisher.send(
            batch, list(self.driver.jobs),
            read=(lambda pipe: self.consumer.read_in(pipe, free)) if free > 0 else None)

    def _settle(self, flushed: Flushed, stepped: bool) -> None:
        """Acts on a round trip's reply. ``stepped``: the engine stepped since it was sent, and
        that step's deltas are not emitted yet: a canceled job's are dropped."""
        for job_id in flushed.superseded:
            self.driver.drop(job_id, "another worker continued its result stream")
        self._batch.discard(flushed.superseded)
        for job_id in flushed.canceled:  # aborted now; its events go out next round trip
            self.driver.stop(job_id, "abort", self._batch, stepped)
        if flushed.read is not None:
            self._arrived += self.consumer.arrived(flushed.read)
