"""The KV cache's writes against their torch reference, every dtype and fp8 (store, copy-on-
write), and the fp8 attention kernels: Triton under the interpreter without a GPU, as
``test_kernels`` sets up (imported first)."""

import pytest
import torch
from test_kernels import (  # first: it sets up the interpreter without a GPU
    CUDA,
    DEVICE,
    DTYPE_PARAMS,
    DTYPES,
    NAN,
    SHAPES,
    _check_attention,
    _fp8_scales,
    _gen,
    _randn,
)

from kernels import reference, triton_ops


def _check_store(dtype: torch.dtype, num_tokens: int, num_heads: int, head_dim: int,
                 block_size: int, num_blocks: int, kv_dtype: torch.dtype | None = None) -> None:
    """``kv_dtype`` fp8: the values span 2^-30 to 2^30 times the scale (subnormals, ties and
    saturation), and the bytes must equal the reference's."""
    gen = _gen("store", dtype, num_tokens, head_dim, block_size, kv_dtype)
    # key as a strided view, as the engine's come out of the fused qkv matmul
    key = _randn(gen, num_tokens, 2 * num_heads, head_dim, dtype=dtype)[:, :num_heads]
    value = _randn(gen, num_tokens, num_heads, head_dim, dtype=dtype)
    scales = {}
    if kv_dtype is not None:
        spread = 2.0 ** torch.randint(-30, 30, value.shape, generator=gen)
        value = (value.float() * spread.to(DEVICE)).to(dtype)
        scales = _fp8_scales(kv_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1  # skipped
    slots = slots.to(DEVICE)
    shape = (num_blocks, block_size, num_heads, head_dim)
    k, v = (torch.full(shape, NAN, dtype=dtype, device=DEVICE).to(kv_dtype or dtype)
            for _ in range(2))
    k_ref, v_ref = k.clone(), v.clone()
    reference.store_kvcache(key, value, k_ref, v_ref, slots, **scales)
    triton_ops.store_kvcache(key, value, k, v, slots, **scales)
    for out, ref in ((k, k_ref), (v, v_ref)):
        torch.testing.assert_close(out.view(torch.uint8) if kv_dtype else out,
                                   ref.view(torch.uint8) if kv_dtype else ref,
                                   equal_nan=True, atol=0, rtol=0)
    assert k.float().isfinite().sum() == (slots >= 0).sum() * num_heads * head_dim
    assert v.float().isfinite().sum() == (slots >= 0).sum() * num_heads * head_dim


def _check_copy(dtype: torch.dtype, num_layers: int, num_blocks: int, block_size: int,
                num_heads: int, head_dim: int, num_pairs: int) -> None:
    gen = _gen("copy", dtype, num_blocks, block_size)
    pool = _randn(gen, 2, num_layers, num_blocks, block_size, num_heads, head_dim).to(dtype)
    blocks = torch.randperm(num_blocks, generator=gen)[: 2 * num_pairs]
    mapping = blocks.view(2, num_pairs).t().contiguous().to(DEVICE)  # disjoint src and dst
    expected = pool.clone()
    reference.copy_blocks(list(expected.flatten(0, 1)), mapping)
    triton_ops.copy_blocks(list(pool.flatten(0, 1)), mapping)
    assert torch.equal(pool.view(torch.uint8), expected.view(torch.uint8))



@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("num_heads,head_dim,block_size", [(2, 64, 16), (3, 128, 32)])
def test_store_kvcache(dtype: torch.dtype, num_heads: int, head_dim: int,
                       block_size: int) -> None:
    _check_store(dtype, 2 * block_size + 3, num_heads, head_dim, block_size, 4)


# fp8 KV: both formats with every GQA ratio, the query dtype and shape alternating
FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]
FP8_CASES = [
    pytest.param(kv.values[0], DTYPES[(i + j) % 3], group, *SHAPES[j % 2],
                 id=f"{kv.id}-gqa{group}")
    for i, kv in enumerate(FP8) for j, group in enumerate([1, 3, 8])]


@pytest.mark.parametrize("kv_dtype,dtype,group,head_dim,block_size", FP8_CASES)
def test_decode_fp8(kv_dtype: torch.dtype, dtype: torch.dtype, group: int, head_dim: int,
                    block_size: int) -> None:
    bs = block_size
    _check_attention(dtype, group, 2, head_dim, bs, [(1, n) for n in [1, bs, bs + 1, 3 * bs - 1]],
                     [None, 3], kv_dtype)


@pytest.mark.parametrize("kv_dtype,dtype,group,head_dim,block_size", FP8_CASES)
def test_prefill_fp8(kv_dtype: torch.dtype, dtype: torch.dtype, group: int, head_dim: int,
                     block_size: int) -> None:
    bs = block_size
    _check_attention(dtype, group, 2 if group < 8 else 1, head_dim, bs,
                     [(bs, bs), (1, bs + 1), (bs + 3, 2 * bs + 3)], [None], kv_dtype)


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_store_kvcache_fp8(kv_dtype: torch.dtype, dtype: torch.dtype) -> None:
    _check_store(dtype, 2 * 16 + 3, 3, 64, 16, 4, kv_dtype)


@pytest.mark.parametrize("dtype", FP8)
def test_copy_blocks_fp8(dtype: torch.dtype) -> None:
    _check_copy(dtype, 2, 8, 16, 2, 64, 3)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_copy_blocks(dtype: torch.dtype, block_size: int) -> None:
    _check_copy(dtype, 2, 8, block_size, 2, 64, 3)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPE_PARAMS + FP8)
def test_cuda_sizes(dtype: torch.dtype) -> None:
    """Engine-sized shapes, compiled."""
    _check_store(torch.bfloat16 if dtype.itemsize == 1 else dtype, 4096, 8, 128, 16, 512,
                 dtype if dtype.itemsize == 1 else None)
    _check_copy(dtype, 8, 256, 16, 8, 128, 64)
    if dtype.itemsize == 1:  # fp8 attention at engine sizes, bf16 queries
        lens = [1, 16, 17, 1000, 4096, 20001]
        _check_attention(torch.bfloat16, 4, 8, 128, 16, [(1, n) for n in lens], [None, 8],
                         dtype)
        _check_attention(torch.bfloat16, 4, 8, 128, 16, [(1024, 1024), (333, 2000)], [None],
                         dtype)
