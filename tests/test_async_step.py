"""Async scheduling (engine.async_step) gives what the engine gives without it: the same deltas
per request, token for token and piece of text for piece of text, with stops found only after
the next step was launched, finishes by length held out, aborts, preemption, n samples, seeded
sampling, penalties and beam searches beside it. Run on the CPU, where the steps are not
actually concurrent but the bookkeeping (placeholders, deferred input ids, dropped tokens) is
the same as on CUDA, where it is on by default."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling_params import BeamSearchParams
from tests.conftest import assert_pool_whole

Events = dict[str, list[tuple]]
# on CUDA too (float32): there the steps do overlap, through CUDA graphs, pinned copies and a
# sampler that does not wait on the device
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


def _drive(engine, requests: list[tuple], abort_at: dict[int, str] | None = None) -> Events:
    """Adds ``(id, prompt, params[, beam])`` requests, steps to the end (aborting ``abort_at``'s
    request after that many steps) and returns each request's deltas, flattened."""
    for request_id, prompt, params, *beam in requests:
        engine.add_request(request_id, prompt, None if beam else params,
                           beam=beam[0] if beam else None)
    events: Events = {}
    steps = 0
    while engine.has_unfinished():
        for delta in engine.step():
            events.setdefault(delta.request_id, []).extend(
                (s.index, s.token_ids, s.text, s.finish_reason) for s in delta.samples)
            events[delta.request_id].append(delta.finished)
        steps += 1
        if abort_at and steps in abort_at:
            delta = engine.abort(abort_at[steps])
            if delta is not None:
                events.setdefault(delta.request_id, []).append(("abort", delta.finished))
    return events


def _both(make_llm: Callable[..., LLM], model: Path, requests: list[tuple],
          abort_at: dict[int, str] | None = None, **kwargs) -> tuple[Events, Events, int]:
    """The deltas without and with async scheduling, and how many steps were launched ahead
    (run with the step before's tokens still on the device)."""
    runs, ahead = [], 0
    for on in (False, True):
        engine = make_llm(model, async_scheduling=on, **kwargs).engine
        run = engine.model_runner.run
        counted = []

        def spy(batch, prev_tokens=None, run=run, counted=counted):  # noqa: ANN001, ANN202
            counted.append(prev_tokens is not None)
            return run(batch, prev_tokens)

        engine.model_runner.run = spy
        runs.append(_drive(engine, requests, abort_at))
        ahead = sum(counted)
        assert_pool_whole(engine)
        assert engine.inflight is None
    return runs[0], runs[1], ahead


def _prompts(n: int, start: int = 3) -> list[list[int]]:
    return [[start + (7 * i + j) % 500 for j in range(5 + 13 * i)] for i in range(n)]


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_with_late_stops(tiny_llama: Path, make_llm: Callable[..., LLM],
                                device: str) -> None:
    """Stop tokens taken from each prompt's own greedy output: found when a step is read, with
    the next one already launched; lengths too (max_tokens and the context)."""
    prompts = _prompts(6)
    probe = make_llm(tiny_llama, device=device).generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    requests = []
    for i, (prompt, out) in enumerate(zip(prompts, probe, strict=True)):
        stop = [out.outputs[0].token_ids[3 + i % 5]] if i % 3 and i < 5 else []
        requests.append((f"r{i}", prompt, SamplingParams(  # the last: up to the context
            temperature=0, max_tokens=8 + 2 * i if i < 5 else None, stop_token_ids=stop,
            ignore_eos=True)))
    sync, overlapped, ahead = _both(make_llm, tiny_llama, requests, max_model_len=100,
                                    device=device)
    assert ahead > 10
    assert overlapped == sync
    samples = {r: [e for e in events if isinstance(e, tuple)] for r, events in sync.items()}
    assert any(e[3] == "stop" for events in samples.values() for e in events)
    assert samples["r5"][-1][3] == "length"
    assert sum(len(e[1]) for e in samples["r5"]) == 100 - len(prompts[5])


@pytest.mark.parametrize("device", DEVICES)
def test_stop_strings_samples_penalties_beams(tiny_llama: Path, make_llm: Callable[..., LLM],
                                             device: str) -> None:
    """Text stops, n seeded samples forked after the prompt, a penalised request (not
    overlapped while it runs) and a beam search (nor while it is live), chunked prefills."""
    prompts = _prompts(5, start=40)
    requests = [
        ("text", prompts[0], SamplingParams(temperature=0, max_tokens=30, stop=["e", "a"])),
        ("n", prompts[1], SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=5,
                                         max_tokens=20, ignore_eos=True)),
        ("seeded", prompts[2], SamplingParams(temperature=0.7, top_k=20, seed=9,
                                              max_tokens=25, logprobs=2)),
        ("pen", prompts[3], SamplingParams(temperature=0, max_tokens=6,
                                           repetition_penalty=1.3)),
        ("beam", prompts[4], None, BeamSearchParams(beam_width=2, max_tokens=5)),
    ]
    sync, overlapped, ahead = _both(make_llm, tiny_llama, requests, max_num_batched_tokens=24,
                                    device=device)
    assert ahead > 5
    assert overlapped == sync


def test_preemption_and_aborts(tiny_llama: Path, make_llm: Callable[..., LLM]) -> None:
    """A pool too small for the batch (sequences preempted and recomputed) and aborts while a
    step is in flight."""
    requests = [(f"r{i}", p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
                for i, p in enumerate(_prompts(8))]
    sync, overlapped, ahead = _both(make_llm, tiny_llama, requests,
                                    abort_at={6: "r2", 15: "r5", 30: "r7"},
                                    num_kv_blocks=24, max_num_batched_tokens=64)
    assert ahead > 10
    assert overlapped == sync
    assert sync["r5"][-1] == ("abort", True)


@pytest.mark.parametrize("on", [False, True])
def test_between_steps(tiny_llama: Path, make_llm: Callable[..., LLM], on: bool) -> None:
    """Between two ``step`` calls every sequence holds only tokens read; a step in flight keeps
    ``has_unfinished`` true until it is read."""
    engine = make_llm(tiny_llama, async_scheduling=on).engine
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3,
                                                      ignore_eos=True))
    seq = engine.requests["a"].seqs[0]
    seen = []
    while engine.has_unfinished():
        deltas = engine.step()
        seen += [t for d in deltas for s in d.samples for t in s.token_ids]
        assert seq.output_token_ids == seen and seq.pending_row is None
    assert len(seen) == 3 and engine.stats()["tokens_generated"] == 3
