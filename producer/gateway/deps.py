"""What every route depends on: the process's ``Gateway`` and the API key check.

Keys: ``Authorization: Bearer KEY`` must match one of ``--api-key`` (several may be valid at
once, so that keys can be rotated); compared in constant time. With no key configured every
request is let in, for local use, and the gateway warns at start.

``check_key`` is ``async`` though it awaits nothing: FastAPI runs a plain ``def`` dependency in
its thread pool, a hop to a worker thread and back on every request, on the path to the first
token (py-spy showed it: ``run_in_threadpool`` per request)."""

from hmac import compare_digest
from typing import TYPE_CHECKING

from fastapi import Request

from .errors import ApiError

if TYPE_CHECKING:
    from .state import Gateway


def gateway(request: Request) -> "Gateway":
    return request.app.state.gateway


async def check_key(request: Request) -> None:
    keys = gateway(request).settings.api_key
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not any(compare_digest(token.strip().encode(), k.encode())
                                             for k in keys):
        raise ApiError(401, "Incorrect API key provided: send one of the gateway's keys as "
                            "'Authorization: Bearer KEY'", "invalid_api_key")
