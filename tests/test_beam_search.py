"""Beam search in the engine core: batched with sampling requests, under preemption, chunked
prefill and prefix-cache hits it gives transformers' beams; beams share their blocks; abort
frees everything; bad input gets a clear error and the engine keeps serving."""

import random
from collections import Counter
from pathlib import Path

import pytest

from engine import BeamSearchParams, SamplingParams
from tests.beam_reference import assert_same_beams, hf_beams, with_eos
from tests.conftest import assert_pool_whole, hf_greedy

LENGTHS = [5, 21, 40, 70]
WIDTHS = [2, 4, 8, 4]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_eos(tiny_llama, tmp_path_factory.mktemp("beam") / "llama-eos", _prompts()[1], 2)


def _prompts() -> list[list[int]]:
    rng = random.Random("beams")
    return [[rng.randrange(4, 1000) for _ in range(n)] for n in LENGTHS]


def _params(i: int, max_tokens: int = MAX_TOKENS) -> BeamSearchParams:
    return BeamSearchParams(beam_width=WIDTHS[i], max_tokens=max_tokens,
                            length_penalty=[1.0, 0.0, 2.0, 1.0][i],
                            early_stopping=[False, True, "never", False][i])


def _run(engine, beams: dict[str, tuple[list[int], BeamSearchParams]],
         samples: dict[str, tuple[list[int], SamplingParams]],
         seen: Counter | None = None) -> dict[str, list]:
    """Everything added at once, stepped to the end: each beam request's ranked
    (tokens, cum_logprob), each sampling request's tokens per sample. ``seen`` counts the
    steps after which a group was parked (preempted) or had beams waiting for siblings."""
    for request_id, (prompt, params) in beams.items():
        engine.add_request(request_id, prompt, beam=params)
    for request_id, (prompt, params) in samples.items():
        engine.add_request(request_id, prompt, params)
    got: dict[str, list] = {}
    groups = [engine.requests[request_id].group for request_id in beams]
    while engine.has_unfinished():
        deltas = engine.step()
        for group in groups if seen is not None else []:
            seen["parked"] += group.trunk is not None and bool(group.live)
            seen["waiting"] += bool(group.ready)
        for delta in deltas:
            if delta.request_id in beams:
                assert delta.finished  # a beam search streams nothing before its result
                got[delta.request_id] = [(s.token_ids, s.cum_logprob) for s in delta.samples]
            for s in delta.samples if delta.request_id in samples else []:
                n = samples[delta.request_id][1].n
                got.setdefault(delta.request_id, [[] for _ in range(n)])[s.index] += s.token_ids
    return got


def _expected(model: Path, engine, max_tokens: int = MAX_TOKENS) -> list:
    eos = sorted(engine.eos_token_ids)
    return [hf_beams(model, p, eos, _params(i).beam_width, max_tokens, _params(i).length_penalty,
                     _params(i).early_stopping) for i, p in enumerate(_prompts())]


def _check_beams(got: dict[str, list], expected: list) -> None:
    for i, beams in enumerate(expected):
        assert_same_beams(got[f"beam-{i}"], beams, i)


def test_batched_with_sampling(model: Path, make_llm) -> None:
    llm = make_llm(model)
    seeded = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=12)
    alone = _run(llm.engine, {}, {"seeded": (_prompts()[2], seeded)})["seeded"]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    got = _run(llm.engine, {f"beam-{i}": (p, _params(i)) for i, p in enumerate(_prompts())},
               {"seeded": (_prompts()[2], seeded),
                **{f"greedy-{i}": (p, greedy) for i, p in enumerate(_prompts())}})
    _check_beams(got, _expected(model, llm.engine))
    assert got["seeded"] == alone
    for i, p in enumerate(_prompts()):
        assert got[f"greedy-{i}"] == [hf_greedy(model, p, 12)]


