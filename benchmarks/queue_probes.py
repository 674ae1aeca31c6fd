"""benchmarks/queue.py's probes: what a thread waited for a CPU, and timers wrapped around the
live worker's methods (in the benchmark only)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.service import Worker


def runqueue_wait(tid: int) -> float | None:
    """Seconds thread ``tid`` of this process has waited for a CPU (kernel schedstat): the
    share of a wall time that other processes took from it. None where not available."""
    try:
        return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def waited(tid: int, before: float | None) -> float | None:
    after = runqueue_wait(tid)
    return None if before is None or after is None else after - before


class Patches:
    """Wraps methods of live objects (instance attributes shadow the class's); ``undo()``."""

    def __init__(self) -> None:
        self._undo: list[tuple[object, str]] = []

    def wrap(self, obj: object, name: str, make: Callable[[Callable[..., Any]], Any]) -> None:
        setattr(obj, name, make(getattr(obj, name)))
        self._undo.append((obj, name))

    def undo(self) -> None:
        for obj, name in reversed(self._undo):
            delattr(obj, name)
        self._undo.clear()


class StepClock:
    """When ``engine.step`` returned each token: (request id, sample, position) -> perf_counter."""

    def __init__(self) -> None:
        self.produced: dict[tuple[str, int, int], float] = {}
        self._counts: dict[tuple[str, int], int] = defaultdict(int)

    def wrap(self, step: Callable[[], list[Any]]) -> Callable[[], list[Any]]:
        def timed_step() -> list[Any]:
            deltas = step()
            now = time.perf_counter()
            for delta in deltas:
                for sample in delta.samples:
                    key = (delta.request_id, sample.index)
                    if sample.token_ids:
                        self.produced[(*key, self._counts[key])] = now
                        self._counts[key] += len(sample.token_ids)
            return deltas

        return timed_step


class Timers:
    """Seconds and calls per wrapped method."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrapper(self, label: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(fn: Callable[..., Any]) -> Callable[..., Any]:
            def timed_call(*a: Any, **kw: Any) -> Any:
                start = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    self.seconds[label] += time.perf_counter() - start
                    self.calls[label] += 1

            return timed_call

        return make


def instrument(worker: Worker, timers: Timers, patches: Patches) -> None:
    """Times the worker loop's parts."""
    parts = [("tick", worker, "_tick"), ("claims", worker.consumer, "inspect"),
             ("claims", worker.consumer, "refresh"), ("claims", worker.consumer, "reclaim"),
             ("admit", worker.driver, "admit"), ("driver.step", worker.driver, "step"),
             ("engine.step", worker.engine, "step"), ("flush", worker.publisher, "send"),
             ("collect", worker.publisher, "collect"), ("emit", worker.driver, "emit")]
    for label, obj, name in parts:
        patches.wrap(obj, name, timers.wrapper(label))

    def split_read(read: Callable[..., Any]) -> Callable[..., Any]:
        busy, idle = timers.wrapper("read")(read), timers.wrapper("idle")(read)

        def timed_read(count: int, block_ms: int | None) -> Any:  # blocking: waits for jobs
            return (busy if block_ms is None else idle)(count, block_ms)

        return timed_read

    patches.wrap(worker.consumer, "read", split_read)


def breakdown(timers: Timers) -> dict[str, dict[str, float]]:
    """The worker loop's seconds by part; ``events``: the driver's share of its step and its
    emitting; ``flush``: publishing (sending a round trip, reading its reply)."""
    s, n = timers.seconds, timers.calls
    parts = {"engine.step": s["engine.step"],
             "events": s["driver.step"] - s["engine.step"] + s["emit"],
             "admit": s["admit"], "flush": s["flush"] + s["collect"], "read": s["read"],
             "claims": s["claims"], "idle": s["idle"]}
    parts["other"] = s["tick"] - sum(parts.values())
    calls = {"engine.step": n["engine.step"], "flush": n["flush"], "read": n["read"],
             "tick": n["tick"]}
    return {"seconds": {k: round(v, 3) for k, v in parts.items()} | {"tick": round(s["tick"], 3)},
            "calls": calls}
