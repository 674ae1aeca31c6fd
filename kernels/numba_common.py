"""What the numba CPU kernels share: their flags, the thread pool sized as torch's, and softmax
rows."""

from collections.abc import Callable
from typing import Any

import numba
import numpy as np
import torch


def on_torch_threads(kernel: Callable[..., None], *args: Any) -> None:
    """Runs a parallel numba kernel on torch's thread count, and keeps torch's count as it was:
    numba's first parallel launch starts OpenMP with every core, and torch reads its thread count
    back from OpenMP, so ``torch.set_num_threads(1)`` would quietly become every core. A plain
    call, not a context manager: it runs once per attention call, some 30 times a decode step."""
    threads = torch.get_num_threads()
    if numba.get_num_threads() != threads:
        # numba.config sets its attributes at import (its stub declares none of them)
        most = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
        numba.set_num_threads(min(threads, most))
    try:
        kernel(*args)
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def cpu_float32(*tensors: torch.Tensor) -> bool:
    """Whether the numba kernels can take these tensors (numba has no bfloat16)."""
    for t in tensors:  # a loop, not all(): no generator on a path taken ~200 times a step
        if t.dtype != torch.float32 or t.device.type != "cpu":
            return False
    return True


JIT: dict[str, Any] = {"parallel": True, "fastmath": True, "cache": True, "nogil": True,
                       "error_model": "numpy"}
SERIAL = JIT | {"parallel": False}


@numba.njit(**SERIAL)
def softmax_numerators(scores: np.ndarray, length: int) -> np.ndarray:  # pragma: no cover
    """Replaces each row's first ``length`` scores by ``exp(score - row max)`` in place and
    returns the rows' sums (the denominators)."""
    total = np.zeros(scores.shape[0], np.float32)
    for g in range(scores.shape[0]):
        top = np.float32(-np.inf)
        for t in range(length):
            top = max(top, scores[g, t])
        for t in range(length):
            scores[g, t] = np.exp(scores[g, t] - top)
            total[g] += scores[g, t]
    return total
