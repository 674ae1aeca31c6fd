"""``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``: each request becomes jobs
(one per prompt) on the queue its ``model`` names; the answer is their results, whole or
streamed as Server-Sent Events in OpenAI's chunk format, ending with ``data: [DONE]``.

Decisions:
- A client that goes away cancels its jobs (``pagedq:cancel:{id}`` and a notice on
  ``pagedq:cancels``, seen by the worker within one engine step): a streamed request when
  Starlette stops its generator, a plain one by watching the connection for
  ``http.disconnect`` beside the wait, as vLLM's ``with_cancellation`` does. The canceled
  request gets status 499 (nginx's "client closed").
- An error after the stream started (a job that failed in the worker, a timeout) comes as one
  ``data: {"error": ...}`` event before ``[DONE]``, as vLLM sends it; the other jobs of the
  request are canceled.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from ..aio import AsyncJobHandle
from ..protocol import Chunk, Done, End, Event, Usage
from ..rq_mirror import parse_timestamp
from .deps import gateway
from .errors import from_exception
from .responses import Formatter
from .schemas import ChatCompletionRequest, CompletionRequest

router = APIRouter()
T = TypeVar("T")
CLIENT_CLOSED = 499


def model_card(queue: str, info: dict[str, Any]) -> dict[str, Any]:
    """vLLM's model card: ``id`` the queue, ``root`` the model its workers load."""
    born = info.get("created")
    created = int(parse_timestamp(born)) if born else 0
    return {"id": queue, "object": "model", "created": created, "owned_by": "pagedq",
            "root": info.get("model"), "parent": None, "workers": info["workers"]}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    served = await gateway(request).queues.served()
    return {"object": "list", "data": [model_card(q, i) for q, i in sorted(served.items())]}


@router.get("/v1/models/{model}")
async def retrieve_model(model: str, request: Request) -> dict[str, Any]:
    await gateway(request).queues.check(model)
    return model_card(model, (await gateway(request).queues.served())[model])


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Response | dict[str, Any]:
    return await generate(body, request)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest,
                           request: Request) -> Response | dict[str, Any]:
    return await generate(body, request)


async def generate(body: CompletionRequest | ChatCompletionRequest,
                   request: Request) -> Response | dict[str, Any]:
    state = gateway(request)
    client = await state.queues.check(body.model)
    formatter = Formatter(body)
    specs = body.specs()
    handles = await client.submit_many(
        [spec | {"job_id": job_id} for spec, job_id in
         zip(specs, formatter.job_ids(len(specs)), strict=True)])
    timeout = state.settings.request_timeout
    if body.stream:
        return StreamingResponse(sse(formatter, handles, timeout, state.cancel),
                                 media_type="text/event-stream")
    results = asyncio.gather(*(h.result(timeout) for h in handles))
    try:
        return formatter.body(await unless_disconnected(request, results))
    except ConnectionAbortedError:
        state.cancel(handles)
        return Response(status_code=CLIENT_CLOSED)
    except BaseException:
        state.cancel(handles)
        raise


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; raises ConnectionAbortedError (and cancels it) if the client goes
    away first."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        raise ConnectionAbortedError("the client disconnected")
    return task.result()


async def disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def merged(handles: list[AsyncJobHandle], timeout: float) -> AsyncIterator[
        tuple[int, Event]]:
    """``(prompt index, event)`` of every job, as they come; the first error raises."""
    if len(handles) == 1:
        async for event in handles[0].stream(timeout):
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, Event | BaseException]] = asyncio.Queue()

    async def pump(i: int, handle: AsyncJobHandle) -> None:
        try:
            async for event in handle.stream(timeout):
                queue.put_nowait((i, event))
        except Exception as exc:  # handed to the reader, which raises it
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        ended = 0
        while ended < len(handles):
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            ended += isinstance(item, End)
            yield i, item
    finally:
        for task in tasks:
            task.cancel()


def data(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def sse(formatter: Formatter, handles: list[AsyncJobHandle], timeout: float,
              cancel: Any) -> AsyncIterator[str]:
    ended: set[int] = set()
    try:
        for chunk in formatter.role_chunks(len(handles)):
            yield data(chunk)
        usages: list[Usage] = []
        try:
            async for i, event in merged(handles, timeout):
                if isinstance(event, Chunk | Done):
                    yield data(formatter.chunk(i, event))
                elif isinstance(event, End):
                    ended.add(i)
                    usages.append(event.usage)
        except Exception as exc:  # sent to the client; the stream ends
            yield data(from_exception(exc).body())
        else:
            if formatter.request.include_usage:
                yield data(formatter.usage_chunk(usages))
        yield "data: [DONE]\n\n"
    finally:  # the client went away, or a job failed: the others stop too
        unfinished = [h for i, h in enumerate(handles) if i not in ended]
        if unfinished:
            cancel(unfinished)

