"""The native decode step (``engine.cpu_decode``, ``kernels/cpu_decode.c``): its rows have the
bits the model's modules give them, alone and in any batch, and it stands aside where a piece
has no C form. And the C row ops it shares with the modules (``kernels/cpu_rows.c``)."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.context import Context, DecodeGroup
from engine.cpu_decode import SPLIT_F32_ROWS, SPLIT_ROWS
from engine.cpu_linear import GEMV_ROWS
from engine.model_runner import ModelRunner
from kernels import cpu_decode, cpu_gemv, cpu_native, cpu_rows, reference
from tests.conftest import run_modules

BLOCK = 16


def _batch(runner: ModelRunner, lens: list[int],
           gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, Context]:
    """One decode token per sequence of these context lengths, each sequence in its own
    shuffled blocks of the pool (its table padded with block 0)."""
    width = -(-max(lens) // BLOCK)
    free = torch.randperm(runner.num_kv_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(lens):
        tables[i, :-(-n // BLOCK)] = torch.tensor([free.pop() for _ in range(-(-n // BLOCK))])
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.stack([tables[i, p // BLOCK] * BLOCK + p % BLOCK
                         for i, p in enumerate(positions.tolist())]).to(torch.int64)
    ids = torch.randint(0, 100, (len(lens),), generator=gen)
    ctx = Context(slot_mapping=slots, num_decode_tokens=len(lens))
    ctx.decode_groups = [DecodeGroup(0, len(lens), tables, torch.tensor(lens, dtype=torch.int32))]
    return ids, positions, ctx


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2", "tiny_llama3", "tiny_mistral"])
def test_native_step_has_the_modules_bits(name: str, request: pytest.FixtureRequest,
                                          make_llm: Callable[..., LLM]) -> None:
    """1 to 12 rows and 100 (past AVX2's GEMV_ROWS: split between the threads on AMD's
    cores), contexts from one token to several blocks and past the attention's chunk of 256
    keys (qwen2: the qkv bias; mistral: 8 query heads on one KV head), against the modules on
    the same rows; and each row alone against the modules' batch of ``max_rows`` + 6 (past it:
    its attention's chunks in a row, its products oneDNN's or, for float32 weights on
    AVX-512, cpu_gemv's many rows)."""
    llm = make_llm(request.getfixturevalue(name), block_size=BLOCK, num_kv_blocks=640)
    runner = llm.engine.model_runner
    assert runner.cpu_decode is not None
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        runner.kv_cache.normal_(generator=gen)
        for lens in ([1], [600, 2], [BLOCK, 256, 257], [3, 64, BLOCK + 1, 513],
                     [7 * i + 1 for i in range(12)], [1 + 37 * i % 120 for i in range(100)]):
            ids, positions, ctx = _batch(runner, lens, gen)
            before = runner.kv_cache.clone()
            want = run_modules(runner, ids, positions, ctx)
            stored = runner.kv_cache.clone()
            runner.kv_cache.copy_(before)
            assert runner.cpu_decode.can_run(ctx, len(lens))
            got = runner.cpu_decode.run(ids, positions, ctx)
            assert torch.equal(got, want), lens
            assert torch.equal(runner.kv_cache, stored), lens  # the same KV, in the same slots
        max_rows = runner.cpu_decode.max_rows
        lens = [5, 300, 12, 1, 520, 20] + [1 + i % 30 for i in range(max_rows)]
        assert len(lens) > max_rows == (SPLIT_F32_ROWS if SPLIT_ROWS else GEMV_ROWS)
        ids, positions, ctx = _batch(runner, lens, gen)
        assert not runner.cpu_decode.can_run(ctx, len(lens))
        crowd = run_modules(runner, ids, positions, ctx)
        group = ctx.decode_groups[0]
        for i in range(len(lens)):
            alone = Context(slot_mapping=ctx.slot_mapping[i:i + 1], num_decode_tokens=1)
            alone.decode_groups = [DecodeGroup(0, 1, group.block_tables[i:i + 1],
                                               group.context_lens[i:i + 1])]
            got = runner.cpu_decode.run(ids[i:i + 1], positions[i:i + 1], alone)
            assert torch.equal(got[0], crowd[i]), i


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("threads", [2, 3])
def test_rows_split_between_threads_keep_their_bits(threads: int, dtype: str, tiny_llama: Path,
                                                    make_llm: Callable[..., LLM]) -> None:
    """Each thread running the whole step on its share of the rows (``split_rows`` a thread,
    on AMD's cores 16) gives every row the bits and the KV of the step split kernel by kernel
    (which has the modules' bits: the test above), shares cut unevenly by long and short
    contexts, in both builds; and a threshold above the rows leaves them the same bits. Each
    call's ``last_shares`` says whether the split ran (declined where a share would take
    another product path than the batch: AMX's tiles against the bfloat16 pairs), and
    ``last_helped`` whether a thread done with its share took parts of another's kernels: the
    cases run again (up to 20 rounds) until some call's were, the bits checked each time."""
    llm = make_llm(tiny_llama, block_size=BLOCK, num_kv_blocks=640, dtype=dtype)
    runner = llm.engine.model_runner
    step = runner.cpu_decode.step
    gen = torch.Generator().manual_seed(threads)
    # the layers reach AMX's tiles past a few rows (the bfloat16 build, on a CPU with AMX)
    tiles = dtype == "bfloat16" and cpu_gemv.tiles(runner.model.model.norm.weight.numel(),
                                                   torch.bfloat16)
    before_threads, before_split = torch.get_num_threads(), step.split_rows
    try:
        torch.set_num_threads(threads)
        helped = 0
        # the last: one long row alone on 2 threads, usually done first, then helping the 127
        # others (past AVX2's 64 rows: the many-row product's parts as tasks)
        cases = ((1, [600, 1, 2, 3]), (1, [1 + 37 * i % 400 for i in range(40)]),
                 (1, [2, 700] + [5] * 30), (21, [1 + i for i in range(40)]),
                 (1, [2000] + [1] * 127))
        with torch.inference_mode():
            runner.kv_cache.normal_(generator=gen)
            for split, lens in [case for _ in range(20) for case in cases]:
                if helped and (split, lens) == cases[0]:
                    break
                ids, positions, ctx = _batch(runner, lens, gen)
                before = runner.kv_cache.clone()
                step.split_rows = 0
                want = runner.cpu_decode.run(ids, positions, ctx).clone()
                assert step.last_shares == 1
                stored = runner.kv_cache.clone()
                runner.kv_cache.copy_(before)
                step.split_rows = split
                got = runner.cpu_decode.run(ids, positions, ctx)
                # split where each thread has split_rows rows: 40 rows are not 21 a thread;
                # with AMX, the bfloat16 build declines a split that leaves a share at or below
                # its tiles' AMX_ROWS (8) while the batch is past them ([2, 700] + 30 rows cut
                # in 3: the long row's share is short)
                shares = threads if len(lens) >= split * threads else 1
                assert step.last_shares == shares or (tiles and step.last_shares == 1), lens
                assert torch.equal(got, want), lens
                assert torch.equal(runner.kv_cache, stored), lens
                helped += step.last_helped
        assert helped > 0, "no share's kernels were helped in 20 rounds"
    finally:
        torch.set_num_threads(before_threads)
        step.split_rows = before_split


