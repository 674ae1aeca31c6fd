"""bfloat16 on the CPU: weights and KV pools in bfloat16, activations in float32
(``engine.loader.activation_dtype``). The C kernels' bfloat16 build (``kernels/cpu_bf16.c``)
gives, bit for bit, what the float32 build gives on the widened values, or, where the CPU
pairs bfloat16s (AVX-512 BF16), that of the rounded inputs within bfloat16's precision; the
store rounds as torch does; the engine's greedy tokens are near-argmax tokens of transformers'
float32 model on the same bfloat16-rounded weights, each logprob close to its."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams, cpu_linear
from kernels import cpu_gemv, cpu_native, cpu_ops, reference

pytestmark = pytest.mark.skipif(cpu_native.function("pagedq_decode_bf16") is None,
                                reason="the C kernels do not build here")


def _pools(gen: torch.Generator, blocks: int, block_size: int, kv_heads: int,
           head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (blocks, block_size, kv_heads, head_dim)
    return (torch.randn(shape, generator=gen).bfloat16(),
            torch.randn(shape, generator=gen).bfloat16())


@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (3, 64), (8, 128), (2, 72)])
def test_attention_over_bf16_pools(group: int, head_dim: int) -> None:
    """Decode (rows past the attention's 256-key chunk, a lone row split over KV heads) and a
    ragged prefill over cached prefixes, float32 and bfloat16 queries (a bfloat16 model's):
    the float32 build's bits on the widened pools, or, where the CPU pairs bfloat16s (AVX-512
    BF16, head_dim a multiple of 32: the queries and numerators rounded), within 1e-2 of them.
    Either way each prefill token has the bits of its decode alone."""
    gen = torch.Generator().manual_seed(group * 100 + head_dim)
    block_size, kv_heads = 16, 2
    k, v = _pools(gen, 80, block_size, kv_heads, head_dim)
    tables = torch.randperm(80, generator=gen)[:68].view(4, 17).int()
    lens = torch.tensor([1, 17, 256, 257], dtype=torch.int32)
    q = torch.randn(4, kv_heads * group, head_dim, generator=gen)
    scale = head_dim**-0.5

    def check(got: torch.Tensor, want: torch.Tensor) -> None:
        if cpu_gemv.paired() and head_dim % 32 == 0:
            torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
        else:
            assert torch.equal(got, want)

    got = cpu_ops.paged_attention_decode(q, k, v, tables, lens, scale)
    assert got.dtype == torch.float32
    check(got, cpu_ops.paged_attention_decode(q, k.float(), v.float(), tables, lens, scale))
    alone = cpu_ops.paged_attention_decode(q[3:], k, v, tables[3:], lens[3:], scale)
    assert torch.equal(alone[0], got[3])
    half = cpu_ops.paged_attention_decode(q.bfloat16(), k, v, tables, lens, scale)
    assert half.dtype == torch.bfloat16
    check(half.float(), cpu_ops.paged_attention_decode(
        q.bfloat16().float(), k.float(), v.float(), tables, lens, scale).bfloat16().float())
    queries, contexts = [1, 5, 40, 3], [1, 20, 200, 90]
    cu = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.tensor(contexts, dtype=torch.int32)
    qp = torch.randn(sum(queries), kv_heads * group, head_dim, generator=gen)
    got = cpu_ops.paged_attention_prefill(qp, k, v, cu, tables, ctx, scale)
    check(got, cpu_ops.paged_attention_prefill(qp, k.float(), v.float(), cu, tables, ctx,
                                               scale))
    torch.testing.assert_close(got, reference.paged_attention_prefill(
        qp, k.float(), v.float(), cu, tables, ctx, scale), atol=1e-2, rtol=1e-2)
    for seq, (context, count) in enumerate(zip(contexts, queries, strict=True)):
        for j in range(count):
            row = int(cu[seq]) + j
            one = cpu_ops.paged_attention_decode(
                qp[row:row + 1], k, v, tables[seq:seq + 1],
                torch.tensor([context - count + j + 1], dtype=torch.int32), scale)
            assert torch.equal(one[0], got[row]), (seq, j)


def test_store_into_bf16_pools_rounds_as_torch() -> None:
    """Ties to even both ways, the largest floats that round to inf, infinities, NaNs of both
    signs and payloads, subnormals; strided rows; -1 slots skipped."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(9, 5, 16, generator=gen)
    special = torch.tensor([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7F7F8000, 0x7F800000,
                            0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x00000001,
                            0x807FFFFF, 0x3F80FFFF, 0xBF808001, 0x80000000, 0x3F7F8000,
                            0x00008000], dtype=torch.int64).to(torch.int32).view(torch.float32)
    qkv[:, 1] = special
    key, value = qkv[:, 1:3], qkv[:, 3:5]
    slots = torch.randperm(6 * 8, generator=gen)[:9]
    slots[4] = -1
    pools = [torch.zeros(6, 8, 2, 16, dtype=torch.bfloat16) for _ in range(4)]
    cpu_ops.store_kvcache(key, value, pools[0], pools[1], slots)
    reference.store_kvcache(key, value, pools[2], pools[3], slots)
    for got, want in ((pools[0], pools[2]), (pools[1], pools[3])):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 130])
