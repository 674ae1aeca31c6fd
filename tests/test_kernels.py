"""Each Triton op against its torch reference on fresh random inputs.

Without a GPU the kernels run on CPU tensors under Triton's interpreter, with small shapes;
with one, the same checks run compiled, plus ``TestCuda``'s large shapes. Caches and outputs
start as NaN: a kernel that reads a slot it should not, or leaves a row unwritten, shows.
"""

import math
import os
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    # @triton.jit, triton's own library included, picks the interpreter when it decorates, and
    # transformers (via torch._dynamo) imported triton already: re-import all but its extension
    for name in [n for n in sys.modules if n.split(".")[0] == "triton" and n[:9] != "triton._C"]:
        del sys.modules[name]
pytest.importorskip("triton")

import kernels  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from kernels import reference, triton_ops  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_PARAMS = [pytest.param(dtype, id=str(dtype).removeprefix("torch.")) for dtype in DTYPES]
# Attention tolerances against an fp32 reference: the kernels round P to the dtype for P @ V.
ATOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
NAN = float("nan")
# The interpreter rounds fp32 to bf16 by truncation, not to nearest: allow it some ulps.
BF16_ULPS = 0 if CUDA else 4


def _ulps(dtype: torch.dtype, n: float) -> dict[str, float]:
    """``assert_close`` tolerances of ``n`` units in the last place of ``dtype``."""
    tol = (n + (BF16_ULPS if dtype == torch.bfloat16 else 0)) * torch.finfo(dtype).eps
    return {"atol": tol, "rtol": tol}


def _gen(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def _paged(gen: torch.Generator, ctx_lens: list[int], num_kv_heads: int, head_dim: int,
           block_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A NaN pool holding each sequence's KV in shuffled blocks. Block 0 (the tables' padding)
    and every slot past a context stay NaN. Returns k, v, block tables, context lengths."""
    counts = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(counts) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k, v = (torch.full(shape, NAN, dtype=dtype, device=DEVICE) for _ in range(2))
    tables = torch.zeros(len(ctx_lens), max(counts), dtype=torch.int32)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    for i, (ctx, n) in enumerate(zip(ctx_lens, counts, strict=True)):
        blocks, perm = perm[:n], perm[n:]
        tables[i, :n] = torch.tensor(blocks)
        slots = torch.arange(ctx)
        where = (torch.tensor(blocks)[slots // block_size], slots % block_size)
        k[where] = _randn(gen, ctx, num_kv_heads, head_dim, dtype=dtype)
        v[where] = _randn(gen, ctx, num_kv_heads, head_dim, dtype=dtype)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    return k, v, tables.to(DEVICE), lens


def _fp8_scales(kv_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """K and V scales that put the format's largest value at 3 and 2.5 standard deviations of
    the test's normal KV: the tails saturate."""
    top = torch.finfo(kv_dtype).max
    return {"k_scale": torch.tensor(3 / top, device=DEVICE),
            "v_scale": torch.tensor(2.5 / top, device=DEVICE)}


def _check_attention(dtype: torch.dtype, group: int, num_kv_heads: int, head_dim: int,
                     block_size: int, seqs: list[tuple[int, int]],
                     splits: list[int | None], kv_dtype: torch.dtype | None = None) -> None:
    """``seqs``: (new tokens, context length) per sequence, the rest of a context being its
    cached prefix. One new token each takes the decode kernel, once per entry of ``splits``.
    ``kv_dtype`` fp8: the pool holds the KV quantized (NaN slots stay NaN bytes), and the
    reference ops read it too."""
    gen = _gen(dtype, group, head_dim, block_size, seqs, kv_dtype)
    k, v, tables, lens = _paged(gen, [c for _, c in seqs], num_kv_heads, head_dim, block_size,
                                dtype)
    cu = torch.tensor([0] + [n for n, _ in seqs]).cumsum(0).to(DEVICE, torch.int32)
    q = _randn(gen, int(cu[-1]), num_kv_heads * group, head_dim, dtype=dtype)
    decode, scale = all(n == 1 for n, _ in seqs), head_dim**-0.5
    scales = {}
    if kv_dtype is not None:
        scales = _fp8_scales(kv_dtype)
        k = reference.quantize(k, kv_dtype, scales["k_scale"])
        v = reference.quantize(v, kv_dtype, scales["v_scale"])
    # the fp32 reference on the dequantized, NaN-free KV
    clean = [q.float()] + [reference.dequantize(t, torch.float32, scales.get(name)).float()
                           .nan_to_num() for t, name in ((k, "k_scale"), (v, "v_scale"))]
    expected = (reference.paged_attention_decode(*clean, tables, lens, scale) if decode else
                reference.paged_attention_prefill(*clean, cu, tables, lens, scale))
    if kv_dtype is not None:  # the reference's own fp8 path, NaN slots and all
        out = (reference.paged_attention_decode(q, k, v, tables, lens, scale, **scales)
               if decode else
               reference.paged_attention_prefill(q, k, v, cu, tables, lens, scale, **scales))
        torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=ATOL[dtype])
    for num_splits in splits:
        out = torch.full_like(q, NAN)
        if decode:
            triton_ops.paged_attention_decode(q, k, v, tables, lens, scale,
                                              num_splits=num_splits, out=out, **scales)
        else:
            triton_ops.paged_attention_prefill(q, k, v, cu, tables, lens, scale, out=out,
                                               **scales)
        assert out.isfinite().all(), f"NaN with num_splits={num_splits}"
        torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=ATOL[dtype])


