"""The whole engine on a quantized model (GPTQ 4-bit, activation order; float32, and bfloat16
on the CPU int4 kernel): preemption, prefix caching, n seeded samples and beam search, the pool
whole after each (make_llm);
and bad checkpoints refused at load with an error naming the tensor or setting."""

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import BeamSearchParams, SamplingParams
from engine.quantization import (
    IntQuantLinear,
    QuantizationError,
    describe,
    parse_quant_config,
)
from tests.beam_reference import assert_same_beams, hf_beams, ours
from tests.conftest import hf_greedy
from tests.quant_formats import write_gptq

MAX_NEW = 12


@pytest.fixture(scope="module")
def gptq(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_gptq(tiny_llama, tmp_path_factory.mktemp("gptq"), 4, 32, desc_act=True)


def _greedy(llm, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_preemption_and_prefix_cache(gptq, make_llm) -> None:
    checkpoint, twin = gptq
    rng = random.Random(0)
    system = [rng.randrange(3, 1000) for _ in range(40)]
    prompts = [system + [rng.randrange(3, 1000) for _ in range(n)] for n in (3, 9, 20, 31)]
    expected = [hf_greedy(twin, p, MAX_NEW) for p in prompts]
    llm = make_llm(checkpoint, num_kv_blocks=12, max_num_batched_tokens=48, block_size=8)
    assert _greedy(llm, prompts) == expected
    stats = llm.stats()
    assert stats["preemptions"] > 0
    assert stats["prefix_cache_hits"] >= 5 * 8  # later prompts reuse the system's 5 blocks
    assert stats["quantization"] == "gptq-w4-g32"


def test_seeded_samples_survive_preemption(gptq, make_llm) -> None:
    checkpoint, _ = gptq
    params = SamplingParams(n=3, temperature=1.0, max_tokens=MAX_NEW, seed=7)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 7]
    roomy = make_llm(checkpoint).generate(prompts, params, use_tqdm=False)
    tight = make_llm(checkpoint, num_kv_blocks=7, block_size=8)
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert tight.stats()["preemptions"] > 0

    def ids(outs):
        return [[s.token_ids for s in o.outputs] for o in outs]

    assert ids(squeezed) == ids(roomy)
    assert len({tuple(t) for t in ids(roomy)[0]}) > 1  # the samples differ from each other


def test_beams_under_preemption(gptq, make_llm) -> None:
    """Beam search on the quantized checkpoint equals transformers' on its dequantized twin,
    with a pool small enough that beam groups are preempted and recomputed."""
    checkpoint, twin = gptq
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (13, 22)]
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_NEW, ignore_eos=True)
    llm = make_llm(checkpoint, num_kv_blocks=22, block_size=4)
    outs = llm.beam_search(prompts, params)
    assert llm.stats()["preemptions"] > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert_same_beams(ours(out, prompt), hf_beams(twin, prompt, [], 4, MAX_NEW, 1.0, False),
                          prompt)


def test_int4_kernel_under_preemption(gptq, make_llm) -> None:
    """bfloat16 runs torch's int4 kernel on every batch shape the scheduler makes, preempted
    sequences recomputed included. (Its tokens are not compared with a roomy run: bfloat16
    results depend on the batch's shape, so seeded samples drift apart whatever the weights.)"""
    llm = make_llm(gptq[0], dtype="bfloat16", num_kv_blocks=7, block_size=8)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=MAX_NEW, seed=7, ignore_eos=True)
    outs = llm.generate([[5, 6, 7, 8] * 5, [9, 10, 11] * 7], params, use_tqdm=False)
    assert llm.stats()["preemptions"] > 0
    assert [[len(s.token_ids) for s in o.outputs] for o in outs] == [[MAX_NEW] * 3] * 2
    assert {m.layout for m in llm.engine.model_runner.model.modules()
            if isinstance(m, IntQuantLinear)} == {"int4pack"}


