"""pagedq's greedy tokens equal transformers' on the same quantized checkpoint, token for
token, in float32 on the CPU (where pagedq dequantizes int weights at load into plain linear
layers, as transformers does: see engine/quantization/linear.py); and torch's int4/int8
kernels, in bfloat16, layer by layer against the float32 model's.

compressed-tensors (llm-compressor's GPTQ W4A16/W8A16 recipes, FP8_DYNAMIC): against
transformers loading the checkpoint itself, in .venv-quant (tests/quant_fixtures.py). AWQ
(made by AutoAWQ) and the GPTQ layout (written by the tests: tests/quant_formats.py says why):
against transformers on the float checkpoint their documented dequantization gives, which
transformers cannot compute on the CPU without gptqmodel."""

import random
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.quantization import Fp8Linear, IntQuantLinear
from engine.random_model import build_random_checkpoint
from tests.conftest import hf_greedy
from tests.quant_fixtures import hf_quantized_greedy, quantized
from tests.quant_formats import awq_float_twin, write_gptq

MAX_NEW = 16


def _prompts(vocab: int, seed: str) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 17, 40)]


def _run(make_llm, checkpoint: Path, prompts: list[list[int]]) -> tuple[list, set[str]]:
    llm = make_llm(checkpoint)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW),
                        use_tqdm=False)
    layouts = {m.layout for m in llm.engine.model_runner.model.modules()
               if isinstance(m, IntQuantLinear | Fp8Linear)}
    return [o.outputs[0].token_ids for o in outs], layouts


@pytest.fixture(scope="session")
def tiny_llama128(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """128-wide layers, so 128-wide groups fit (AWQ's and GPTQ's common group size)."""
    return build_random_checkpoint(tmp_path_factory.mktemp("tiny") / "llama128", "llama",
                                   hidden_size=128, intermediate_size=256, num_heads=4)


# (source fixture, llm-compressor recipe)
CT_CASES = [
    ("tiny_llama", "gptq-w4-g32-act"),  # W4A16 group, activation-ordered GPTQ
    ("tiny_qwen2", "gptq-w4-gch-asym"),  # channel scales, zero points, qkv bias
    ("tiny_llama", "gptq-w8-gch"),  # W8A16
    ("tiny_qwen2", "gptq-w8-g32-asym"),
    ("tiny_llama", "fp8-dynamic"),  # FP8 W8A8, per-token activation scales
    ("smollm2", "rtn-w4-g64"),
]


@pytest.mark.parametrize("source,recipe", CT_CASES, ids=[f"{s}-{r}" for s, r in CT_CASES])
def test_compressed_tensors_matches_transformers(source: str, recipe: str,
                                                 request: pytest.FixtureRequest,
                                                 make_llm) -> None:
    checkpoint = quantized(request.getfixturevalue(source), recipe)
    prompts = _prompts(1000, recipe)
    expected = hf_quantized_greedy(checkpoint, prompts, MAX_NEW)
    got, layouts = _run(make_llm, checkpoint, prompts)
    assert layouts == ({"dense"} if recipe.startswith("fp8") else set())
    assert got == expected


# (source, bits, group, desc_act, sym, checkpoint_format)
GPTQ_CASES = [
    ("tiny_llama", 4, 32, True, True, "gptq"),  # desc_act: g_idx permuted
    ("tiny_llama128", 4, 128, False, True, "gptq"),
    ("tiny_mistral", 4, 64, True, False, "gptq_v2"),  # zero points stored as they are
    ("tiny_qwen2", 8, -1, False, True, "gptq"),
    ("tiny_llama", 8, 32, False, False, "gptq"),
]
GPTQ_IDS = [f"{c[0]}-w{c[1]}-g{c[2]}{'-act' * c[3]}{'-asym' * (not c[4])}-{c[5]}"
            for c in GPTQ_CASES]


@pytest.mark.parametrize("source,bits,group,desc_act,sym,fmt", GPTQ_CASES, ids=GPTQ_IDS)
def test_gptq_matches_dequantized_float(source: str, bits: int, group: int, desc_act: bool,
                                        sym: bool, fmt: str, request: pytest.FixtureRequest,
                                        tmp_path: Path, make_llm) -> None:
    checkpoint, twin = write_gptq(request.getfixturevalue(source), tmp_path, bits, group,
                                  desc_act, sym, fmt)
    prompts = _prompts(1000, "gptq")
    got, layouts = _run(make_llm, checkpoint, prompts)
    assert layouts == set()
    assert got == [hf_greedy(twin, p, MAX_NEW) for p in prompts]




@pytest.mark.parametrize("source,bits,group,desc_act,sym,fmt,layout", [
    (*c, layout) for c, layout in zip(GPTQ_CASES, ["int4pack", "int4pack", "int4pack",
                                                  "int8pack", "dense"], strict=True)],
    ids=GPTQ_IDS)
def test_bfloat16_kernels_match_float32_layers(source: str, bits: int, group: int,
                                               desc_act: bool, sym: bool, fmt: str, layout: str,
                                               request: pytest.FixtureRequest, tmp_path: Path,
                                               make_llm) -> None:
    """Every layer of the model loaded in bfloat16 (torch's int4/int8 kernels, repacked from
    the fused checkpoint parts) computes what the float32 model's dequantized layer computes,
    within bfloat16's precision. Greedy tokens are not compared: a bfloat16 model's drift
    from float32 changes random models' continuations whatever the weights."""
    checkpoint, _ = write_gptq(request.getfixturevalue(source), tmp_path, bits, group,
                               desc_act, sym, fmt)
    fast = make_llm(checkpoint, dtype="bfloat16").engine.model_runner.model
    ref = make_llm(checkpoint).engine.model_runner.model
    layers = {name: m for name, m in fast.named_modules() if isinstance(m, IntQuantLinear)}
    assert {m.layout for m in layers.values()} == {layout} and len(layers) == 2 * 4
    for name, f in layers.items():
        r = ref.get_submodule(name)
        x = torch.randn(7, f.in_features, generator=torch.Generator().manual_seed(0))
        want = r(x)
        got = f(x.bfloat16()).float()
        assert (got - want).norm() / want.norm() < 1e-2, f


def test_autoawq_matches_dequantized_float(tiny_llama128: Path, tmp_path: Path,
                                           make_llm) -> None:
    checkpoint = quantized(tiny_llama128, "autoawq-w4-g128")
    twin = awq_float_twin(checkpoint, tmp_path / "awq-float")
    prompts = _prompts(1000, "autoawq")
    got, layouts = _run(make_llm, checkpoint, prompts)
    assert layouts == set()
    assert got == [hf_greedy(twin, p, MAX_NEW) for p in prompts]
