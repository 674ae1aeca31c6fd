"""glibc malloc settings for the CPU engine: keep freed activation buffers for reuse.

A step's activations are a few MB each (a 2048-token prefill of SmolLM2: 25 MB for the MLP's
gate/up output). glibc serves such sizes with fresh mmap()s, and trims its heap when they are
freed, so every step page-faults its buffers in again. Raising the mmap threshold to its
maximum and the trim threshold above it keeps them in the heap: RMSNorm of 2048 x 576 took
3.4 ms instead of 14-20 ms, tcmalloc preloaded 1.5 ms (load average ~8, benchmarks/RESULTS.md).
A no-op where the C library is not glibc (or tcmalloc / jemalloc is preloaded: their mallopt
is a stub).
"""

import ctypes
import ctypes.util
import functools

import structlog

log = structlog.get_logger()
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit: 4 MiB * sizeof(long)
_TRIM_THRESHOLD = 512 << 20


@functools.cache  # once per process
def keep_freed_memory() -> None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and mallopt(_M_TRIM_THRESHOLD,
                                                                     _TRIM_THRESHOLD)
    log.debug("malloc thresholds", applied=bool(ok))
