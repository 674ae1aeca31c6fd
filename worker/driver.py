"""Jobs in, events out: each delivered job becomes an engine request, and each engine step
becomes result events, RQ mirror transitions and acknowledgements in a Batch.

- A job's entry is acknowledged only together with its `end` or `error` event (the publisher
  writes both in one script), never earlier: a worker that dies leaves it pending.
- A reclaimed job: with an `end` or `error` in its result stream it is only acknowledged;
  delivered more than `max_deliveries` times it is dead-lettered (`error` "dead_letter");
  otherwise it resumes. Per sample the stream gives its token ids and text (its chunks in
  order), its next chunk number and whether it has a `done`; finished samples are not run again,
  the others continue from their tokens (recomputed as prompt, seeded draws advanced, text
  continued after the characters already sent), so chunk numbers go on and every token is
  published exactly once.
- Cancel (`abort`) and deadline (`deadline`) abort the request at once (its blocks are freed),
  send the text it held back, a `done` for every unfinished sample and `end`. RQ: canceled for
  a cancel; finished for a deadline (the job has its output, as the client's status says). A
  cancel is learnt from the round trip that ran during a step: that step's tokens of the job
  are dropped, never published, so a reader gets at most the step under way when it landed.
- Refusals: an invalid job is `invalid_job`, one the engine refuses `invalid_request`, an
  unexpected exception `internal`; each fails that job only.
"""

import functools
import time
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import structlog

from engine.detokenizer import held_back_text
from engine.llm_engine import LLMEngine, Resume
from engine.outputs import RequestDelta, SampleDelta
from engine.sampling_params import SamplingParams
from producer.protocol import Chunk, Done, End, Error, Event, Job, Usage
from worker.consumer import Consumer, Delivery
from worker.intake import Intake
from worker.job_params import engine_params, prompt_token_ids
from worker.metrics import Metrics
from worker.publisher import Batch

log = structlog.get_logger()


@dataclass
class _Running:
    """A job in the engine and what its result stream holds (or will, once flushed)."""

    job: Job
    params: SamplingParams
    entry_id: str
    log: Any
    prompt_tokens: int
    written: int  # events in the result stream
    seq: list[int]  # per sample: the number of its next chunk
    token_ids: list[list[int]]  # per sample: its output tokens so far
    texts: list[list[str]]  # per sample: its text, in pieces (for the RQ result)
    reasons: list[str | None] = field(default_factory=list)  # per sample, once done
    cum_logprobs: dict[int, float | None] = field(default_factory=dict)  # beam search's

    def emit(self, batch: Batch, event: Chunk | Done | End, ack: str = "") -> None:
        batch.event(self.job.id, self.written, event, ack)
        self.written += 1

    def replay(self, events: list[Event]) -> list[Resume | None]:
        """Takes up what an earlier delivery published; returns where each sample resumes."""
        for event in events:
            if isinstance(event, Chunk):
                self.seq[event.sample] = event.seq + 1
                self.token_ids[event.sample] += event.token_ids
                self.texts[event.sample].append(event.text)
            elif isinstance(event, Done):
                self.reasons[event.sample] = event.finish_reason
        return [None if reason else Resume(list(ids), sum(map(len, texts))) for reason, ids, texts
                in zip(self.reasons, self.token_ids, self.texts, strict=True)]

    def held_back(self, i: int, engine: LLMEngine) -> str:
        """The text of sample ``i``'s published tokens not published yet: what its detokenizer
        held back then (paid only by a cancel that lands while its job is stepped)."""
        return held_back_text(engine.tokenizer, self.params, self.token_ids[i],
                              sum(map(len, self.texts[i])))