def _edit(gptq_dir: Path, tmp_path: Path, config: dict | None = None,
          drop: str | None = None, repack: dict | None = None) -> Path:
    """A copy of the checkpoint with its quantization_config replaced, a tensor dropped, or
    tensors replaced."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in gptq_dir.iterdir():
        if f.is_file():
            (bad / f.name).write_bytes(f.read_bytes())
    if config is not None:
        cfg = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps(cfg | {"quantization_config": config}))
    state = load_file(str(bad / "model.safetensors"))
    state.pop(drop, None)
    save_file(state | (repack or {}), str(bad / "model.safetensors"))
    return bad


Q = "model.layers.0.self_attn.q_proj"
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}


@pytest.mark.parametrize("config,message", [
    ({"quant_method": "gptq", "bits": 4}, r"malformed gptq quantization_config.*group_size"),
    (GPTQ_CONFIG | {"bits": 3}, r"malformed gptq quantization_config.*bits"),
    ({"bits": 4}, "names no quant_method"),
    ({"quant_method": "squeezellm"}, r"'squeezellm' is not supported.*gptq.*awq"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"},
     r"malformed awq quantization_config.*version"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int",
                                                 "strategy": "channel"},
              "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                    "dynamic": True}}}},
     r"config_groups.g: int8 weights.*activations int"),
])
def test_bad_quantization_config(gptq, tmp_path, make_llm, config, message) -> None:
    with pytest.raises(QuantizationError, match=message):
        make_llm(_edit(gptq[0], tmp_path, config=config))


def test_missing_qzeros_named(gptq, tmp_path, make_llm) -> None:
    with pytest.raises(QuantizationError, match=f"lacks {Q}.qzeros"):
        make_llm(_edit(gptq[0], tmp_path, drop=f"{Q}.qzeros"))


def test_missing_g_idx_under_desc_act_named(gptq, tmp_path, make_llm) -> None:
    with pytest.raises(QuantizationError, match=f"lacks {Q}.g_idx"):
        make_llm(_edit(gptq[0], tmp_path, drop=f"{Q}.g_idx"))


def test_wrong_bit_width_named(gptq, tmp_path, make_llm) -> None:
    """Config says 8 bits, the tensors hold 4-bit codes: the packed shape gives it away."""
    with pytest.raises(QuantizationError, match=rf"{Q}.qweight: shape \(8, 64\), expected "
                                                r"\(16, 64\)"):
        make_llm(_edit(gptq[0], tmp_path, config=GPTQ_CONFIG | {"bits": 8}))


def test_misshapen_scales_named(gptq, tmp_path, make_llm) -> None:
    scales = torch.ones(3, 64, dtype=torch.float16)
    with pytest.raises(QuantizationError, match=rf"{Q}.scales: shape \(3, 64\)"):
        make_llm(_edit(gptq[0], tmp_path, repack={f"{Q}.scales": scales}))


def test_describe_names_the_scheme() -> None:
    assert describe(parse_quant_config(None)) == "none"
    assert describe(parse_quant_config(GPTQ_CONFIG)) == "gptq-w4-g32"
    kv_only = {"quant_method": "compressed-tensors", "config_groups": {},
               "kv_cache_scheme": {"num_bits": 8, "type": "float"}}
    assert describe(parse_quant_config(kv_only)) == "compressed-tensors"


def test_quantization_setting_must_match(gptq, tiny_llama, make_llm) -> None:
    """vLLM's --quantization: optional, and refused when the checkpoint is not so quantized."""
    assert make_llm(gptq[0], quantization="gptq").stats()["quantization"] == "gptq-w4-g32"
    with pytest.raises(QuantizationError, match="'awq' was asked for, but the checkpoint is "
                                                "'gptq'"):
        make_llm(gptq[0], quantization="awq")
    with pytest.raises(QuantizationError, match="checkpoint is not quantized"):
        make_llm(tiny_llama, quantization="compressed-tensors")


def test_worker_flag_reaches_the_engine() -> None:
    from worker.config import parse_args

    assert parse_args(["--quantization", "awq"]).engine_config().quantization == "awq"
    assert parse_args([]).engine_config().quantization is None
    with pytest.raises(ValueError, match="quantization"):
        parse_args(["--quantization", "squeezellm"])
