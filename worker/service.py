"""The worker's loop: take what the engine can admit, step it while Redis applies the previous
step's round trip (read before the step instead when it holds jobs seen landing), publish the
step in one round trip (running jobs' later chunks may wait for the stream interval); keep
in-flight jobs claimed, take over silent peers' jobs, heartbeat; stop gracefully."""

import os
import time
from dataclasses import dataclass, field

import structlog
import torch

from engine.default_model import DEFAULT_MODEL
from engine.llm_engine import LLMEngine
from engine.outputs import RequestDelta
from producer import rq_mirror
from producer.protocol import CANCELS_KEY
from worker.arrivals import Arrivals
from worker.config import BUSY_STREAM_INTERVAL_MS, Settings
from worker.connection import DOWN, GaveUp, connect, retry
from worker.consumer import Consumer, Delivery
from worker.driver import Driver
from worker.intake import Intake
from worker.metrics import Metrics
from worker.publisher import Batch, Flushed, Publisher

log = structlog.get_logger()
IDLE_BLOCK_MS = 500  # how long an idle worker waits for a job before looking around again
HEARTBEAT_S = 5.0
WORKER_TTL_S = 30  # RQ's worker record outlives a few missed heartbeats, not a dead worker


@dataclass
class _Tick:
    """What one pass of the loop carries from phase to phase."""

    now: float
    taking: bool  # not stopping: new and reclaimed jobs are taken
    deltas: list[RequestDelta] = field(default_factory=list)  # the step's, to emit


