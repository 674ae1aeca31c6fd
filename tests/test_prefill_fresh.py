"""Fresh prefills (prompts with nothing cached) attended over their own new K/V instead of
through the pool: the reference against the paged reference, cuDNN's route against the float32
reference on a CUDA GPU, and which steps take the route. (The engine on the route:
``test_cuda_parity.test_bf16_top5``.)"""

import zlib

import pytest
import torch

import kernels
from kernels import reference

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# against a float32 reference: bf16 and fp16 round P to their dtype for P @ V
ATOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _packed(lens: list[int], num_kv_heads: int, group: int, head_dim: int,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of the prompts' rows packed, k and v strided views of one fused projection's
    output, as the engine's Attention splits them."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((lens, group, head_dim)).encode()))
    q_size, kv_size = num_kv_heads * group * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(sum(lens), q_size + 2 * kv_size, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (q.reshape(-1, num_kv_heads * group, head_dim),
            k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim))


def _paged_expected(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
                    block_size: int = 16) -> torch.Tensor:
    """``reference.paged_attention_prefill`` in float32 after storing k/v into a NaN pool,
    each prompt's blocks in reverse order."""
    q, k, v = q.float(), k.float(), v.float()
    counts = [-(-n // block_size) for n in lens]
    shape = (sum(counts) + 1, block_size, *k.shape[1:])
    k_cache, v_cache = (torch.full(shape, float("nan"), device=DEVICE) for _ in "kv")
    tables = torch.zeros(len(lens), max(counts), dtype=torch.int32)
    slots, first = [], 1
    for i, (n, c) in enumerate(zip(lens, counts, strict=True)):
        blocks = list(range(first + c - 1, first - 1, -1))
        first += c
        tables[i, :c] = torch.tensor(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(n)]
    reference.store_kvcache(k, v, k_cache, v_cache, torch.tensor(slots, device=DEVICE))
    cu = torch.tensor([0, *lens]).cumsum(0).to(DEVICE, torch.int32)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return reference.paged_attention_prefill(q, k_cache, v_cache, cu, tables.to(DEVICE), ctx,
                                             q.shape[-1] ** -0.5)


@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 32), (3, 128)])
def test_reference_is_the_paged_reference(group: int, head_dim: int) -> None:
    lens = [2, 7, 33, 33, 33, 64]
    q, k, v = _packed(lens, 2, group, head_dim, torch.float32)
    got = reference.prefill_attention_fresh(q, k, v, lens, head_dim**-0.5)
    torch.testing.assert_close(got, _paged_expected(q, k, v, lens), atol=1e-6, rtol=1e-6)


def test_route() -> None:
    """Only the CUDA backend, in bf16/fp16 with a pool of the same dtype, each run of equal
    lengths long enough in all."""
    least = kernels.FRESH_PREFILL_MIN_TOKENS
    bf16 = torch.bfloat16
    cpu = torch.empty(1, dtype=bf16)
    assert not kernels.fresh_prefill_pays(bf16, cpu, [least])
    assert not kernels.fresh_prefill_pays(bf16, cpu, [least], backend="torch")
    if not CUDA:
        return
    pool = torch.empty(1, dtype=bf16, device="cuda")
    assert kernels.fresh_prefill_pays(bf16, pool, [least, least + 1])
    assert kernels.fresh_prefill_pays(bf16, pool, [least // 4] * 4 + [least])
    assert not kernels.fresh_prefill_pays(bf16, pool, [least // 4] * 3 + [least])
    assert not kernels.fresh_prefill_pays(bf16, pool, [least // 2, least // 2 + 1])
    assert not kernels.fresh_prefill_pays(torch.float32, pool.float(), [least])
    assert not kernels.fresh_prefill_pays(bf16, pool.to(torch.float8_e4m3fn), [least])


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 128), (8, 128)])
def test_cudnn(dtype: torch.dtype, group: int, head_dim: int) -> None:
    from kernels import triton_ops

    # runs of one length are batched; cuDNN has no kernel for one key (the engine sends
    # one-token prompts down the decode path)
    lens = [2048, 2048, 2, 1500, 37, 37, 37, 1024]
    q, k, v = _packed(lens, 8 if group < 8 else 2, group, head_dim, dtype)
    got = triton_ops.prefill_attention_fresh(q, k, v, lens, head_dim**-0.5)
    assert got.isfinite().all()
    torch.testing.assert_close(got.float(), _paged_expected(q, k, v, lens),
                               atol=ATOL[dtype], rtol=ATOL[dtype])