def _check_rms_norm(dtype: torch.dtype, rows: int, hidden: int, with_residual: bool) -> None:
    gen = _gen("rms", dtype, rows, hidden, with_residual)
    x = _randn(gen, rows, hidden, dtype=dtype)
    residual = _randn(gen, rows, hidden, dtype=dtype) if with_residual else None
    weight = (1 + 0.1 * _randn(gen, hidden)).to(dtype)
    out, new_res = triton_ops.rms_norm(x, weight, 1e-6, residual)
    ref_out, ref_res = reference.rms_norm(x, weight, 1e-6, residual)
    assert out.isfinite().all() and out.dtype == ref_out.dtype
    torch.testing.assert_close(new_res, ref_res, **_ulps(dtype, 0))
    # fp32 sums in another order may move a rounding by a unit of the dtype
    torch.testing.assert_close(out, ref_out, **_ulps(dtype, 3))


def _check_rotary(dtype: torch.dtype, num_tokens: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, max_positions: int) -> None:
    gen = _gen("rotary", dtype, num_tokens, num_heads, head_dim)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1).to(DEVICE)
    qkv = _randn(gen, num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype)
    q, k = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads]  # strided views
    positions = torch.randint(0, max_positions, (num_tokens,), generator=gen).to(DEVICE)
    q_out, k_out = triton_ops.rotary(q, k, emb.cos(), emb.sin(), positions)
    q_ref, k_ref = reference.rotary(q, k, emb.cos(), emb.sin(), positions)
    torch.testing.assert_close(q_out, q_ref, **_ulps(dtype, 0))
    torch.testing.assert_close(k_out, k_ref, **_ulps(dtype, 0))


# Every dtype with every GQA ratio, each pair on one of the (head_dim, block_size) shapes in
# turn, so that every dtype and every ratio meets both (the full product triples the time).
SHAPES = [(64, 16), (128, 32)]
ATTENTION_CASES = [
    pytest.param(dtype, group, d, bs, id=f"{p.id}-gqa{group}-d{d}-bs{bs}")
    for i, (p, dtype) in enumerate(zip(DTYPE_PARAMS, DTYPES, strict=True))
    for j, group in enumerate([1, 3, 8])
    for d, bs in [SHAPES[(i + j) % 2]]]


@pytest.mark.parametrize("dtype,group,head_dim,block_size", ATTENTION_CASES)
def test_decode(dtype: torch.dtype, group: int, head_dim: int, block_size: int) -> None:
    bs = block_size  # lengths of 1 and at block boundaries; 3 splits leave empty ones
    lens = [1, bs, bs + 1, 2 * bs, 3 * bs - 1]
    _check_attention(dtype, group, 2, head_dim, bs, [(1, n) for n in lens], [None, 3])