def stream_interval_s(settings: Settings, engine: LLMEngine) -> float:
    """``--stream-interval-ms`` in seconds; unset, 50 ms where the engine steps on the CPU with
    a thread on every core the worker may use, else 0 (every step's chunks at once, as vLLM
    streams). A round trip's wake-ups (``_due``) cost a step most where they take a core from
    its threads. One stream of SmolLM2 on 2 cores, 6 alternating rounds (session 61): with 2
    torch threads the worker ran at 0.84 of ``LLM``'s tokens/s sending every step and 0.93 at
    50 ms; with 1 thread, 0.98 and 1.00. A GPU's step leaves the host's cores to the trip."""
    if settings.stream_interval_ms is not None:
        return settings.stream_interval_ms / 1000
    cores = len(os.sched_getaffinity(0))
    busy = engine.device.type == "cpu" and torch.get_num_threads() >= cores
    return BUSY_STREAM_INTERVAL_MS / 1000 if busy else 0.0


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
        self.consumer = Consumer(self.conn, settings.queue, self.name, self._past_grace,
                                 settings.dead_letter_max_len)
        self.intake = Intake(self.engine)
        self.driver = Driver(self.engine, self.consumer, settings.max_deliveries, self.metrics,
                             self.intake, (settings.result_ttl, settings.failure_ttl))
        self.publisher = Publisher(self.conn, settings.queue, settings.result_ttl,
                                   self._past_grace)
        self.log = log.bind(worker=self.name, queue=settings.queue)
        self._batch = Batch()  # what the next round trip writes
        self._arrived: list[Delivery] = []  # jobs read, not admitted yet
        # jobs landed before the round trip in flight was sent, so its read holds them
        self._news_in_flight = False
        self.arrivals = Arrivals(self.conn, self.consumer.key) if settings.watch_arrivals \
            else None
        self.stream_interval_s = stream_interval_s(settings, self.engine)
        # Round trips skipped between chunks (``_due``) do not ask for cancellations: notices do.
        self.cancels = Arrivals(self.conn, CANCELS_KEY) if self.stream_interval_s else None
        self._sent_at = 0.0  # tick.now of the last round trip sent
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
            for watch in (self.arrivals, self.cancels):
                if watch is not None:
                    watch.close()
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

    # -- the loop: one tick runs these phases, in this order (``_PHASES``) --------------------
    def _heartbeat(self, tick: _Tick) -> None:
        """First: a loop stuck anywhere below shows as a stale RQ heartbeat."""
        if tick.now >= self._next_heartbeat:
            self._next_heartbeat = tick.now + HEARTBEAT_S
            state = "busy" if self.driver.jobs else "idle"
            if not retry(lambda: rq_mirror.heartbeat(self.conn, self.name, WORKER_TTL_S, state),
                         "heartbeat", self._past_grace):
                self._register()  # the record expired (a long stall, or Redis lost its data)

    def _claims(self, tick: _Tick) -> None:
        """Every ``claim_refresh_s``: reads the round trip in flight first (its acks must land
        before the claims are refreshed, or an acknowledged job would be claimed again), keeps
        this worker's jobs claimed, and takes over silent peers' jobs it has room for."""
        if tick.now < self._next_claims:
            return
        self._next_claims = tick.now + self.settings.claim_refresh_s
        self._settle(self.publisher.collect(), stepped=False)
        self.consumer.refresh(self.driver.entry_ids())
        room = self.intake.count(len(self._arrived)) if tick.taking else 0
        if room > 0:
            reclaimed = self.consumer.reclaim(room, self.settings.reclaim_idle_ms)
            self.consumer.inspect(reclaimed)
            self._arrived += reclaimed

    def _collect_news(self, tick: _Tick) -> None:
        """When jobs landed before the round trip in flight was sent, and the engine had none
        waiting to start, its read holds them: its reply is read now (~0.2 ms), not after the
        step, so they start in this step (``worker.arrivals``)."""
        if self._news_in_flight:
            self._news_in_flight = False
            self._settle(self.publisher.collect(), stepped=False)

    def _wait_for_jobs(self, tick: _Tick) -> None:
        """Only with nothing in flight: a blocking read (a busy worker reads in its round
        trip instead)."""
        if tick.taking and not (self.driver.jobs or self._batch or self._arrived
                                or self.publisher.in_flight):
            self._arrived = self.consumer.read(self.intake.count(0), IDLE_BLOCK_MS)

    def _admit(self, tick: _Tick) -> None:
        """Before the step, so that jobs read start in it. Once stopping, jobs read stay
        pending, for a peer."""
        if self._arrived and tick.taking:
            self.driver.admit(self._arrived, self._batch)
            self._arrived = []
        self.driver.stop_overdue(self._batch)

    def _step(self, tick: _Tick) -> None:
        """The engine computes while Redis applies the round trip in flight."""
        if self.engine.has_unfinished():
            tick.deltas = self.driver.step(self._batch)

    def _collect(self, tick: _Tick) -> None:
        """The reply of the round trip that overlapped the step: before the step's tokens are
        emitted, so that a job canceled or taken over meanwhile gets none of them."""
        self._settle(self.publisher.collect(), stepped=True)

    def _emit(self, tick: _Tick) -> None:
        self.driver.emit(tick.deltas, self._batch)

    def _publish(self, tick: _Tick) -> None:
        """Sends the tick's batch when due (``_due``); in the same round trip, checks for
        cancellations and reads as many new jobs as the engine could start soon. Its reply is
        read after the next step (``_collect``)."""
        if not (self._batch or self.driver.jobs):
            return
        room = self.intake.count(len(self._arrived)) if tick.taking else 0
        news = (room > 0 and self.arrivals is not None and not self.engine.has_waiting()
                and self.arrivals.take())
        if not (self._due(tick) or news):
            return
        self._sent_at, self._news_in_flight = tick.now, news
        batch, self._batch = self._batch, Batch()
        self.publisher.send(
            batch, list(self.driver.jobs),
            read=(lambda pipe: self.consumer.read_in(pipe, room, self.settings.reclaim_idle_ms))
            if room > 0 else None)

    def _due(self, tick: _Tick) -> bool:
        """Whether the round trip goes this tick, or the batch waits for a later one: it goes
        when a cancel notice landed (its job stops after the next step, as if asked in every
        step), when the batch is urgent (``Batch.urgent``), when stopping, and once the stream
        interval has passed. Serving one stream of SmolLM2 on 2 cores, a step that a round
        trip overlapped took 0.6-1.1 ms longer than one that none did (medians, ~13-18 ms
        steps, the same worker; session 60): each trip wakes the round-trip thread,
        redis-server and the reader, and each wake-up takes a core from the step's threads.
        At 50 ms, one step in four pays it."""
        noticed = self.cancels is not None and self.cancels.take()
        return (noticed or self._batch.urgent or not tick.taking
                or tick.now - self._sent_at >= self.stream_interval_s)

    def _metrics(self, tick: _Tick) -> None:
        self.metrics.tick(self.engine.stats)

    _PHASES = (_heartbeat, _claims, _collect_news, _wait_for_jobs, _admit, _step, _collect,
               _emit, _publish, _metrics)

    def _tick(self) -> None:
        tick = _Tick(time.monotonic(), taking=self._stop_at is None)
        for phase in self._PHASES:
            phase(self, tick)

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
