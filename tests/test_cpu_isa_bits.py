"""The C kernels' AVX2 build and this machine's give a token the same bits: a job resumed on a
worker with another CPU, or re-chunked there, sees the bits its first run saw. The attention's
paths that only AVX-512 takes (a prefill's scores over key columns, blocked by query heads and
keys; the softmax's and SiLU's exponentials 16 lanes at a time) promise each lane's arithmetic
of the 8-lane ones; on an AVX2 machine both builds take the same paths and the test still
checks the build flag. The AVX2 build runs in a child process (``PAGEDQ_NATIVE_MARCH`` is read
at import) on the same inputs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_native, cpu_ops, cpu_rows

_CHILD = """
import sys, torch
sys.path.insert(0, sys.argv[3])
from tests.test_cpu_isa_bits import outputs
torch.save(outputs(torch.load(sys.argv[1])), sys.argv[2])
"""


def inputs() -> dict[str, torch.Tensor]:
    """SmolLM2's attention shapes (9 query heads on 3 KV heads of 64): a 530-token prompt (over
    two chunks of 256), and 77 and 1 tokens after cached prefixes, every one's last token
    decoded too;
    rows of gate/up with infinities, NaN and the exponential's clamps at their edges."""
    gen = torch.Generator().manual_seed(42)
    block, contexts, queries = 16, [530, 120, 9], [530, 77, 1]
    width = -(-max(contexts) // block)
    tables = torch.randperm(len(contexts) * width, generator=gen).view(-1, width).int()
    shape = (len(contexts) * width, block, 3, 64)
    gate_up = torch.randn(33, 2 * 200, generator=gen) * 40
    gate_up[0, :12] = torch.tensor([float("inf"), float("-inf"), float("nan"), 88.0, 88.5, -87.3,
                                    -87.4, 87.9, -88.0, 0.0, -0.0, 1e-40])
    return {"q": torch.randn(sum(queries), 9, 64, generator=gen) * 3,
            "k": torch.randn(shape, generator=gen) * 2, "v": torch.randn(shape, generator=gen),
            "tables": tables, "contexts": torch.tensor(contexts, dtype=torch.int32),
            "cu": torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32),
            "gate_up": gate_up, "x": torch.randn(40, 576, generator=gen),
            "residual": torch.randn(40, 576, generator=gen),
            "weight": torch.randn(576, generator=gen)}


def outputs(t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    assert cpu_native.function("pagedq_prefill") is not None, "the C kernels did not build"
    prefill = cpu_ops.paged_attention_prefill(t["q"], t["k"], t["v"], t["cu"], t["tables"],
                                              t["contexts"], 0.125)
    decode = cpu_ops.paged_attention_decode(t["q"][t["cu"][1:].long() - 1], t["k"], t["v"],
                                            t["tables"], t["contexts"], 0.125)
    normed, residual = cpu_rows.rms_norm(t["x"], t["weight"], 1e-5, t["residual"])
    return [prefill, decode, cpu_rows.silu_and_mul(t["gate_up"]), normed, residual]


def test_avx2_build_gives_this_machines_bits(tmp_path: Path) -> None:
    if not cpu_native.cpu_has("avx2", "fma"):
        pytest.skip("the AVX2 build needs AVX2 and FMA")
    data = inputs()
    torch.save(data, tmp_path / "in.pt")
    env = {**os.environ, "PAGEDQ_NATIVE_MARCH": "haswell"}
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "in.pt"),
                    str(tmp_path / "out.pt"), str(root)], env=env, check=True, cwd=root)
    avx2 = torch.load(tmp_path / "out.pt")
    for name, mine, theirs in zip(("prefill", "decode", "silu", "norm", "residual"),
                                  outputs(data), avx2, strict=True):
        assert torch.equal(mine.view(torch.int32), theirs.view(torch.int32)), name