@pytest.mark.parametrize(("in_features", "out_features"), [(100, 33), (576, 1536)])
def test_gemv_over_bf16_panels(rows: int, in_features: int,
                                                           out_features: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    got = cpu_gemv.gemv(x, cpu_gemv.pack_panels(weight), bias, out_features, 64)
    if cpu_gemv.paired():  # AVX-512 BF16: the inputs rounded to bfloat16 first, then paired
        rounded = x.bfloat16().float()
        assert torch.equal(got, cpu_gemv.gemv(rounded, cpu_gemv.pack_panels(weight), bias,
                                              out_features, 64))
        torch.testing.assert_close(got, rounded @ weight.float().T + bias, atol=1e-4,
                                   rtol=1e-4)
        return
    want = cpu_gemv.gemv(x, cpu_gemv.pack_panels(weight.float()), bias, out_features, 64)
    assert torch.equal(got, want)
    torch.testing.assert_close(got, x @ weight.float().T + bias, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("in_features", "out_features"), [(100, 33), (75, 112), (100, 160)])
def test_gemv_over_bf16_panels_gives_a_row_its_bits_in_any_batch(in_features: int,
                                                                 out_features: int) -> None:
    """A row's outputs have the same bits in a batch of any size: where the CPU pairs bfloat16s,
    its tiles of 8 rows by 2 panels up to 8 rows and of 6 by 4 past them (a layer's last group
    of 1 to 3 panels, an odd input count; steps that AMX's tiles do not take, which would sum
    otherwise); elsewhere the float32 build's sums of the widened weights."""
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    x = torch.randn(40, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    panels = cpu_gemv.pack_panels(weight)
    full = cpu_gemv.gemv(x, panels, bias, out_features, 64)
    for rows in (1, 2, 7, 8, 9, 13, 19, 25, 39):
        assert torch.equal(cpu_gemv.gemv(x[40 - rows:], panels, bias, out_features, 64),
                           full[40 - rows:]), rows
    inputs = x.bfloat16().float() if cpu_gemv.paired() else x
    torch.testing.assert_close(full, inputs @ weight.float().T + bias, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not cpu_gemv.tiles(512, torch.bfloat16), reason="no AMX tiles on this CPU")
@pytest.mark.parametrize(("in_features", "out_features"), [(512, 1024), (576, 33), (1536, 576)])
def test_gemv_past_a_few_rows_takes_amx_tiles_the_same_in_any_batch(
        in_features: int, out_features: int) -> None:
    """Past 8 rows, where the CPU has AMX and the paired steps fill whole tiles: the tiles'
    products within bfloat16's rounding of the reference, and a row's bits the same in a batch
    of 9 as of 300 (rows padded to 16, outputs to 16, bias added after)."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen)
    assert cpu_gemv.tiles(in_features, torch.bfloat16)
    panels = cpu_gemv.pack_panels(weight)
    x = torch.randn(300, in_features, generator=gen)
    full = cpu_gemv.gemv(x, panels, bias, out_features, in_features)
    torch.testing.assert_close(full, x.bfloat16().float() @ weight.float().T + bias,
                               atol=1e-3, rtol=1e-3)
    for rows in (9, 16, 17, 100, 299):
        assert torch.equal(cpu_gemv.gemv(x[300 - rows:], panels, bias, out_features,
                                         in_features), full[300 - rows:]), rows
    assert not cpu_gemv.tiles(100, torch.bfloat16)  # 50 steps: the pairs' path at any rows


def test_engine_holds_bf16_weights_and_pool_and_decodes_natively(
        tiny_llama3: Path, make_llm: Callable[..., LLM]) -> None:
    """The loaded model: float32 activations and norms (bfloat16 values), every product's
    weights in bfloat16, the pool in bfloat16; the native decode step binds and streams what
    the modules stream."""
    llm = make_llm(tiny_llama3, dtype="bfloat16")
    runner = llm.engine.model_runner
    model = runner.model
    assert model.model.embed_tokens.weight.dtype == torch.float32
    norm = model.model.norm.weight
    assert torch.equal(norm, norm.bfloat16().float())
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.panels.dtype == torch.bfloat16
    assert runner.kv_cache.dtype == torch.bfloat16
    assert runner.cpu_decode is not None
    prompts = [[5 + i] * (3 + 11 * i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    native = llm.generate(prompts, params, use_tqdm=False)
    runner.cpu_decode = None
    modules = llm.generate(prompts, params, use_tqdm=False)
    assert ([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in native]
            == [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in modules])


def test_smollm2_greedy_tokens_are_transformers_near_argmax(
        smollm2: Path, make_llm: Callable[..., LLM]) -> None:
    """SmolLM2 on text, 24 greedy tokens from 3 prompts: transformers' float32 model on the
    bfloat16-rounded weights, teacher-forced on pagedq's tokens, gives each a logprob within
    0.1 of pagedq's (0.023 at most on an AMD EPYC Zen 4) and within 0.05 of its own best (0 on
    it: every token its argmax). The differences: the KV's rounding to bfloat16, and the
    prefill products' inputs'."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    texts = ["The history of computing is long. Early machines filled whole rooms, and",
             "def fibonacci(n):\n    ", "Paris is the capital of"]
    prompts = [tokenizer.encode(t) for t in texts]
    llm = make_llm(smollm2, dtype="bfloat16")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                logprobs=1), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.bfloat16).float().eval()
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits.float(), -1)
        for i, token in enumerate(tokens):
            ours = out.outputs[0].logprobs[i][token]
            ours = getattr(ours, "logprob", ours)
            assert abs(ours - want[i, token].item()) < 0.1, (i, ours, want[i, token].item())
            assert want[i].max().item() - want[i, token].item() < 0.05, i


