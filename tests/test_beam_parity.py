"""Beam search equals transformers' ``generate(num_beams=w, num_return_sequences=w,
do_sample=False, length_penalty=lp, early_stopping=...)`` in float32 on the CPU: the same
hypotheses in the same order, cum_logprob within 1e-4. Widths 1 (greedy), 2, 4, 8; length
penalties 0, 1, 2; early_stopping False, True, "never"; an eos that beams reach, and
``ignore_eos`` (transformers without an eos)."""

import random
from pathlib import Path

import pytest

from engine import BeamSearchParams
from tests.beam_reference import assert_same_beams, hf_beams, ours, with_eos

WIDTHS = [1, 2, 4, 8]
PENALTIES = [0.0, 1.0, 2.0]
STOPPING = [False, True, "never"]


def _check(llm, model: Path, prompt: list[int], max_tokens: int,
           cases: list[tuple[int, float, bool | str, bool]]) -> int:
    """Runs each (width, length_penalty, early_stopping, ignore_eos) case; returns how many
    hypotheses ended in an eos."""
    eos = sorted(llm.engine.eos_token_ids)
    stops = 0
    for width, lp, es, ignore_eos in cases:
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                  ignore_eos=ignore_eos, length_penalty=lp, early_stopping=es)
        out = llm.beam_search([prompt], params)[0]
        expected = hf_beams(model, prompt, [] if ignore_eos else eos, width, max_tokens, lp, es)
        assert_same_beams(ours(out, prompt), expected, (width, lp, es, ignore_eos))
        stops += sum(s.finish_reason == "stop" for s in out.sequences)
        ends = [s.tokens[-1] in eos for s in out.sequences]
        assert ignore_eos or ends == [s.finish_reason == "stop" for s in out.sequences]
    return stops


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_tiny(arch: str, width: int, request: pytest.FixtureRequest, make_llm,
              tmp_path_factory: pytest.TempPathFactory) -> None:
    base = request.getfixturevalue(arch)
    rng = random.Random(arch)
    prompt = [rng.randrange(4, 1000) for _ in range(21)]
    model = with_eos(base, tmp_path_factory.getbasetemp() / f"{arch}-eos", prompt, 2)
    llm = make_llm(model)
    cases = [(width, lp, es, ignore_eos) for lp in PENALTIES for es in STOPPING
             for ignore_eos in (False, True)]
    assert _check(llm, model, prompt, 10, cases) > 0  # the eos cases did reach an eos


def test_smollm2(smollm2: Path, make_llm) -> None:
    """Fewer cases on the real model (each takes seconds in transformers): every width, every
    length penalty and early_stopping once, an eos reached, ignore_eos once."""
    llm = make_llm(smollm2, num_kv_blocks=64)
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? One word."}],
        add_generation_prompt=True, tokenize=False))
    cases = [(w, 1.0, False, False) for w in WIDTHS] + [
        (4, 0.0, False, False), (4, 2.0, False, False), (4, 1.0, True, False),
        (4, 1.0, "never", False), (8, 1.0, False, True)]
    assert _check(llm, smollm2, prompt, 8, cases) > 0
