"""The worker's Redis connection, and riding out a Redis outage (restart, failover, network)."""

import time
from collections.abc import Callable
from typing import TypeVar

import redis
import structlog
from redis.backoff import NoBackoff
from redis.retry import Retry

log = structlog.get_logger()
T = TypeVar("T")
DOWN = (redis.ConnectionError, redis.TimeoutError)


def connect(url: str) -> redis.Redis:
    # redis-py's own retries are off: a retried write whose first try landed unseen must be
    # told apart from a fresh one, and only `retry` below knows which it re-sends.
    return redis.Redis.from_url(url, decode_responses=True, retry=Retry(NoBackoff(), 0),
                                socket_timeout=30, socket_connect_timeout=5,
                                socket_keepalive=True, health_check_interval=15)


class GaveUp(Exception):
    """Redis stayed down until the worker had to stop."""


def retry(call: Callable[[], T], what: str, give_up: Callable[[], bool]) -> T:
    """``call()`` until Redis answers, backing off up to 2 s between tries; raises GaveUp once
    ``give_up()`` says the worker must stop instead."""
    attempt = 0
    while True:
        try:
            return call()
        except DOWN as exc:
            if give_up():
                raise GaveUp(what) from exc
            log.warning("redis unavailable", during=what, attempt=attempt, error=str(exc))
            time.sleep(min(2.0, 0.05 * 2**attempt))
            attempt += 1