class Driver:
    def __init__(self, engine: LLMEngine, consumer: Consumer, max_deliveries: int,
                 metrics: Metrics, intake: Intake, ttls: tuple[int, int]) -> None:
        self.engine = engine
        self.ttls = ttls  # how long RQ keeps a finished or canceled record, a failed one
        self.consumer = consumer
        self.max_deliveries = max_deliveries
        self.metrics = metrics
        self.intake = intake
        self.jobs: dict[str, _Running] = {}

    def entry_ids(self) -> list[str]:
        return [s.entry_id for s in self.jobs.values()]

    def admit(self, deliveries: list[Delivery], batch: Batch) -> None:
        for d in deliveries:
            bound = log.bind(job_id=d.job_id, entry_id=d.entry_id, deliveries=d.deliveries)
            if d.job_id in self.jobs:  # our own job, reclaimed from ourselves: it runs
                continue
            if any(isinstance(e, End | Error) for e in d.events):
                bound.info("job already ended; acknowledging it")
                batch.call(functools.partial(self.consumer.ack, entry_id=d.entry_id))
            elif d.deliveries > self.max_deliveries:
                reason = f"delivered {d.deliveries} times (max_deliveries={self.max_deliveries})"
                batch.call(functools.partial(self.consumer.dead_letter, delivery=d,
                                             reason=reason))
                self._fail(d.job_id, d.entry_id, d.written, "dead_letter", reason, batch, bound)
            elif d.invalid:
                self._fail(d.job_id, d.entry_id, d.written, "invalid_job", d.invalid, batch,
                           bound)
            else:
                try:
                    self._start(d, batch, bound)
                except ValueError as exc:  # the engine's or SamplingParams' refusal
                    self._fail(d.job_id, d.entry_id, d.written, "invalid_request", str(exc),
                               batch, bound)
                except Exception as exc:  # a bug must fail the job, not the worker
                    bound.exception("unexpected error starting the job")
                    self._fail(d.job_id, d.entry_id, d.written, "internal",
                               f"{type(exc).__name__}: {exc}", batch, bound)

    def _start(self, d: Delivery, batch: Batch, bound: Any) -> None:
        job = d.job
        assert job is not None
        ids = prompt_token_ids(self.engine.tokenizer, job)
        params, beam = engine_params(job.sampling)  # beams: nothing streams until done
        n = beam.beam_width if beam is not None else params.n
        state = _Running(job, params, d.entry_id, bound, len(ids), d.written, [0] * n,
                         [[] for _ in range(n)], [[] for _ in range(n)], [None] * n)
        resume = state.replay(d.events) if d.events else None
        if resume is not None and all(r is None for r in resume):
            self._end(state, batch, canceled=False)  # its samples had all finished
            return
        self.engine.add_request(job.id, ids, None if beam else params, job.priority, resume,
                                beam=beam)
        self.jobs[job.id] = state
        self.metrics.job_started(job.id)
        self.intake.started(len(ids), n)
        batch.mirror.started(job.id, self.consumer.name, fence=state.written)
        resumed = resume is not None and any(state.token_ids)
        # One INFO line per job ("job ended") keeps logging cheap at thousands of jobs/s.
        (bound.info if resumed else bound.debug)("job started", prompt_tokens=len(ids), n=n,
                                                 resumed=resumed)

    def _fail(self, job_id: str, entry_id: str, start: int, code: str, message: str,
              batch: Batch, bound: Any) -> None:
        """Ends the job with an ``error`` event (after the ``start`` events its stream holds),
        acknowledging its entry, and a failed RQ record."""
        bound.warning("job failed", code=code, message=message)
        self.metrics.job_ended(job_id, "dead_letter" if code == "dead_letter" else "failed")
        batch.event(job_id, start, Error(code=code, message=message), ack=entry_id)
        batch.mirror.failed(job_id, f"{code}: {message}", self.ttls[1])

    def step(self, batch: Batch) -> list[RequestDelta]:
        """One engine step. Its deltas are published by ``emit``, once the caller knows which
        jobs were canceled or taken over while the engine computed."""
        try:
            return self.engine.step()
        except Exception as exc:  # cannot tell whose request broke it: fail them all
            log.exception("engine step failed")
            for job_id, state in list(self.jobs.items()):
                self.engine.abort(job_id)
                del self.jobs[job_id]
                self._fail(job_id, state.entry_id, state.written, "internal",
                           f"{type(exc).__name__}: {exc}", batch, state.log)
            return []

    def emit(self, deltas: list[RequestDelta], batch: Batch) -> None:
        self.metrics.job_tokens(d.request_id for d in deltas if d.request_id in self.jobs
                                and any(s.token_ids for s in d.samples))
        for delta in deltas:
            state = self.jobs.get(delta.request_id)
            if state is None:  # stopped or dropped since the step: its tokens stay unpublished
                continue
            for sample in delta.samples:
                self._emit(state, sample, sample.finish_reason, batch)
            if delta.finished:
                self._end(state, batch, canceled=False)

    def _emit(self, state: _Running, sample: SampleDelta, reason: str | None,
              batch: Batch) -> None:
        i = sample.index
        if sample.token_ids or sample.text:
            tokens = None if sample.logprobs is None else \
                self.engine.token_texts(chain(sample.token_ids, *sample.logprobs))
            state.emit(batch, Chunk(sample=i, seq=state.seq[i], text=sample.text,
                                    token_ids=sample.token_ids, logprobs=sample.logprobs,
                                    tokens=tokens))
            state.seq[i] += 1
            state.token_ids[i] += sample.token_ids
            state.texts[i].append(sample.text)
        if reason is not None:
            state.reasons[i] = reason
            state.emit(batch, Done(sample=i, finish_reason=reason, usage=Usage(
                prompt_tokens=state.prompt_tokens, completion_tokens=len(state.token_ids[i])),
                cum_logprob=sample.cum_logprob))
            state.cum_logprobs[i] = sample.cum_logprob

    def _end(self, state: _Running, batch: Batch, canceled: bool) -> None:
        job_id = state.job.id
        self.jobs.pop(job_id, None)
        usage = Usage(prompt_tokens=state.prompt_tokens,
                      completion_tokens=sum(map(len, state.token_ids)))
        self.metrics.job_ended(job_id, "canceled" if canceled else "finished")
        state.emit(batch, End(usage=usage), ack=state.entry_id)
        if canceled:
            batch.mirror.canceled(job_id, self.ttls[0])
        else:
            result = {"outputs": [{"index": i, "text": "".join(texts), "finish_reason": reason,
                                   "completion_tokens": len(ids),
                                   "cum_logprob": state.cum_logprobs.get(i)}
                                  for i, (texts, reason, ids)
                                  in enumerate(zip(state.texts, state.reasons, state.token_ids,
                                                   strict=True))],
                      "usage": usage.model_dump()}
            batch.mirror.finished(job_id, result, self.ttls[0])
        state.log.info("job ended", canceled=canceled, n=len(state.reasons),
                       prompt_tokens=usage.prompt_tokens,
                       completion_tokens=usage.completion_tokens)

    def stop(self, job_id: str, reason: str, batch: Batch, stepped: bool = False) -> None:
        """Ends a job now, freeing its blocks at once: ``abort`` or ``deadline``. ``stepped``:
        the engine stepped it since its last emitted delta; that step's tokens are never
        published (a cancel then stops it within the step under way when it landed)."""
        state = self.jobs.get(job_id)
        if state is None:
            return
        delta = self.engine.abort(job_id)
        held = {} if stepped or delta is None else {s.index: s.text for s in delta.samples}
        for i, done in enumerate(state.reasons):
            if done is None:  # with the text it held back (samples not forked have none)
                text = state.held_back(i, self.engine) if stepped else held.get(i, "")
                self._emit(state, SampleDelta(i, [], text), reason, batch)
        self._end(state, batch, canceled=reason == "abort")

    def stop_overdue(self, batch: Batch) -> None:
        now = time.time()
        for state in list(self.jobs.values()):
            if state.job.deadline is not None and now >= state.job.deadline:
                self.stop(state.job.id, "deadline", batch)

    def drop(self, job_id: str, why: str) -> None:
        """Forgets a job without writing or acknowledging anything: another worker has it, or
        will reclaim it from the pending entries."""
        state = self.jobs.pop(job_id, None)
        if state is not None:
            self.engine.abort(job_id)
            self.metrics.job_ended(job_id, None)
            state.log.warning("job dropped", why=why)
