"""Every failure as OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``,
with the status OpenAI's SDKs turn into their exception classes: 400 ``BadRequestError`` (bad
parameters, the pydantic message in one line), 401 ``AuthenticationError``, 404
``NotFoundError`` (unknown model, file or batch), 413 (upload over the size limit), 429
``RateLimitError`` (the queue is full), 503 (no live worker serves the model, or Redis is
unreachable or busy), 504 (the job sent nothing within the request timeout), 500 (a job that
failed inside the worker, or a bug)."""

from typing import Any

import redis
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from ..core import InvalidJob, JobFailed, QueueFull
from ..protocol import explain

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         503: "service_unavailable", 504: "timeout", 500: "internal_error"}
CLIENT_FAULTS = ("invalid_job", "invalid_request")  # the worker's codes for a bad job
log = structlog.get_logger()


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


def from_exception(exc: Exception) -> ApiError:
    """Our exceptions (and the clients') as the ApiError a client should see."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationError | RequestValidationError):
        errors = exc.errors()
        param = ".".join(str(p) for p in errors[0]["loc"] if p != "body") if errors else None
        return ApiError(400, explain(exc), "invalid_parameter", param or None)
    if isinstance(exc, ValueError):  # InvalidJob, and our own checks
        return ApiError(400, str(exc), "invalid_parameter")
    if isinstance(exc, QueueFull):
        return ApiError(429, str(exc), "queue_full")
    if isinstance(exc, JobFailed):
        return ApiError(400 if exc.code in CLIENT_FAULTS else 500, exc.message, exc.code)
    if isinstance(exc, redis.RedisError):  # Redis away, or this process' pools exhausted
        return ApiError(503, f"the queue is unavailable: {type(exc).__name__}: {exc}",
                        "redis_unavailable")
    if isinstance(exc, TimeoutError):
        return ApiError(504, str(exc), "timeout")
    return ApiError(500, f"{type(exc).__name__}: {exc}", "internal")


def install(app: FastAPI) -> None:
    async def handle(_: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, HTTPException):
            error = ApiError(exc.status_code, str(exc.detail))
        else:
            error = from_exception(exc)
        return JSONResponse(error.body(), status_code=error.status)

    for kind in (ApiError, RequestValidationError, ValidationError, InvalidJob, QueueFull,
                 JobFailed, TimeoutError, HTTPException, redis.RedisError):
        app.add_exception_handler(kind, handle)

    async def crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed", path=request.url.path, exc_info=exc)
        return await handle(request, exc)

    app.add_exception_handler(Exception, crash)  # a bug: 500, still as OpenAI's error object
