"""fp8 KV cache in the engine: the CPU decode kernel against the reference, capacity and
preemption, scales (checkpoint, first prefill, 1.0) and centred keys, bad values, a NaN-filled
pool, and sharing, copy-on-write, preemption and beams on an fp8 pool."""

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save_file

import kernels
from engine import LLM, EngineConfig, SamplingParams
from engine.kv_cache import kv_cache_torch_dtype
from kernels import cpu_fp8, reference
from tests.conftest import hf_greedy
from worker.config import Settings, parse_args

FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]
NAN = float("nan")


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("group", [1, 3, 8])
def test_cpu_decode_matches_reference(kv_dtype: torch.dtype, group: int) -> None:
    gen = torch.Generator().manual_seed(group)
    block_size, num_kv_heads, head_dim = 16, 2, 64
    lens = [1, block_size, block_size + 1, 2 * block_size - 1, 70]
    width = -(-max(lens) // block_size)
    tables = torch.randperm(len(lens) * width, generator=gen).view(len(lens), width).int()
    shape = (len(lens) * width, block_size, num_kv_heads, head_dim)
    k, v = (torch.full(shape, NAN).to(kv_dtype) for _ in range(2))  # unwritten: NaN bytes
    scales = {"k_scale": torch.tensor(0.01), "v_scale": torch.tensor(0.004)}
    for row, n in enumerate(lens):
        slots = tables[row, torch.arange(n) // block_size].long() * block_size + (
            torch.arange(n) % block_size)
        kv = torch.randn(2, n, num_kv_heads, head_dim, generator=gen) * 2  # tails saturate
        reference.store_kvcache(kv[0], kv[1], k, v, slots, **scales)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen)
    ctx = torch.tensor(lens, dtype=torch.int32)
    assert kernels._resolve("paged_attention_decode", q.device, "cpu", fp8=True) is (
        cpu_fp8.paged_attention_decode)
    out = kernels.paged_attention_decode(q, k, v, tables, ctx, 0.125, backend="cpu", **scales)
    expected = reference.paged_attention_decode(q, k, v, tables, ctx, 0.125, **scales)
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", FP8)
def test_cpu_widening_is_exact_for_every_finite_byte(kv_dtype: torch.dtype) -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(kv_dtype)
    values = codes.float()
    finite = values.isfinite()
    assert finite.sum() >= 248 and torch.equal(cpu_fp8.widen(codes)[finite], values[finite])


def test_capacity_and_no_preemption(tiny_llama: Path,
                                    make_llm: Callable[..., LLM]) -> None:
    """Same budget: 4x fp32's blocks (less one for rounding), and a workload that preempts on
    the fp32 pool runs without preemption on the fp8 one."""
    prompts = [[3 + i] * 20 for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    probe = make_llm(tiny_llama, num_kv_blocks=1)
    per_token = probe.stats()["kv_bytes_per_token"]
    budget = 16 * 16 * per_token / 2**30  # 16 fp32 blocks of 16 tokens; the workload needs 32
    full = make_llm(tiny_llama, kv_cache_memory_gib=budget)
    fp8 = make_llm(tiny_llama, kv_cache_memory_gib=budget, kv_cache_dtype="fp8")
    assert (full.stats()["kv_cache_dtype"], fp8.stats()["kv_cache_dtype"]) == ("auto", "fp8")
    assert fp8.stats()["kv_bytes_per_token"] * 4 == per_token
    assert fp8.stats()["kv_blocks_total"] >= 3.9 * full.stats()["kv_blocks_total"] == 3.9 * 16
    for llm in (full, fp8):
        llm.generate(prompts, params, use_tqdm=False)
    assert full.stats()["preemptions"] > 0 and fp8.stats()["preemptions"] == 0


def test_bad_values_fail_at_construction(tiny_llama: Path) -> None:
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp16'"):
        kv_cache_torch_dtype("fp16", torch.float32, torch.device("cpu"))
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"compute capability 8\.9 .* this one is 8\.0"):
        kv_cache_torch_dtype("fp8", torch.bfloat16, cuda, capability=(8, 0))
    with pytest.raises(ValueError, match=r"fp8_e5m2.*capability 8\.0 .* this one is 7\.5"):
        kv_cache_torch_dtype("fp8_e5m2", torch.bfloat16, cuda, capability=(7, 5))
    assert kv_cache_torch_dtype("fp8", torch.bfloat16, cuda, (9, 0)) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="supported on cpu and cuda, not meta"):
        LLM(str(tiny_llama), device="meta", dtype="float32", kv_cache_dtype="fp8")


