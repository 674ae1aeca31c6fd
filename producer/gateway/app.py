"""The FastAPI application: the routes of ``api``, ``files`` and ``batches`` behind the key
check, OpenAI's error objects for every failure, and the ``Gateway`` started and closed with
the app (its batch runner takes over unfinished batches at start)."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import structlog
from fastapi import Depends, FastAPI

from . import api, batches, errors, files
from .deps import check_key
from .settings import GatewaySettings
from .state import Gateway

log = structlog.get_logger()


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not settings.api_key:
            log.warning("no API key configured: every request is let in (local use only)")
        app.state.gateway = Gateway(settings)
        await app.state.gateway.start()
        try:
            yield
        finally:
            await app.state.gateway.close()

    app = FastAPI(title="pagedq gateway", lifespan=lifespan)
    for module in (api, files, batches):
        app.include_router(module.router, dependencies=[Depends(check_key)])
    errors.install(app)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app
