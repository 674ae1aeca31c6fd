"""Memory settings for the CPU engine: glibc keeps freed activation buffers for reuse, and
the weights ``cpu_gemv`` streams sit in huge pages.

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
import math
import time

import structlog
import torch

log = structlog.get_logger()
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
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


def empty_in_huge_pages(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised 1-D tensor of ``numel`` elements that starts on a 2 MiB boundary and that
    the kernel is asked (``madvise``, ``MADV_HUGEPAGE``) to back with 2 MiB pages as it is
    written; where the call fails (not Linux, THP off), whatever pages the kernel gives.

    Why: with 4 KiB pages the hardware's prefetchers stop at every page, and a page walk
    starts every 4 KiB of a stream: one pass over SmolLM2's 121 layers at one row took 21.6 ms
    against 19.1 in huge pages (25 against 28 GB/s; one stream 45 -> 48-51 tok/s, a Xeon whose
    transparent huge pages are ``madvise``-only). The KV pool only where it is reserved
    (``reserved_in_huge_pages``): its attention over 100 sequences of 450 tokens gained 12 %,
    but the first writes of 2 MiB pages during a call cost the prefill more (random-26m's 128
    requests: 23.1 -> 25.4 s)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    slack = _HUGE_PAGE // itemsize
    whole = torch.empty(numel + slack, dtype=dtype)
    start = (-whole.data_ptr()) % _HUGE_PAGE // itemsize
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        advised = libc.madvise(whole.data_ptr() + start * itemsize,
                               numel * itemsize // _HUGE_PAGE * _HUGE_PAGE, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError, TypeError):
        advised = False
    log.debug("huge pages", advised=advised, bytes=numel * itemsize)
    return whole[start:start + numel]


class HugePageArena:
    """``count`` elements of ``dtype`` in huge pages (``empty_in_huge_pages``); ``take`` copies
    a tensor into its next free part. Pages are only made resident where written, so room
    never taken costs nothing."""

    def __init__(self, count: int, dtype: torch.dtype = torch.float32) -> None:
        self.arena = empty_in_huge_pages(count, dtype)
        self.offset = 0

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` (of the arena's dtype) in the arena's next part."""
        size = tensor.numel()
        if tensor.dtype != self.arena.dtype:
            raise ValueError(f"a {tensor.dtype} tensor for a {self.arena.dtype} arena")
        if self.offset + size > self.arena.numel():
            raise ValueError(f"the arena has no room for {size} more elements")
        copy = self.arena[self.offset:self.offset + size].view(tensor.shape).copy_(tensor)
        self.offset += size
        return copy


def reserved_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor of ``shape`` in huge pages (``empty_in_huge_pages``), every page written
    now, as vLLM's CPU backend allocates its KV cache (``EngineConfig.reserve_kv_cache`` says
    why)."""
    start = time.perf_counter()
    tensor = empty_in_huge_pages(math.prod(shape), dtype).view(shape).zero_()
    log.info("kv pool reserved", gib=round(tensor.nbytes / 2**30, 2),
             seconds=round(time.perf_counter() - start, 2))
    return tensor
