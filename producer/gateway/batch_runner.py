"""Runs the batches: each line becomes jobs on its model's queue, each answer is stored once,
and the output and error files are written at the end.

Why it survives restarts: a line's job ids are derived from the batch id and its
``custom_id`` (``{batch}-{sha256(custom_id)[:16]}-{prompt}``), and a submit of an existing id
adds nothing (``Client.submit_many`` is idempotent per id), so a gateway that takes the batch
over after a crash resubmits every unanswered line and re-attaches to the jobs already queued
or running instead of running them again. A worker that dies mid-job is the workers' business:
a peer reclaims the job and resumes it, and the result stream shows no duplicate.

Each process runs the batches whose lease it holds (``BatchStore``), at most
``batch_max_in_flight`` lines of each at once; it looks for batches without a holder every
third of ``batch_lease_s``, and when told of a new one.
"""

import asyncio
import hashlib
import time
from typing import TYPE_CHECKING, Any

import structlog

from ..aio import AsyncJobHandle
from ..core import QueueFull
from .batch_store import BatchStore
from .errors import from_exception
from .files import FILE_TTL, FileStore
from .responses import Formatter
from .schemas import Request, parse_batch

if TYPE_CHECKING:
    from .state import Gateway

log = structlog.get_logger()
QUEUE_FULL_WAIT_S = 0.5


def line_id(batch_id: str, custom_id: str) -> str:
    return f"{batch_id}-{hashlib.sha256(custom_id.encode()).hexdigest()[:16]}"


class BatchRun:
    """One batch in this process: its lines, the jobs in flight, and why it stops early."""

    def __init__(self, gateway: "Gateway", batch_id: str,
                 lines: list[tuple[str, Request]]) -> None:
        self.gateway, self.id, self.lines = gateway, batch_id, lines
        self.store: BatchStore = gateway.batches
        self.stop_reason: str | None = None  # "cancelled" or "expired"
        self.in_flight: set[AsyncJobHandle] = set()

    def stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            for handle in list(self.in_flight):  # their answers come back, finish reason abort
                self.gateway.cancel([handle])

    async def lanes(self, todo: list[int]) -> None:
        indices = iter(todo)

        async def lane() -> None:
            for index in indices:  # the lanes share one iterator
                await self.answer(index)

        width = max(1, min(self.gateway.settings.batch_max_in_flight, len(todo)))
        await asyncio.gather(*(lane() for _ in range(width)))

    async def answer(self, index: int) -> None:
        custom_id, request = self.lines[index]
        base = line_id(self.id, custom_id)
        row: dict[str, Any] = {"id": f"batch_req_{base}", "custom_id": custom_id}
        if self.stop_reason is not None:
            error = {"code": f"batch_{self.stop_reason}",
                     "message": f"the batch was {self.stop_reason} before this request ran"}
            await self.store.answer(self.id, index, row | {"response": None, "error": error},
                                    ok=False)
            return
        formatter = Formatter(request, request_id=base)
        specs = request.specs()
        client = self.gateway.queues.client(request.model)
        while True:
            try:
                handles = await client.submit_many(
                    [spec | {"job_id": job_id} for spec, job_id in
                     zip(specs, formatter.job_ids(len(specs)), strict=True)])
                break
            except QueueFull:
                await asyncio.sleep(QUEUE_FULL_WAIT_S)
        self.in_flight.update(handles)
        if self.stop_reason is not None:
            self.gateway.cancel(handles)
        try:
            results = await asyncio.gather(*(h.result() for h in handles))
            body, status, ok = formatter.body(results), 200, True
        except Exception as exc:  # a job that failed is this line's error, not the batch's
            failure = from_exception(exc)
            body, status, ok = failure.body(), failure.status, False
        finally:
            self.in_flight.difference_update(handles)
        response = {"status_code": status, "request_id": formatter.object_id, "body": body}
        await self.store.answer(self.id, index, row | {"response": response, "error": None}, ok)

    async def run(self) -> None:
        answered = await self.store.answered(self.id)
        await self.lanes([i for i in range(len(self.lines)) if i not in answered])
        await self.finish()

    async def finish(self) -> None:
        files: FileStore = self.gateway.files
        final = self.stop_reason or "completed"
        await self.store.transition(self.id, "finalizing", ("in_progress", "cancelling"))
        file_ids: list[str | None] = []
        for ok, suffix in ((True, "output"), (False, "errors")):
            content = await self.store.answers(self.id, ok)
            file_ids.append((await files.create(
                content, f"{self.id}_{suffix}.jsonl", "batch_output",
                file_id=f"file-{self.id}-{suffix}"))["id"] if content else None)
        output_id, error_id = file_ids
        await self.store.finish(self.id, final, output_id, error_id, ttl=FILE_TTL)
        log.info("batch finished", batch=self.id, status=final)


class BatchRunner:
    def __init__(self, gateway: "Gateway") -> None:
        self.gateway = gateway
        self.running: dict[str, asyncio.Task] = {}
        self.runs: dict[str, BatchRun] = {}
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self.loop())

    async def stop(self) -> None:
        """Stops running batches here: their leases lapse and a restart takes them over."""
        for task in [self.task, *self.running.values()]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*filter(None, [self.task, *self.running.values()]),
                             return_exceptions=True)

    def cancel(self, batch_id: str) -> None:
        """Stops the batch at once if this process runs it (a peer's run sees ``cancelling``
        at its next lease renewal, within a third of the lease): a fast job must not finish
        during the wait."""
        if batch_id in self.runs:
            self.runs[batch_id].stop("cancelled")

    async def loop(self) -> None:
        lease = self.gateway.settings.batch_lease_s
        while True:
            try:
                for batch_id in await self.gateway.batches.active():
                    if batch_id not in self.running and \
                            await self.gateway.batches.take_lease(batch_id, lease):
                        self.running[batch_id] = asyncio.ensure_future(self.hold(batch_id))
            except Exception:  # Redis away: try again next turn
                log.exception("batch runner: could not look for batches")
            try:
                await asyncio.wait_for(self.wake.wait(), lease / 3)
            except TimeoutError:
                pass
            self.wake.clear()

    async def hold(self, batch_id: str) -> None:
        """Runs the batch while renewing its lease and watching for a cancel or the expiry."""
        store, lease = self.gateway.batches, self.gateway.settings.batch_lease_s
        work: asyncio.Future | None = None
        try:
            batch = await store.get(batch_id)
            content = await self.gateway.files.content(batch["input_file_id"])
            lines, _ = parse_batch(content, batch["endpoint"])
            run = self.runs[batch_id] = BatchRun(self.gateway, batch_id, lines)
            if batch["status"] == "cancelling":  # canceled while no process held it
                run.stop("cancelled")
            work = asyncio.ensure_future(run.run())
            while not work.done():
                await asyncio.wait({work}, timeout=lease / 3)
                if not await store.renew_lease(batch_id, lease):
                    break  # another process holds it now: the finally stops ours
                status = await store.status(batch_id)
                if status == "cancelling":
                    run.stop("cancelled")
                elif batch["expires_at"] < time.time():
                    run.stop("expired")
            if work.done():
                await work
        except Exception:
            log.exception("batch failed in this gateway; another will take it over",
                          batch=batch_id)
        finally:
            if work is not None and not work.done():  # stopping, or the lease is lost
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            self.running.pop(batch_id, None)
            self.runs.pop(batch_id, None)
            try:  # at once, so that a restart need not wait for the lease to lapse
                await store.release_lease(batch_id)
            except Exception:
                log.warning("could not release the lease of a batch", batch=batch_id)