def test_without_onednn_bf16_many_rows_take_float32_products_of_the_rounded_weights(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN has no bfloat16 product (AVX2), rows past ``GEMV_ROWS`` get oneDNN's
    float32 product of the bfloat16-rounded weights, bit for bit; fewer rows still the
    bfloat16 panels."""
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(96, 40)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=gen))
    monkeypatch.setattr(cpu_linear, "ONEDNN_BF16", False)
    layer = cpu_linear.PackedLinear(linear, torch.bfloat16)
    assert layer.packed.dtype == torch.float32 and layer.panels is not None
    assert layer.panels.dtype == torch.bfloat16
    rounded = torch.nn.Linear(96, 40)
    with torch.no_grad():
        rounded.weight.copy_(linear.weight.bfloat16().float())
        rounded.bias.copy_(linear.bias)
    x = torch.randn(cpu_linear.GEMV_ROWS + 9, 96, generator=gen)
    assert torch.equal(layer(x), cpu_linear.PackedLinear(rounded)(x))
    few = x[:5].bfloat16().float() if cpu_gemv.paired() else x[:5]  # paired: inputs rounded
    torch.testing.assert_close(layer(x[:5]), rounded(few), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not cpu_linear.ONEDNN_BF16, reason="oneDNN has no bfloat16 product here")
def test_rows_past_gemv_rows_take_onednn_padded_to_buckets_with_its_bits() -> None:
    """Up to ``gemv_rows`` rows (8 with AMX where cpu_gemv has no tiles, oneDNN's leading
    past them; else ``GEMV_ROWS``) through the panels; past them oneDNN's bfloat16 product
    with the rows padded to their bucket, which gives each row the bits of oneDNN's product
    of the rows as they are."""
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(576, 1536)
    layer = cpu_linear.PackedLinear(linear, torch.bfloat16)
    assert layer.gemv_rows == (
        cpu_linear.GEMV_ROWS_AMX if cpu_linear.AMX and not cpu_gemv.tiles(576, torch.bfloat16)
        else cpu_linear.GEMV_ROWS)
    x = torch.randn(300, 576, generator=gen)
    bias = linear.bias.detach()
    for rows in (1, layer.gemv_rows, layer.gemv_rows + 1, 17, 100, 257, 299):
        got = layer(x[:rows])
        if rows <= layer.gemv_rows:
            want = cpu_gemv.gemv(x[:rows], layer.panels, bias, 1536, layer.block)
        else:
            assert cpu_linear._row_bucket(rows) % 16 == 0 and cpu_linear._row_bucket(rows) >= rows
            want = torch.ops.mkldnn._linear_pointwise(x[:rows].bfloat16(), layer.packed, None,
                                                      "none", [], "").float() + bias
        assert torch.equal(got, want), rows
