"""``pagedq-worker`` / ``python -m worker``: serve one queue until SIGTERM or SIGINT."""

import logging
import signal
import sys
from collections.abc import Sequence

import structlog
import torch

from worker.config import parse_args
from worker.service import Worker


def configure_logging() -> None:
    """One JSON object per line on stderr, for log shippers."""
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True)


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging()
    settings = parse_args(argv)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    worker = Worker(settings)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop())
    worker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