def test_worker_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDQ_KV_CACHE_DTYPE", "fp8")
    assert Settings().engine_config().kv_cache_dtype == "fp8"
    assert parse_args(["--kv-cache-dtype", "fp8_e5m2"]).engine_config().kv_cache_dtype == (
        "fp8_e5m2")
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        parse_args(["--kv-cache-dtype", "fp4"])


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_nan_filled_pool_keeps_parity(tiny_llama: Path, make_llm: Callable[..., LLM],
                                      monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """The pool is torch.empty: whatever its bytes, no kernel may read an unwritten slot. A
    pool of NaN still gives transformers' greedy tokens (ragged decode rows pad their block
    tables with block 0, and partly filled blocks have NaN tails)."""
    monkeypatch.setattr(kernels, "default_backend", lambda device: backend)
    prompts = [list(range(3, 3 + n)) for n in (5, 21, 40)]
    llm = make_llm(tiny_llama, max_num_batched_tokens=32, num_kv_blocks=64)
    llm.engine.model_runner.kv_cache.fill_(NAN)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(tiny_llama, p, 12)
                                                       for p in prompts]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_pool_of_nan_bytes_changes_nothing(tiny_llama: Path, make_llm: Callable[..., LLM],
                                               kv_cache_dtype: str) -> None:
    prompts = [list(range(3, 3 + n)) for n in (5, 21, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    runs = []
    for fill in (0.0, NAN):
        llm = make_llm(tiny_llama, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64)
        llm.engine.model_runner.kv_cache.view(torch.uint8).copy_(
            torch.tensor(fill).to(llm.engine.model_runner.kv_cache.dtype).view(torch.uint8))
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs)
                     for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]


def _with_scales(tiny_llama: Path, tmp_path: Path, layers: int) -> Path:
    """A copy of the checkpoint with per-layer K/V scales, named as llm-compressor names them."""
    path = tmp_path / "scaled"
    shutil.copytree(tiny_llama, path)
    scales = {f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor([0.01 * (i + 1) + d])
              for i in range(layers) for kind, d in (("k", 0.0), ("v", 0.005))}
    save_file(scales, str(path / "kv_scales.safetensors"))
    return path


def test_checkpoint_scales(tiny_llama: Path, tmp_path: Path,
                           make_llm: Callable[..., LLM]) -> None:
    layers = len(make_llm(tiny_llama, num_kv_blocks=4).engine.model_runner.model.model.layers)
    path = _with_scales(tiny_llama, tmp_path, layers)
    expected = torch.tensor([[0.01 * (i + 1) for i in range(layers)],
                             [0.01 * (i + 1) + 0.005 for i in range(layers)]])
    llm = make_llm(path, kv_cache_dtype="fp8", num_kv_blocks=16)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
    torch.testing.assert_close(llm.engine.model_runner.kv_scales, expected)  # not recomputed
    auto = make_llm(path, num_kv_blocks=16)  # a full-precision pool takes no scales
    assert torch.equal(auto.engine.model_runner.kv_scales, torch.ones(2, layers))
    (path / "kv_scales.safetensors").unlink()
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(1.0)},
              str(path / "kv_scales.safetensors"))
    with pytest.raises(ValueError, match="lacks"):
        LLM(str(path), kv_cache_dtype="fp8", num_kv_blocks=16)


