"""The CPU fast path: the numba attention against the torch reference (and its prefill against
its decode, bit for bit), the engine on it, and the oneDNN-packed linear layers."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

import kernels  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.cpu_linear import PackedLinear, can_pack, pack_linears  # noqa: E402
from kernels import cpu_native, cpu_ops, reference  # noqa: E402


@pytest.fixture(params=["native", "numba"])
def body(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test below runs on both per-token attention bodies: the C one (built here: gcc and
    AVX2 + FMA are on every machine the project runs on) and numba's fallback."""
    if request.param == "native":
        assert cpu_native.function("pagedq_decode_attention") is not None, (
            "the C attention did not build")
    monkeypatch.setattr(cpu_ops, "NATIVE", request.param == "native")
    return request.param


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_matches_reference(group: int, head_dim: int, block_size: int, body: str) -> None:
    gen = torch.Generator().manual_seed(group * 1000 + head_dim + block_size)
    num_kv_heads = 2
    # ragged: one token, block boundaries, and long rows, in one batch
    lens = [1, block_size, block_size + 1, 2 * block_size - 1, 7 * block_size + 3, 300]
    width = -(-max(lens) // block_size)
    num_blocks = len(lens) * width
    # distinct shuffled blocks; slots past a row's length are NaN and must not be read
    tables = torch.randperm(num_blocks, generator=gen).view(len(lens), width).to(torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    for cache in (k, v):  # poison the last slot of each row's last block past its length
        for row, n in enumerate(lens):
            if n % block_size:
                cache[tables[row, (n - 1) // block_size], n % block_size:] = float("nan")
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen)
    ctx = torch.tensor(lens, dtype=torch.int32)
    out = cpu_ops.paged_attention_decode(q, k, v, tables, ctx, head_dim**-0.5)
    # the reference reads whole padded blocks: give it NaN-free copies
    expected = reference.paged_attention_decode(q, k.nan_to_num(), v.nan_to_num(), tables, ctx,
                                                head_dim**-0.5)
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for row in range(len(lens)):  # alone, a token's KV heads are split over the threads
        alone = cpu_ops.paged_attention_decode(q[row:row + 1], k, v, tables[row:row + 1],
                                               ctx[row:row + 1], head_dim**-0.5)
        assert torch.equal(alone[0], out[row]), row



@pytest.mark.parametrize("group", [1, 2, 3, 8])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_matches_reference_and_decode_bit_for_bit(group: int, block_size: int,
                                                          head_dim: int, body: str) -> None:
    """Ragged prefills over cached prefixes (one token, a block boundary, a whole prompt, a
    prompt whose keys run over two chunks of 256) equal the reference, and each token equals,
    bit for bit, the decode step that would compute it: a resumed or re-chunked sequence then
    sees the bits its first run saw. Every query-head group the C body's tiles take (1 to 3
    heads a KV head, and 8 as 3 + 3 + 2), and the two-query value pass with an odd query out."""
    gen = torch.Generator().manual_seed(group * 100 + block_size + head_dim)
    num_kv_heads = 2
    contexts = [1, 2 * block_size, 5 * block_size + 3, 70, 530]
    queries = [1, 3, 5 * block_size + 3, 9, 37]
    width = -(-max(contexts) // block_size)
    tables = torch.randperm(len(contexts) * width, generator=gen).view(-1, width).int()
    shape = (len(contexts) * width, block_size, num_kv_heads, head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q = torch.randn(sum(queries), num_kv_heads * group, head_dim, generator=gen)
    cu = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.tensor(contexts, dtype=torch.int32)
    out = cpu_ops.paged_attention_prefill(q, k, v, cu, tables, ctx, 0.125)
    expected = reference.paged_attention_prefill(q, k, v, cu, tables, ctx, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for seq, (context, count) in enumerate(zip(contexts, queries, strict=True)):
        for j in range(count):
            row = int(cu[seq]) + j
            one = cpu_ops.paged_attention_decode(
                q[row:row + 1], k, v, tables[seq:seq + 1],
                torch.tensor([context - count + j + 1], dtype=torch.int32), 0.125)
            assert torch.equal(one[0], out[row]), (seq, j)

def test_prefill_reports_scratch_memory_it_cannot_have() -> None:
    """A tile whose scratch cannot be allocated (a token at position 2**40: ~10 TB of
    partials) makes the C prefill return -1 before it reads a key, and the rest of the call
    is skipped, not crashed."""
    prefill = cpu_native.function("pagedq_prefill")
    assert prefill is not None, "the C attention did not build"
    q, k = torch.randn(1, 2, 64), torch.randn(1, 16, 2, 64)
    out, tables = torch.empty(1, 2, 64), torch.zeros(1, 1, dtype=torch.int32)
    tiles = np.array([[0, 1, 0, 2**40]], dtype=np.int64)
    assert prefill(q.data_ptr(), k.data_ptr(), k.data_ptr(), tables.data_ptr(), 1,
                   tiles.ctypes.data, 1, 0.125, out.data_ptr(), 2, 2, 64, 16, 2) == -1


def test_decode_other_dtypes_fall_back() -> None:
    """float16 pools have no C build (bfloat16's: tests/test_cpu_bf16.py)."""
    q = torch.randn(2, 4, 64, dtype=torch.float16)
    k = torch.randn(4, 16, 2, 64, dtype=torch.float16)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    ctx = torch.tensor([20, 3], dtype=torch.int32)
    out = cpu_ops.paged_attention_decode(q, k, k, tables, ctx, 0.125)
    torch.testing.assert_close(out, reference.paged_attention_decode(q, k, k, tables, ctx, 0.125))


def test_decode_keeps_torch_thread_count() -> None:
    """numba's first parallel launch starts OpenMP on every core, which torch then reports as
    its own thread count: a worker told to use 1 thread must keep 1. A fresh process, as that
    happens once per process; NUMBA_NUM_THREADS=2 so that it shows on a 1-core machine too.
    numba's body: the C one runs on torch's own OpenMP threads, and numba never starts."""
    code = (
        "import torch\n"
        "torch.set_num_threads(1)\n"
        "from kernels import cpu_ops\n"
        "cpu_ops.NATIVE = False\n"
        "q, k = torch.randn(2, 4, 64), torch.randn(4, 16, 2, 64)\n"
        "tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)\n"
        "ctx = torch.tensor([20, 3], dtype=torch.int32)\n"
        "cpu_ops.paged_attention_decode(q, k, k, tables, ctx, 0.125)\n"
        "import numba\n"
        "print(torch.get_num_threads(), numba.get_num_threads(), numba.threading_layer())\n")
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[:2] == ["1", "1"], out


def test_default_backend_on_cpu() -> None:
    assert kernels.default_backend(torch.device("cpu")) == "cpu"
    assert kernels._resolve("paged_attention_decode", torch.device("cpu"), None) is (
        cpu_ops.paged_attention_decode)


def test_engine_same_tokens_on_both_cpu_backends(tiny_llama, monkeypatch) -> None:
    prompts = [[5 + i] * (3 + 37 * i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fast = [o.outputs[0].token_ids for o in LLM(str(tiny_llama)).generate(prompts, params)]
    monkeypatch.setattr(kernels, "default_backend", lambda device: "torch")
    slow = [o.outputs[0].token_ids for o in LLM(str(tiny_llama)).generate(prompts, params)]
    assert fast == slow


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_matches_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(96, 160, bias=rows % 2 == 1)
    x = torch.randn(rows, 96, generator=gen)
    expected = linear(x)
    model = torch.nn.Sequential(linear)
    assert can_pack(model)
    pack_linears(model)
    assert isinstance(model[0], PackedLinear)
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)



@pytest.mark.parametrize("in_features", [96, 1536])
def test_packed_linear_row_has_the_same_bits_in_any_batch(in_features: int) -> None:
    """Past 1,024 inputs oneDNN's one-row path sums another way; the layer pads a lone row."""
    gen = torch.Generator().manual_seed(in_features)
    layer = PackedLinear(torch.nn.Linear(in_features, 64))
    x = torch.randn(300, in_features, generator=gen)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(300)])
    for rows in (2, 3, 64, 300):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows

def test_loaded_model_packs_every_linear(tiny_llama3) -> None:
    llm = LLM(str(tiny_llama3))  # tied embeddings
    model = llm.engine.model_runner.model
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, PackedLinear)
    assert isinstance(layer.mlp.down_proj, PackedLinear)
    assert isinstance(model.lm_head, PackedLinear)
    ids = torch.tensor([3, 1, 4])
    hidden = model.model.embed_tokens(ids)
    torch.testing.assert_close(model.compute_logits(hidden),
                               hidden @ model.model.embed_tokens.weight.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(rows: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 576, generator=gen), torch.randn(576, generator=gen)
    residual = torch.randn(rows, 576, generator=gen) if with_residual else None
    out, res = cpu_ops.rms_norm(x, weight, 1e-5, residual)
    expected, expected_res = reference.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res, expected_res, atol=0, rtol=0)


@pytest.mark.parametrize("tokens", [1, 9])
def test_rotary_matches_reference(tokens: int) -> None:
    """q and k as the model passes them: strided views of one fused qkv output."""
    gen = torch.Generator().manual_seed(tokens)
    heads, kv_heads, dim = 4, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    cos, sin = torch.randn(64, dim, generator=gen), torch.randn(64, dim, generator=gen)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    for got, want in zip(cpu_ops.rotary(q, k, cos, sin, positions),
                         reference.rotary(q, k, cos, sin, positions), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 37])
def test_store_matches_reference(tokens: int) -> None:
    """Strided key/value views (as split from the fused qkv output), slots across blocks,
    and -1 slots skipped."""
    torch.manual_seed(0)
    qkv = torch.randn(tokens, 5, 16)
    key, value = qkv[:, 1:3], qkv[:, 3:5]
    slots = torch.randperm(8 * 6)[:tokens]
    slots[1::5] = -1
    pair = [torch.randn(6, 8, 2, 16) for _ in range(2)]
    caches = [*pair, *(c.clone() for c in pair)]
    cpu_ops.store_kvcache(key, value, caches[0], caches[1], slots)
    reference.store_kvcache(key, value, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], rtol=0, atol=0)
    torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0)
