"""Builds the C kernels with the machine's C compiler at first use and loads them, one library
from every source:

- ``cpu_attention.c`` (with ``cpu_attention_values.h``), the CPU paged attention's per-token
  body, and ``cpu_attention_tasks.c``, its parallel loops (a decode step's, a prefill's),
  which ``kernels.cpu_ops`` calls;
- ``cpu_gemv.c``, a linear layer's product for a decode batch (and for a prefill's rows, of
  float32 weights on AVX-512), with its tiles in ``cpu_gemv_tile.h`` and its ways for 9-128
  rows and past them in ``cpu_gemv_chunks.h`` and ``cpu_gemv_many.h``;
- ``cpu_rows.c``, the row-wise ops (RMSNorm, rotary, SiLU-and-mul, the KV store) at every
  batch size;
- ``cpu_decode.c``, a whole decode step over the others;
- ``cpu_greedy.c``, a greedy step's tokens from a copy of the output layer's logits and a bound
  (``kernels.cpu_greedy``), ``cpu_greedy_tiles.c``, the same screen inside the bfloat16 copy's
  product on AMX's tiles, and ``cpu_screen.c``, the logits of its int8 copy;
- ``cpu_bf16.c``, the products, the attention and the decode step compiled again for bfloat16
  weights and KV pools (float32 arithmetic), their functions named with ``_bf16``.

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
from typing import Any

import torch

_SOURCES = ("cpu_attention.c", "cpu_attention_tasks.c", "cpu_gemv.c", "cpu_rows.c",
            "cpu_decode.c", "cpu_bf16.c", "cpu_greedy.c", "cpu_greedy_tiles.c", "cpu_screen.c")
_HEADERS = ("cpu_kernels.h", "cpu_greedy.h", "cpu_attention_ahead.h", "cpu_attention_columns.h",
            "cpu_attention_values.h", "cpu_attention_pairs.h", "cpu_gemv_amx.h",
            "cpu_gemv_chunks.h", "cpu_gemv_many.h", "cpu_gemv_tile.h")
# PAGEDQ_NATIVE_MARCH: another -march than this CPU's (haswell, say: the AVX2 build), to test
# that build's paths on a machine that has more
FLAGS = ["-O3", f"-march={os.environ.get('PAGEDQ_NATIVE_MARCH') or 'native'}",
         "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC", "-std=c11", "-fopenmp"]


def _cpuinfo(field: str) -> str:
    """The first core's ``field`` in /proc/cpuinfo (its flags, its vendor_id); '' if none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                 if ln.startswith(field)), "")


VENDOR = _cpuinfo("vendor_id")  # GenuineIntel, AuthenticAMD
if VENDOR == "GenuineIntel":  # the attention's prefetch differs (cpu_attention.c)
    FLAGS.append("-DPAGEDQ_INTEL")
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# each function's argument types and result (the C sources give their meaning)
_SIGNATURES: dict[str, tuple[list, type | None]] = {
    "pagedq_decode_attention": ([_P, _I, _P, _P, _P, _I, _P, _I, _F, _P] + [_I] * 5,
                                ctypes.c_int),
    "pagedq_prefill": ([_P] * 4 + [_I, _P, _I, _F, _P] + [_I] * 5, ctypes.c_int),
    "pagedq_gemv": ([_P, _I, _I, _P, _P, _P] + [_I] * 5, ctypes.c_int),
    "pagedq_rms_norm": ([_P, _P, _P, _F, _P, _P, _I, _I, _I], None),
    "pagedq_rotary": ([_P, _I, _P, _I] + [_P] * 5 + [_I] * 5, None),
    "pagedq_silu_and_mul": ([_P, _P, _I, _I, _I], None),
    "pagedq_argmax": ([_P, _I, _I, _I, _P, _I], None),
    "pagedq_store_kv": ([_P, _I, _P, _I, _P, _P, _P, _I, _I], None),
    "pagedq_decode": ([_P] * 5 + [_F, _F, _P, _I, _P, _P, _P, _I, _P, _I, _I, _P], ctypes.c_int),
    "pagedq_greedy": ([_P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _P, _P, _F, _F, _P, _I, _P, _I],
                      None),
    "pagedq_greedy_tiles": ([_P, _I, _I, _P, _I, _P, _P, _I, _I, _P, _P, _F, _F, _I, _I, _P, _I],
                            ctypes.c_int),
    "pagedq_bf16_rounding": ([_P, _I, _I, _I, _P], None),
    "pagedq_screen": ([_P, _I, _I, _P, _P, _P, _I, _I, _I, _P, _I], ctypes.c_int),
    "pagedq_bf16_paired": ([], ctypes.c_int),
    "pagedq_gemv_tiles": ([_I, _I], ctypes.c_int),
}
# cpu_bf16.c's build of those that read weights or KV: the same arguments, bfloat16 behind the
# weights' and pools' pointers
_BF16 = ("pagedq_decode_attention", "pagedq_prefill", "pagedq_gemv", "pagedq_store_kv",
         "pagedq_decode", "pagedq_gemv_tiles")
_SIGNATURES |= {f"{name}_bf16": _SIGNATURES[name] for name in _BF16}
# the element types those functions' weights and pools come in, and the name of each's build
_TYPED = {torch.float32: "", torch.bfloat16: "_bf16"}


def cpu_has(*flags: str) -> bool:
    present = _cpuinfo("flags").split()
    return all(flag in present for flag in flags)


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
def function(name: str) -> Callable[..., Any] | None:
    """The C function ``name`` (a key of ``_SIGNATURES``) from the built library, or None
    where it cannot be had."""
    library = _library()
    if library is None:
        return None
    found = getattr(library, name)
    found.argtypes, found.restype = _SIGNATURES[name]
    return found


def typed(name: str, dtype: torch.dtype) -> Callable[..., Any] | None:
    """``function`` of the build of ``name`` (one of ``_BF16``) for weights or KV pools of
    ``dtype``, or None where there is none (other dtypes, no C kernels)."""
    suffix = _TYPED.get(dtype)
    return None if suffix is None else function(name + suffix)

