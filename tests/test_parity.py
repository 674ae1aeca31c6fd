"""Greedy output equals transformers' greedy output, token for token, whatever the batch:
one at a time, all together, under preemption, with chunked prefill, with prefix-cache hits."""

import random
from pathlib import Path

import pytest

from engine import SamplingParams
from tests.conftest import hf_greedy

LENGTHS = [1, 3, 16, 17, 45, 128, 211, 300]


def _prompts(model: Path, vocab: int) -> list[list[int]]:
    rng = random.Random(str(model))
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]


def _smollm2_prompts(tokenizer) -> list[list[int]]:
    text = (
        "The history of computing is long. Early machines filled whole rooms, and programmers "
        "fed them punched cards. Later, transistors made computers small and cheap, and the "
        "personal computer arrived in homes and offices. Networks then linked those machines, "
        "and the web grew on top of the internet. Today phones carry more power than the "
        "mainframes of the past, and large language models write text, code and poems. ") * 8
    ids = tokenizer.encode(text)
    return [ids[i:i + n] for i, n in zip(range(0, 80, 10), LENGTHS, strict=True)]


MODELS = ["tiny_llama", "tiny_qwen2", "tiny_llama3", "tiny_mistral", "smollm2"]


@pytest.fixture(scope="module", params=MODELS)
def case(request: pytest.FixtureRequest) -> tuple[Path, list[list[int]], list[list[int]], int]:
    from transformers import AutoTokenizer

    model = request.getfixturevalue(request.param)
    tokenizer = AutoTokenizer.from_pretrained(model)
    max_new = 16 if request.param == "smollm2" else 24
    prompts = (_smollm2_prompts(tokenizer) if request.param == "smollm2"
               else _prompts(model, len(tokenizer)))
    expected = [hf_greedy(model, p, max_new) for p in prompts]
    return model, prompts, expected, max_new


def _greedy(max_new: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_new)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_one_at_a_time(case, make_llm) -> None:
    model, prompts, expected, max_new = case
    llm = make_llm(model)
    got = [_ids(llm.generate([p], _greedy(max_new), use_tqdm=False))[0] for p in prompts]
    assert got == expected


def test_all_together(case, make_llm) -> None:
    model, prompts, expected, max_new = case
    llm = make_llm(model)
    assert _ids(llm.generate(prompts, _greedy(max_new), use_tqdm=False)) == expected


def test_preemption(case, make_llm) -> None:
    model, prompts, expected, max_new = case
    # 24 blocks of 16 hold the longest sequence (21 blocks) but not the batch; a small token
    # budget admits many prompts by their first chunks, which then outgrow the pool.
    llm = make_llm(model, num_kv_blocks=24, max_num_batched_tokens=64,
                   enable_prefix_caching=False)
    assert _ids(llm.generate(prompts, _greedy(max_new), use_tqdm=False)) == expected
    assert llm.stats()["preemptions"] > 0


def test_chunked_prefill(case, make_llm) -> None:
    model, prompts, expected, max_new = case
    llm = make_llm(model, max_num_batched_tokens=40)  # the 300-token prompt takes 8 chunks
    assert _ids(llm.generate(prompts, _greedy(max_new), use_tqdm=False)) == expected


def test_prefix_cache_hits(case, make_llm) -> None:
    model, prompts, _, max_new = case
    system = prompts[-1][:100]  # a shared "system prompt" of 6 full blocks and a bit
    shared = [system + p[:20] for p in prompts]
    expected = [hf_greedy(model, p, max_new) for p in shared]
    llm = make_llm(model)
    assert _ids(llm.generate(shared[:1], _greedy(max_new), use_tqdm=False)) == expected[:1]
    assert llm.stats()["prefix_cache_hits"] == 0
    assert _ids(llm.generate(shared, _greedy(max_new), use_tqdm=False)) == expected
    # every request after the first hits the 6 full blocks of the system prompt
    assert llm.stats()["prefix_cache_hits"] >= 6 * 16 * len(shared)