@pytest.mark.parametrize("dtype,group,head_dim,block_size", ATTENTION_CASES)
def test_prefill(dtype: torch.dtype, group: int, head_dim: int, block_size: int) -> None:
    bs = block_size  # no prefix, one token after a prefix, chunks ending and starting on
    _check_attention(dtype, group, 2 if group < 8 else 1, head_dim, bs,  # block boundaries
                     [(bs, bs), (1, bs + 1), (5, 2 * bs), (bs + 3, 2 * bs + 3), (21, 21)], [None])


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("hidden,with_residual", [(64, False), (96, True)])
def test_rms_norm(dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    _check_rms_norm(dtype, 5, hidden, with_residual)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 64), (3, 1, 128)])
def test_rotary(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    _check_rotary(dtype, 7, num_heads, num_kv_heads, head_dim, 50)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("rows,width", [(3, 40), (2, 1500)])  # 1500: two column blocks, a tail
def test_silu_and_mul(dtype: torch.dtype, rows: int, width: int) -> None:
    x = 4 * _randn(_gen("silu", dtype, rows, width), rows, 2 * width, dtype=dtype)
    # ulps: libdevice's expf against the one torch was built with
    torch.testing.assert_close(triton_ops.silu_and_mul(x), reference.silu_and_mul(x),
                               **_ulps(dtype, 2))


def test_dispatch() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert kernels._resolve("copy_blocks", cpu, None) is reference.copy_blocks
    assert kernels._resolve("rotary", cpu, "torch") is reference.rotary
    assert kernels._resolve("rotary", cuda, None) is triton_ops.rotary
    assert kernels._resolve("silu_and_mul", cuda, None) is triton_ops.silu_and_mul
    assert kernels._resolve("copy_blocks", cpu, "triton") is triton_ops.copy_blocks
    with pytest.raises(ValueError, match="not available"):
        kernels._resolve("rotary", cpu, "cutlass")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_engine_greedy(tiny_llama: Path, make_llm: Callable[..., LLM],
                       monkeypatch: pytest.MonkeyPatch, kv_cache_dtype: str) -> None:
    """The engine's own calls (pool views, strided k/v, decode groups, chunked prefill, n=2
    forks with copy-on-write, fp8 scales from the first prefill) give the reference's greedy
    tokens on the Triton ops."""
    prompts = [list(range(3, 38)), [7, 8]]
    params = SamplingParams(n=2, temperature=0, max_tokens=2, ignore_eos=True)
    outs = []
    for module in ("kernels.reference", "kernels.triton_ops"):
        for backend in kernels._BACKENDS:
            monkeypatch.setitem(kernels._BACKENDS, backend, module)
        monkeypatch.setattr(kernels, "_FP8_CPU", module)
        llm = make_llm(tiny_llama, device=DEVICE.type, max_num_batched_tokens=16,
                       num_kv_blocks=32, enforce_eager=True,  # the reference cannot be captured
                       kv_cache_dtype=kv_cache_dtype)
        outs.append([[o.token_ids for o in r.outputs]
                     for r in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
class TestCuda:
    """Engine-sized shapes, compiled."""

    @pytest.mark.parametrize("dtype", DTYPE_PARAMS)
    @pytest.mark.parametrize("group", [1, 4, 8])
    def test_decode(self, dtype: torch.dtype, group: int) -> None:
        lens = torch.randint(1, 4096, (40,), generator=_gen(group)).tolist() + [1, 16, 4096]
        _check_attention(dtype, group, 8, 128, 16, [(1, n) for n in lens], [None, 1, 8])
        # few programs, long contexts: the heuristic splits
        _check_attention(dtype, group, 8, 128, 32, [(1, 32768), (1, 17), (1, 20001)], [None])

    @pytest.mark.parametrize("dtype", DTYPE_PARAMS)
    @pytest.mark.parametrize("group", [1, 4, 8])
    def test_prefill(self, dtype: torch.dtype, group: int) -> None:
        seqs = [(1024, 1024), (1, 2049), (512, 4096), (333, 1000), (2048, 2048), (64, 64)]
        _check_attention(dtype, group, 8, 128, 16, seqs, [None])

    @pytest.mark.parametrize("dtype", DTYPE_PARAMS)
    def test_other_ops(self, dtype: torch.dtype) -> None:  # store and copy: test_kernels_kv
        _check_rms_norm(dtype, 4096, 4096, True)
        _check_rms_norm(dtype, 1000, 2048, False)
        _check_rotary(dtype, 4096, 32, 8, 128, 8192)
        test_silu_and_mul(dtype, 4096, 8192)
