"""``/v1/batches``: create, retrieve, list, cancel; the work is ``batch_runner``'s.

Decisions:
- The input file is checked whole when the batch is created, as OpenAI's ``validating`` step
  does, and synchronously: a file with any bad line (not JSON, a wrong ``url``, a duplicate
  ``custom_id``, parameters the jobs would refuse, a model that is no queue) makes a batch in
  status ``failed`` whose ``errors`` list every bad line with its number; nothing runs.
- A line's model needs no live worker at creation: batch jobs wait in the queue for one (the
  24 h window is the limit, then the batch ends ``expired``).
- Cancel moves the batch to ``cancelling``; its jobs in flight are canceled, lines not yet
  started are answered in the error file with ``batch_cancelled``, and it ends ``cancelled``
  with the output of what had finished.
"""

import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel

from ..protocol import queue_key
from .batch_store import RUNNING
from .deps import gateway
from .errors import ApiError
from .schemas import ENDPOINTS, parse_batch

router = APIRouter()


class BatchCreate(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = None


@router.post("/v1/batches")
async def create_batch(body: BatchCreate, request: Request) -> dict[str, Any]:
    state = gateway(request)
    if body.endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {sorted(ENDPOINTS)}", "invalid_endpoint",
                       "endpoint")
    meta = await state.files.get(body.input_file_id)
    if meta["purpose"] != "batch":
        raise ApiError(400, f"file {body.input_file_id} has purpose {meta['purpose']!r}, not "
                            "'batch'", "invalid_file", "input_file_id")
    lines, errors = parse_batch(await state.files.content(body.input_file_id), body.endpoint)
    served = await state.queues.served()
    for model in sorted({req.model for _, req in lines}):
        if model not in served and not await state.redis.exists(queue_key(model)):
            errors.append({"code": "model_not_found", "param": "body.model", "line": None,
                           "message": f"the model `{model}` is no pagedq queue"})
    if not lines and not errors:
        errors.append({"code": "empty_file", "message": "the input file holds no request",
                       "param": None, "line": None})
    fields: dict[str, Any] = {"endpoint": body.endpoint, "input_file_id": body.input_file_id,
                              "completion_window": body.completion_window,
                              "metadata": body.metadata, "total": len(lines)}
    if errors:
        fields |= {"status": "failed", "failed_at": int(time.time()),
                   "errors": {"object": "list", "data": errors}}
    else:
        fields |= {"status": "in_progress", "in_progress_at": int(time.time())}
    batch = await state.batches.create(fields)
    state.runner.wake.set()
    return batch


@router.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None,
                       limit: int = 20) -> dict[str, Any]:
    data = await gateway(request).batches.listing(after, limit + 1)
    page = data[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(data) > limit}


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request) -> dict[str, Any]:
    return await gateway(request).batches.get(batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
    store = gateway(request).batches
    batch = await store.get(batch_id)
    if batch["status"] not in RUNNING + ("cancelled",):
        raise ApiError(400, f"batch {batch_id} is {batch['status']}: it cannot be cancelled",
                       "invalid_state", "batch_id")
    if await store.transition(batch_id, "cancelling", ("validating", "in_progress")):
        gateway(request).runner.cancel(batch_id)
    return await store.get(batch_id)
