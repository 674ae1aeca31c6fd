"""pagedq's greedy tokens equal transformers' on the same quantized checkpoint, token for
token, in float32 on the CPU.

compressed-tensors (llm-compressor's GPTQ W4A16/W8A16 recipes, FP8_DYNAMIC): against
transformers loading the checkpoint itself, in .venv-quant (tests/quant_fixtures.py). AWQ
(made by AutoAWQ) and the GPTQ layout (written by the tests: tests/quant_formats.py says why):
against transformers on the float checkpoint their documented dequantization gives, which
transformers cannot compute on the CPU without gptqmodel."""

import random
from pathlib import Path

import pytest

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


# (source fixture, llm-compressor recipe, the layout pagedq computes with)
CT_CASES = [
    ("tiny_llama", "gptq-w4-g32-act", "int4pack"),  # W4A16 group, activation-ordered GPTQ
    ("tiny_qwen2", "gptq-w4-gch-asym", "int4pack"),  # channel scales, zero points, qkv bias
    ("tiny_llama", "gptq-w8-gch", "int8pack"),  # W8A16
    ("tiny_qwen2", "gptq-w8-g32-asym", "dequantize"),
    ("tiny_llama", "fp8-dynamic", "scaled_mm"),  # FP8 W8A8, per-token activation scales
    ("smollm2", "rtn-w4-g64", "int4pack"),
]


@pytest.mark.parametrize("source,recipe,layout", CT_CASES,
                         ids=[f"{s}-{r}" for s, r, _ in CT_CASES])
def test_compressed_tensors_matches_transformers(source: str, recipe: str, layout: str,
                                                 request: pytest.FixtureRequest,
                                                 make_llm) -> None:
    checkpoint = quantized(request.getfixturevalue(source), recipe)
    prompts = _prompts(1000, recipe)
    expected = hf_quantized_greedy(checkpoint, prompts, MAX_NEW)
    got, layouts = _run(make_llm, checkpoint, prompts)
    assert layouts == {layout}
    assert got == expected


# (source, bits, group, desc_act, sym, layout)
GPTQ_CASES = [
    ("tiny_llama", 4, 32, True, True, "int4pack"),  # desc_act: g_idx permuted
    ("tiny_llama128", 4, 128, False, True, "int4pack"),
    ("tiny_mistral", 4, 64, True, False, "int4pack"),
    ("tiny_qwen2", 8, -1, False, True, "int8pack"),
    ("tiny_llama", 8, 32, False, False, "dequantize"),
]


@pytest.mark.parametrize("source,bits,group,desc_act,sym,layout", GPTQ_CASES,
                         ids=[f"{c[0]}-w{c[1]}-g{c[2]}{'-act' * c[3]}{'-asym' * (not c[4])}"
                              for c in GPTQ_CASES])
def test_gptq_matches_dequantized_float(source: str, bits: int, group: int, desc_act: bool,
                                        sym: bool, layout: str, request: pytest.FixtureRequest,
                                        tmp_path: Path, make_llm) -> None:
    checkpoint, twin = write_gptq(request.getfixturevalue(source), tmp_path, bits, group,
                                  desc_act, sym)
    prompts = _prompts(1000, "gptq")
    got, layouts = _run(make_llm, checkpoint, prompts)
    assert layouts == {layout}
    assert got == [hf_greedy(twin, p, MAX_NEW) for p in prompts]


def test_autoawq_matches_dequantized_float(tiny_llama128: Path, tmp_path: Path,
                                           make_llm) -> None:
    checkpoint = quantized(tiny_llama128, "autoawq-w4-g128")
    twin = awq_float_twin(checkpoint, tmp_path / "awq-float")
    prompts = _prompts(1000, "autoawq")
    got, layouts = _run(make_llm, checkpoint, prompts)
    assert layouts == {"int4pack"}
    assert got == [hf_greedy(twin, p, MAX_NEW) for p in prompts]
