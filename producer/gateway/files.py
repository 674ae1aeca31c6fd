"""``/v1/files``: batch inputs uploaded by clients and the outputs the gateway writes, kept in
Redis so that every gateway process (and a restarted one) sees them.

Keys (the gateway's own, beside the protocol's):
- ``pagedq:file:{id}``: hash with ``meta`` (OpenAI's file object as JSON) and ``content``.
- ``pagedq:files``: sorted set of file ids by creation time.

Decisions:
- Only ``purpose=batch`` is accepted (the gateway has no other use for files); the content must
  be UTF-8 (it is JSONL); uploads over ``max_file_bytes`` get a 413 (OpenAI's own limit is
  200 MB; the default here, 100 MiB, keeps one file well inside Redis' 512 MB string limit).
- Files live ``FILE_TTL`` (30 days, as OpenAI keeps batch outputs) unless deleted first.
"""

import json
import time
import uuid
from typing import Any, cast

from fastapi import APIRouter, Form, Request, UploadFile
from fastapi.responses import PlainTextResponse
from redis.asyncio import Redis

from ..protocol import PREFIX
from .deps import gateway
from .errors import ApiError

FILE_TTL = 30 * 24 * 3600
FILES = f"{PREFIX}:files"
router = APIRouter()


def file_key(file_id: str) -> str:
    return f"{PREFIX}:file:{file_id}"


def no_such_file(file_id: str) -> ApiError:
    return ApiError(404, f"No such File object: {file_id}", "file_not_found", "file_id")


class FileStore:
    def __init__(self, conn: Redis, max_bytes: int) -> None:
        # decode_responses=True (state.py): its replies are str, as cast
        self.redis, self.max_bytes = conn, max_bytes

    async def create(self, content: str, filename: str, purpose: str,
                     file_id: str | None = None) -> dict[str, Any]:
        """Stores a file; a given ``file_id`` is overwritten (the batch outputs' are derived
        from the batch id, so writing them again after a restart changes nothing)."""
        file_id = file_id or f"file-{uuid.uuid4().hex}"
        meta = {"id": file_id, "object": "file",
                "bytes": len(content.encode()), "created_at": int(time.time()),
                "filename": filename, "purpose": purpose, "status": "processed",
                "expires_at": int(time.time()) + FILE_TTL}
        key = file_key(file_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"meta": json.dumps(meta), "content": content})
            pipe.expire(key, FILE_TTL)
            pipe.zadd(FILES, {file_id: time.time()})
            await pipe.execute()
        return meta

    async def get(self, file_id: str) -> dict[str, Any]:
        meta = await self.redis.hget(file_key(file_id), "meta")
        if meta is None:
            raise no_such_file(file_id)
        return json.loads(meta)

    async def content(self, file_id: str) -> str:
        content = cast(str | None, await self.redis.hget(file_key(file_id), "content"))
        if content is None:
            raise no_such_file(file_id)
        return content

    async def delete(self, file_id: str) -> None:
        await self.get(file_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(file_key(file_id))
            pipe.zrem(FILES, file_id)
            await pipe.execute()

    async def listing(self, purpose: str | None, limit: int) -> list[dict[str, Any]]:
        ids = cast(list[str], await self.redis.zrevrange(FILES, 0, -1))
        async with self.redis.pipeline(transaction=False) as pipe:
            for file_id in ids:
                pipe.hget(file_key(file_id), "meta")
            metas = await pipe.execute()
        expired = [i for i, m in zip(ids, metas, strict=True) if m is None]
        if expired:
            await self.redis.zrem(FILES, *expired)
        files = [json.loads(m) for m in metas if m is not None]
        return [f for f in files if purpose in (None, f["purpose"])][:limit]


@router.post("/v1/files")
async def upload(request: Request, file: UploadFile, purpose: str = Form()) -> dict[str, Any]:
    store = gateway(request).files
    if purpose != "batch":
        raise ApiError(400, f"purpose must be 'batch', not {purpose!r}", "invalid_purpose",
                       "purpose")
    data = await file.read(store.max_bytes + 1)
    if len(data) > store.max_bytes:
        raise ApiError(413, f"the file is over the limit of {store.max_bytes} bytes",
                       "file_too_large", "file")
    try:
        content = data.decode()
    except UnicodeDecodeError:
        raise ApiError(400, "a batch file must be UTF-8 JSONL", "invalid_file", "file") from None
    return await store.create(content, file.filename or "upload.jsonl", purpose)


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None,
                     limit: int = 10_000) -> dict[str, Any]:
    data = await gateway(request).files.listing(purpose, limit)
    return {"object": "list", "data": data, "has_more": False}


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request) -> dict[str, Any]:
    return await gateway(request).files.get(file_id)


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> PlainTextResponse:
    return PlainTextResponse(await gateway(request).files.content(file_id))


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
    await gateway(request).files.delete(file_id)
    return {"id": file_id, "object": "file", "deleted": True}
