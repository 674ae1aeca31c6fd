"""Greedy parity with transformers on a CUDA GPU (skipped without one).

fp32: token for token, as on the CPU (matmuls in true fp32: TF32 stays off, as torch's default).
bf16: exact parity is not expected (two valid roundings of the same model part ways at a close
call), so at the first divergence each side's token must be in the other's top 5.
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import kernels
from engine import LLM, SamplingParams, cuda_linear
from tests.test_parity import _prompts, _smollm2_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOP = 5


def _hf_greedy(model: Path, prompts: list[list[int]], max_new: int,
               dtype: torch.dtype) -> list[tuple[list[int], list[list[int]]]]:
    """transformers' greedy tokens and their top-``TOP`` ids per step, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).cuda().eval()
    hf.generation_config.eos_token_id = None  # as ignore_eos
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
            tops = [step[0].float().topk(TOP).indices.tolist() for step in out.logits]
            results.append((out.sequences[0, len(prompt):].tolist(), tops))
    return results


def _engine_greedy(llm: LLM, prompts: list[list[int]],
                   max_new: int) -> list[tuple[list[int], list[list[int]]]]:
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, logprobs=TOP)
    outs = llm.generate(prompts, params, use_tqdm=False)  # all together: batched decode
    return [(o.outputs[0].token_ids,
             [sorted(lp, key=lp.__getitem__, reverse=True)[:TOP] for lp in o.outputs[0].logprobs])
            for o in outs]


def _case(name: str, request: pytest.FixtureRequest) -> tuple[Path, list[list[int]], int]:
    from transformers import AutoTokenizer

    if name == "smollm2":
        from engine.default_model import default_model_path

        try:
            default_model_path()
        except FileNotFoundError as e:  # neither converted nor its GGUF package installed
            pytest.skip(str(e))
    model = request.getfixturevalue(name)
    tokenizer = AutoTokenizer.from_pretrained(model)
    if name == "smollm2":
        return model, _smollm2_prompts(tokenizer), 16
    return model, _prompts(model, len(tokenizer)), 24


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2", "smollm2"])
def test_fp32_exact(name: str, request: pytest.FixtureRequest,
                    make_llm: Callable[..., LLM]) -> None:
    model, prompts, max_new = _case(name, request)
    expected = [t for t, _ in _hf_greedy(model, prompts, max_new, torch.float32)]
    llm = make_llm(model, device="cuda", dtype="float32", num_kv_blocks=256)
    assert [t for t, _ in _engine_greedy(llm, prompts, max_new)] == expected


@pytest.mark.parametrize("route", ["paged", "fresh", "gemv"])
@pytest.mark.parametrize("name", ["tiny_llama", "smollm2"])
def test_bf16_top5(name: str, route: str, request: pytest.FixtureRequest,
                   make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    """``route`` fresh: every prompt's prefill attention through
    ``kernels.prefill_attention_fresh`` (cuDNN), whatever its length (calls counted); gemv:
    the few-row Triton GEMV on (``engine.cuda_linear``), each prompt alone so that its decode
    steps are one row."""
    model, prompts, max_new = _case(name, request)
    theirs = _hf_greedy(model, prompts, max_new, torch.bfloat16)
    calls: list[list[int]] = []
    if route == "fresh":
        fresh = kernels.prefill_attention_fresh

        def counted(*args: Any) -> torch.Tensor:
            calls.append(args[3])
            return fresh(*args)

        monkeypatch.setattr(kernels, "FRESH_PREFILL_MIN_TOKENS", 1)
        monkeypatch.setattr(kernels, "prefill_attention_fresh", counted)
    if route == "gemv":
        monkeypatch.setattr(cuda_linear, "GEMV_ROWS", 4)
    llm = make_llm(model, device="cuda", dtype="bfloat16", num_kv_blocks=256)
    if route == "gemv":
        modules = llm.engine.model_runner.model.modules()
        assert any(isinstance(m, cuda_linear.GemvLinear) for m in modules)
        ours = [out for p in prompts for out in _engine_greedy(llm, [p], max_new)]
    else:
        ours = _engine_greedy(llm, prompts, max_new)
    if route == "fresh":  # every prompt's prefill went by it (one token is a decode row)
        assert {len(p) for p in prompts if len(p) > 1} <= {n for lens in calls for n in lens}
    diverged = 0
    for i, ((a, top_a), (b, top_b)) in enumerate(zip(ours, theirs, strict=True)):
        first = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if first is None:
            continue
        diverged += 1
        assert a[first] in top_b[first] and b[first] in top_a[first], (
            f"prompt {i}, step {first}: pagedq {a[first]} (top {top_a[first]}), "
            f"transformers {b[first]} (top {top_b[first]})")
    print(f"{name} bf16: {diverged}/{len(prompts)} prompts diverge, each within the top {TOP}")
