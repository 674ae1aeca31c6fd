"""The few-row GEMV and SwiGLU's activation (``kernels.triton_gemv``, ``kernels.triton_rows``)
compiled for a Hopper GPU (sm_90) on a machine without one: Triton's interpreter, which the
other kernel tests use without a GPU, runs the kernels' Python, not the compiler, and the
compiler can refuse what the interpreter takes (a dtype passed to a jit helper, say). Triton
ships ``ptxas``, so the compile runs anywhere. In a subprocess: the kernel tests switch
Triton to its interpreter for this process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_gemv, triton_rows

def build(fn, signature, consts):
    names = list(signature)
    src = ASTSource(fn=fn, signature={k: "constexpr" if k in consts else v
                                      for k, v in signature.items()},
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    return len(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"])

ptr = "*bf16"
gemv = dict(x_ptr=ptr, w_ptr=ptr, b_ptr=ptr, y_ptr=ptr, N="i32", K="i32", s_x="i32",
            s_w="i32", s_y="i32", HAS_BIAS=0, SWIGLU=0, LIBDEVICE=0, EVEN=0, BLOCK_N=0,
            BLOCK_K=0)
sizes = [build(triton_gemv._gemv_kernel, gemv,
               dict(HAS_BIAS=bias, SWIGLU=swiglu, LIBDEVICE=True, EVEN=even, BLOCK_N=4,
                    BLOCK_K=1024))
         for bias, swiglu, even in [(False, False, True), (False, True, True), (True, True, False)]]
silu = dict(x_ptr=ptr, out_ptr=ptr, s_x="i32", s_o="i32", N=0, BLOCK=0, LIBDEVICE=0)
sizes.append(build(triton_rows._silu_and_mul_kernel, silu,
                   dict(N=8192, BLOCK=1024, LIBDEVICE=True)))
print(json.dumps(sizes))
"""


def test_kernels_compile_for_hopper() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns while the default moves
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    sizes = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(sizes) == 4 and all(size > 0 for size in sizes)  # a cubin for each
