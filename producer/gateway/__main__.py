"""``pagedq-gateway`` / ``python -m producer.gateway``: serve the OpenAI-compatible API."""

import sys
from collections.abc import Sequence

import uvicorn

from .app import create_app
from .settings import parse_args


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                log_level="warning", timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
