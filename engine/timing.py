"""Load-time probes that choose between paths giving the same results, by their speed here."""

import time
from collections.abc import Callable, Sequence


def best_seconds(ways: Sequence[Callable[[], object]], runs: int) -> list[float]:
    """Each way's fastest of ``runs`` timed calls, the ways alternating (so that a drift of
    the machine falls on all of them), after an untimed call of each (the first calls
    allocate, and oneDNN builds its kernel for a new shape)."""
    seconds = [float("inf")] * len(ways)
    for run in range(runs + 1):
        for i, way in enumerate(ways):
            start = time.perf_counter()
            way()
            if run:
                seconds[i] = min(seconds[i], time.perf_counter() - start)
    return seconds
