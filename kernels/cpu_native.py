"""Builds the C kernels with the machine's C compiler at first use and loads them, one library
from every source:

- ``cpu_attention.c``, the CPU paged attention's per-token body, which ``kernels.cpu_ops``
  calls from its numba threads;
- ``cpu_gemv.c``, a linear layer's product for a few rows;
- ``cpu_rows.c``, the row-wise ops (RMSNorm, rotary, SiLU-and-mul, the KV store) at every
  batch size;
- ``cpu_decode.c``, a whole decode step for a few sequences over the three above.

Built with ``-fopenmp``: its ``libgomp.so.1`` is the one torch has loaded, so the kernels'
parallel loops run on torch's thread pool.

Why C: numba left the attention body's head_dim loops scalar (``vfmadd231ss``, no vector FMA,
in its assembly on an AVX-512 Xeon), and the profile put 46 % of a random-26m throughput run in
attention. The C body runs one 350-key token in 17.8 us against numba's 42 us (SmolLM2-like
heads, one thread). Built with ``-O3 -march=native`` and no fast-math (which would also set the
process's flush-to-zero mode), cached under ``$PAGEDQ_CACHE_DIR`` (default ``~/.cache/pagedq``)
by a hash of the sources, the flags and the compiler, written to a temporary name and renamed,
so that processes starting together never load a half-written library.

None (and numba's kernels in their place) without gcc/cc, on CPUs without AVX2 and FMA, or with
``PAGEDQ_NATIVE_KERNELS=0``. The two round differently, so workers that resume each other's
jobs should agree on it: a resumed stream is bit-exact only within one of them.
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numba
import numpy as np

_SOURCES = ("cpu_attention.c", "cpu_gemv.c", "cpu_rows.c", "cpu_decode.c")
_HEADERS = ("cpu_kernels.h",)
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC",
         "-std=c11", "-fopenmp"]
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# each function's argument types and result (the C sources give their meaning)
_SIGNATURES: dict[str, tuple[list, type | None]] = {
    "pagedq_attend": ([_P] * 4 + [_I, _F, _P] + [_I] * 6, None),
    "pagedq_gemv": ([_P, _I, _I, _P, _P, _P] + [_I] * 5, None),
    "pagedq_rms_norm": ([_P, _P, _P, _F, _P, _P, _I, _I, _I], None),
    "pagedq_rotary": ([_P, _I, _P, _I] + [_P] * 5 + [_I] * 5, None),
    "pagedq_silu_and_mul": ([_P, _P, _I, _I, _I], None),
    "pagedq_store_kv": ([_P, _I, _P, _I, _P, _P, _P, _I, _I], None),
    "pagedq_decode": ([_P] * 5 + [_F, _F, _P, _I, _P, _P, _P, _I, _P, _I], ctypes.c_int),
}
SPLIT_BELOW = 4  # decode batches this small split a token's KV heads over the threads


def cpu_has(*flags: str) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return all(flag in line.split() for flag in flags)


def _build(compiler: str, sources: list[Path], headers: list[Path],
           flags: list[str]) -> Path | None:
    """The library, built unless the cache holds it; None if the compiler refuses."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    texts = [path.read_text() for path in [*sources, *headers]]
    key = hashlib.sha256("\0".join([*texts, *flags, version]).encode()).hexdigest()
    cache_dir = Path(os.environ.get("PAGEDQ_CACHE_DIR") or "~/.cache/pagedq").expanduser()
    library = cache_dir / "native" / f"pagedq-{key[:16]}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
        os.close(fd)
        built = subprocess.run([compiler, *flags, *map(str, sources), "-o", tmp],
                               capture_output=True)
        if built.returncode != 0:
            os.unlink(tmp)
            return None
        os.replace(tmp, library)
    return library


@cache
def _library() -> ctypes.CDLL | None:
    compiler = shutil.which("gcc") or shutil.which("cc")
    if os.environ.get("PAGEDQ_NATIVE_KERNELS", "1") == "0" or compiler is None or not cpu_has(
            "avx2", "fma"):
        return None
    here = Path(__file__).parent
    try:
        library = _build(compiler, [here / s for s in _SOURCES], [here / h for h in _HEADERS],
                         FLAGS)
        return ctypes.CDLL(str(library)) if library else None
    except OSError:  # a cache it cannot write, a library it cannot load
        return None


@cache
def function(name: str) -> ctypes._CFuncPtr | None:
    """The C function ``name`` (a key of ``_SIGNATURES``) from the built library, or None
    where it cannot be had."""
    library = _library()
    if library is None:
        return None
    found = getattr(library, name)
    found.argtypes, found.restype = _SIGNATURES[name]
    return found


@cache
def launchers() -> tuple[Callable, Callable] | None:
    """numba's decode and prefill loops over ``attend()`` (one token per call, threads as
    ``kernels.cpu_ops``'s own), or None. Compiled per process, never cached by numba: the
    function's address is baked into them."""
    attend = function("pagedq_attend")
    if attend is None:
        return None

    @numba.njit(inline="always")
    def attend_one(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, table: np.ndarray,
                   length: int, scale: float, out: np.ndarray, kv_begin: int,
                   kv_end: int) -> None:  # pragma: no cover
        # one token: q and out [heads, dim], table its blocks (cpu_ops._attend's signature)
        attend(q.ctypes.data, k_cache.ctypes.data, v_cache.ctypes.data, table.ctypes.data,
               length, scale, out.ctypes.data, q.shape[0], k_cache.shape[2], q.shape[1],
               k_cache.shape[1], kv_begin, kv_end)

    @numba.njit(parallel=True, nogil=True)
    def decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
               block_tables: np.ndarray, context_lens: np.ndarray, scale: float,
               out: np.ndarray) -> None:  # pragma: no cover
        # below SPLIT_BELOW sequences a task per sequence and KV head, so that the threads
        # share one stream's heads (SmolLM2 at a 2,048-token context: its attention had run on
        # one of two cores); a task per sequence above, where the heads' strided reads of a
        # token's row cost random-26m's throughput 2-3 %
        kv_heads = k_cache.shape[2]
        tasks = kv_heads if q.shape[0] < SPLIT_BELOW else 1
        heads = kv_heads // tasks
        for unit in numba.prange(q.shape[0] * tasks):
            b, first = unit // tasks, unit % tasks * heads
            attend_one(q[b], k_cache, v_cache, block_tables[b], context_lens[b], scale, out[b],
                       first, first + heads)

    @numba.njit(parallel=True, nogil=True)
    def prefill(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                block_tables: np.ndarray, rows: np.ndarray, scale: float,
                out: np.ndarray) -> None:  # pragma: no cover
        for r in numba.prange(rows.shape[0]):
            row, seq, pos = rows[r, 0], rows[r, 1], rows[r, 2]
            attend_one(q[row], k_cache, v_cache, block_tables[seq], pos + 1, scale, out[row], 0,
                       k_cache.shape[2])

    return decode, prefill