@pytest.mark.parametrize("kwargs", [
    {"num_kv_blocks": 28, "max_num_batched_tokens": 32, "enable_prefix_caching": False},
    {"num_kv_blocks": 24, "max_num_batched_tokens": 24},
], ids=["uncached", "cached"])
def test_preemption(model: Path, make_llm, kwargs: dict) -> None:
    """A pool for about one group at a time: groups are preempted whole, parked, and rebuilt
    from their common prefix."""
    llm = make_llm(model, **kwargs)
    seen = Counter()
    got = _run(llm.engine, {f"beam-{i}": (p, _params(i, 24)) for i, p in enumerate(_prompts())},
               {}, seen)
    _check_beams(got, _expected(model, llm.engine, 24))
    assert seen["parked"] > 0


def test_chunked_prefill_short_budget_and_prefix_cache(model: Path, make_llm) -> None:
    """A budget of 5 tokens splits the 70-token prompt into 14 chunks and every step of a
    width-8 group into two (the first beams' logits wait for the rest)."""
    llm = make_llm(model, max_num_batched_tokens=5)
    beams = {f"beam-{i}": (p, _params(i)) for i, p in enumerate(_prompts())}
    expected = _expected(model, llm.engine)
    seen = Counter()
    _check_beams(_run(llm.engine, beams, {}, seen), expected)
    assert seen["waiting"] > 0
    hits = llm.stats()["prefix_cache_hits"]
    _check_beams(_run(llm.engine, beams, {}), expected)  # the prompts are cached now
    assert llm.stats()["prefix_cache_hits"] >= hits + sum(n // 16 * 16 for n in LENGTHS)


def test_beams_share_blocks(model: Path, make_llm) -> None:
    """Width 8 on a 500-token prompt holds the prompt's 31 full blocks once (ref count 8) and
    peaks at those plus 8 beams' own 2 blocks (+1 for a copy in flight), not 8 x 33."""
    llm = make_llm(model)
    prompt = [random.Random(500).randrange(4, 1000) for _ in range(500)]
    engine = llm.engine
    engine.add_request("wide", prompt, beam=BeamSearchParams(beam_width=8, max_tokens=16,
                                                             ignore_eos=True))
    group = engine.requests["wide"].group
    shared_seen = False
    while engine.has_unfinished():
        engine.step()
        if len(group.live) == 8:
            heads = {tuple(b.block_table[:31]) for b in group.live}
            assert len(heads) == 1
            refs = {engine.block_manager.blocks[b].ref_count for b in heads.pop()}
            shared_seen = shared_seen or refs == {8}
    assert shared_seen
    assert 31 + 8 <= llm.stats()["kv_blocks_peak"] <= 31 + 8 * 2 + 1


def test_abort_mid_search_frees_everything(model: Path, make_llm) -> None:
    llm = make_llm(model, num_kv_blocks=20, max_num_batched_tokens=32)
    engine = llm.engine
    for i, p in enumerate(_prompts()):
        engine.add_request(f"beam-{i}", p, beam=_params(i))
    for _ in range(6):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    for i in range(len(LENGTHS)):
        delta = engine.abort(f"beam-{i}")
        assert delta is not None and delta.finished
    assert_pool_whole(engine)


def test_bad_input(model: Path, make_llm) -> None:
    llm = make_llm(model, max_num_seqs=4)
    prompt = _prompts()[1]
    with pytest.raises(ValueError, match="beam_width must be"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
    cases = [({"beam": BeamSearchParams(beam_width=5, max_tokens=4)}, "exceeds max_num_seqs"),
             ({"params": SamplingParams(n=2, temperature=0),
               "beam": BeamSearchParams(beam_width=2, max_tokens=4)}, "n=2"),
             ({"params": SamplingParams(temperature=0.7),
               "beam": BeamSearchParams(beam_width=2, max_tokens=4)}, "temperature=0.7"),
             ({"beam": BeamSearchParams(beam_width=2, max_tokens=5000)}, "maximum context")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.engine.add_request("bad", prompt, **kwargs)
        assert not llm.engine.requests
    out = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=4,
                                                                          max_tokens=4))
    assert len(out[0].sequences) == 4  # and it keeps serving
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.beam_search({"text": "hi"}, BeamSearchParams(beam_width=2, max_tokens=4))