@pytest.mark.parametrize("calculate", [True, False])
def test_scales_from_the_first_prefill(tiny_llama: Path, make_llm: Callable[..., LLM],
                                       calculate: bool) -> None:
    """vLLM's calculate_kv_scales: the first prefill's amax lands on 200 (K) and 100 (V) in the
    pool, to e4m3's rounding; with calculate_kv_scales=False every scale stays 1.0."""
    llm = make_llm(tiny_llama, kv_cache_dtype="fp8", num_kv_blocks=8,
                   calculate_kv_scales=calculate)
    runner = llm.engine.model_runner
    runner.kv_cache.view(torch.uint8).zero_()  # so that the unwritten slots read as 0.0
    llm.generate([list(range(3, 30))], SamplingParams(max_tokens=1), use_tqdm=False)
    scales = runner.kv_scales.clone()
    if not calculate:
        assert torch.equal(scales, torch.ones_like(scales))
    attns = [layer.self_attn.attn for layer in runner.model.model.layers]
    if not calculate:
        assert all(attn.k_shift is None for attn in attns)
        return
    stored = runner.kv_cache.float().abs().amax(dim=(2, 3, 4, 5))  # the prompt's KV
    assert ((stored[0] - 200).abs() <= 8).all() and ((stored[1] - 100).abs() <= 4).all()
    # the keys went in centred: per channel their mean over the 27 tokens is e4m3's rounding
    keys = runner.kv_cache[0].float().flatten(1, 2)[:, :27]  # [layers, tokens, heads, dim]
    assert keys.mean(1).abs().amax() < 0.05 * 200
    assert all(attn.k_shift.abs().amax() > 0 for attn in attns)
    shifts = [attn.k_shift.clone() for attn in attns]
    llm.generate([list(range(40, 70))], SamplingParams(max_tokens=1), use_tqdm=False)
    assert torch.equal(runner.kv_scales, scales)  # once only
    assert all(torch.equal(a.k_shift, s) for a, s in zip(attns, shifts, strict=True))


def test_centred_keys_leave_attention_unchanged(tiny_llama: Path,
                                                make_llm: Callable[..., LLM]) -> None:
    """Keys stored less a shift m (what an fp8 pool with first-prefill scales does) give the
    same logprobs to rounding: every score of a query moves by q . m, which softmax cancels.
    Shown on a full-precision pool, where nothing else rounds, with a large random shift."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = [list(range(3, 40)), [7, 8, 9]]
    runs = []
    for shift in (False, True):
        llm = make_llm(tiny_llama, num_kv_blocks=16)
        # the native decode step binds only pools that store keys as they are (never fp8):
        # this test shifts a full-precision pool's keys by hand, so the modules run it
        llm.engine.model_runner.cpu_decode = None
        for i, layer in enumerate(llm.engine.model_runner.model.model.layers):
            attn = layer.self_attn.attn
            gen = torch.Generator().manual_seed(i)
            attn.k_shift = 3 * torch.randn(attn.num_kv_heads, attn.head_dim,
                                           generator=gen) if shift else None
        outs = [r.outputs[0] for r in llm.generate(prompts, params, use_tqdm=False)]
        runs.append(([o.token_ids for o in outs],
                     torch.tensor([[lp[t] for lp, t in zip(o.logprobs, o.token_ids, strict=True)]
                                   for o in outs])))
    assert runs[0][0] == runs[1][0]
    torch.testing.assert_close(runs[0][1], runs[1][1], atol=1e-4, rtol=0)


def test_sharing_and_preemption_on_fp8(tiny_llama: Path, make_llm: Callable[..., LLM],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """n=2 samples sharing prompt blocks (copy-on-write), prefix hits and preemption in a tight
    pool run on an fp8 pool and give the same tokens on both CPU backends."""
    prompts = [list(range(3, 23)), list(range(3, 23)) + [40, 41], [9] * 13]
    params = SamplingParams(n=2, temperature=0, max_tokens=14, ignore_eos=True)
    tokens = []
    for backend in ("cpu", "torch"):
        monkeypatch.setattr(kernels, "default_backend", lambda device, b=backend: b)
        llm = make_llm(tiny_llama, kv_cache_dtype="fp8", num_kv_blocks=12, block_size=8,
                       max_num_batched_tokens=24)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        assert stats["prefix_cache_hits"] > 0 and stats["preemptions"] > 0
        tokens.append([[o.token_ids for o in r.outputs] for r in outs])
        assert all(r[0] == r[1] for r in tokens[-1])  # greedy samples of a request agree
    assert tokens[0] == tokens[1]