def test_engine_streams_the_same_with_and_without_it(tiny_llama: Path,
                                                     make_llm: Callable[..., LLM]) -> None:
    """Greedy and seeded streams, logprobs included, whether decode steps run natively or
    through the modules."""
    prompts = [[5 + i] * (3 + 11 * i) for i in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, logprobs=2)]
    runs = []
    for native in (True, False):
        llm = make_llm(tiny_llama)
        if not native:
            llm.engine.model_runner.cpu_decode = None
        outs = llm.generate(prompts, [params[i % 2] for i in range(3)], use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    assert runs[0] == runs[1]


def test_it_stands_aside_for_fp8_caches(tiny_llama: Path, make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(tiny_llama, kv_cache_dtype="fp8_e4m3")
    assert llm.engine.model_runner.cpu_decode is None


def test_step_checks_its_inputs() -> None:
    norm = torch.ones(8)
    with pytest.raises(ValueError, match="lacks qkv"):
        cpu_decode.DecodeStep(dict.fromkeys(cpu_decode.DIMS, 1), [{"input_norm": norm}], norm,
                              norm[None], norm[None], 1e-5, 1.0)


@pytest.mark.parametrize("width", [64, 1000, 1536])
def test_silu_and_mul_matches_reference_and_ignores_the_batch(width: int) -> None:
    """Width 1000: torch's own SiLU gave 1-3 elements of 3,000 rows other bits between batch
    sizes (kernels.reference says why); the C one gives every row its bits in any batch."""
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(300, 2 * width, generator=gen) * 4
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # past exp's range both ways
    out = cpu_rows.silu_and_mul(x)
    torch.testing.assert_close(out, reference.silu_and_mul(x), atol=1e-5, rtol=1e-5)
    alone = torch.cat([cpu_rows.silu_and_mul(x[i:i + 1]) for i in range(300)])
    assert torch.equal(out, alone)


def test_row_ops_ignore_the_batch() -> None:
    """RMSNorm and rotary: 300 rows at once (split over the threads) against each row alone."""
    gen = torch.Generator().manual_seed(1)
    x, res = torch.randn(300, 576, generator=gen), torch.randn(300, 576, generator=gen)
    w = torch.randn(576, generator=gen)
    out, new_res = cpu_rows.rms_norm(x, w, 1e-5, res)
    for i in (0, 151, 299):
        one, one_res = cpu_rows.rms_norm(x[i:i + 1], w, 1e-5, res[i:i + 1])
        assert torch.equal(one[0], out[i]) and torch.equal(one_res[0], new_res[i])
    qkv = torch.randn(300, 15 * 64, generator=gen)
    q, k = qkv[:, :9 * 64].view(300, 9, 64), qkv[:, 9 * 64:12 * 64].view(300, 3, 64)
    cos, sin = torch.randn(400, 64, generator=gen), torch.randn(400, 64, generator=gen)
    positions = torch.randint(0, 400, (300,), generator=gen)
    out_q, out_k = cpu_rows.rotary(q, k, cos, sin, positions)
    for i in (0, 151, 299):
        one_q, one_k = cpu_rows.rotary(q[i:i + 1], k[i:i + 1], cos, sin, positions[i:i + 1])
        assert torch.equal(one_q[0], out_q[i]) and torch.equal(one_k[0], out_k[i])


@pytest.mark.parametrize("cols", [1, 31, 33, 1000, 49152])
def test_argmax_is_torchs(cols: int) -> None:
    """The greedy sampler's C argmax against torch's: random rows, ties (the first wins, in a
    vector, across lanes and in the tail), -0.0 beside 0.0, all -inf, +inf, NaNs (the first
    wins, in the vectors or the tail only), rows read with a stride."""
    assert cpu_native.function("pagedq_argmax") is not None, "the C row ops did not build"
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(40, cols + 3, generator=gen)[:, :cols]  # rows cols + 3 floats apart
    x[1] = 0.5
    x[2, :] = -float("inf")
    x[3, -1], x[4, cols // 2] = float("inf"), float("nan")
    x[5, cols - 1] = float("nan")
    x[6, :] = 0.0
    x[6, cols // 3] = -0.0
    x[7, 0], x[8, cols - 1] = float("nan"), 7.0
    x[9, cols // 2:] = 9.0
    x[10, [cols // 5, cols // 2, cols - 1]] = 11.0
    assert torch.equal(cpu_rows.argmax(x), x.argmax(dim=-1))
    assert torch.equal(cpu_rows.argmax(x[:1]), x[:1].argmax(dim=-1))
