import math

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from engine.sampler import Sampler, apply_penalties
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

EOS = 2
# A crafted distribution; its sorted order is the id order.
PROBS = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.08, 0.04, 0.02, 0.01])


def seq(prompt: list[int] | None = None, output: list[int] | None = None, **params) -> Sequence:
    s = Sequence("r", prompt or [5, 6], SamplingParams(**params))
    s.token_ids += output or []
    return s


def draw_counts(logits_row: torch.Tensor, n: int = 2000, **params) -> torch.Tensor:
    """Token counts of n unseeded draws, all in one batch."""
    torch.manual_seed(0)
    seqs = [seq(**params) for _ in range(n)]
    out = Sampler({EOS})(logits_row.expand(n, -1).contiguous(), seqs)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits_row.numel())


def assert_frequencies(counts: torch.Tensor, allowed: list[int], probs: torch.Tensor) -> None:
    outside = [t for t in range(counts.numel()) if t not in allowed]
    assert counts[outside].sum() == 0, f"drew outside {allowed}: {counts.tolist()}"
    expected = probs[allowed] / probs[allowed].sum() * counts.sum()
    chi2 = (((counts[allowed] - expected) ** 2) / expected).sum().item()
    assert chi2 < 30, (chi2, counts.tolist())  # df <= 7: a true fit fails with p < 1e-4
    assert (counts[allowed] > 0).all()


@pytest.mark.parametrize(("params", "allowed"), [
    ({}, list(range(8))),
    ({"top_k": 3}, [0, 1, 2]),
    ({"top_k": -1, "top_p": 0.7}, [0, 1, 2]),  # 0.55 < 0.7 <= 0.75: smallest set reaching it
    ({"top_p": 0.2}, [0]),
    ({"min_p": 0.3}, [0, 1, 2, 3]),  # keeps p >= 0.3 * 0.30
    ({"top_k": 5, "top_p": 0.9}, [0, 1, 2, 3]),  # top-p of the top-5 mass 0.93
    ({"top_k": 6, "min_p": 0.2}, [0, 1, 2, 3, 4]),
])
def test_filters_keep_their_sets(params, allowed):
    counts = draw_counts(PROBS.log(), **params)
    assert_frequencies(counts, allowed, PROBS)


def test_temperature_reshapes_the_distribution():
    counts = draw_counts(PROBS.log(), temperature=0.5, top_k=4)
    assert_frequencies(counts, [0, 1, 2, 3], PROBS**2)


def test_top_k_with_ties_keeps_k_tokens():
    counts = draw_counts(torch.tensor([2.0, 1.0, 1.0, 1.0, 1.0, 0.0]), top_k=3)
    assert (counts > 0).sum() == 3 and counts[0] > 0


def test_ties_draw_the_same_token_whatever_the_batch():
    """A seeded top-k row draws the same token whether its batch takes the partial top-k (every
    filtered row has a top_k) or the full sort (a top-p row without one beside it): tied
    candidates come in one order."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        logits = (torch.randint(0, 6, (64,), generator=gen).float() / 7)[None]
        params = {"temperature": 1.0, "top_k": 10, "seed": trial}
        alone = Sampler({EOS})(logits, [seq(**params)]).token_ids
        beside = Sampler({EOS})(logits.expand(2, -1).contiguous(),
                                [seq(**params), seq(temperature=1.0, top_p=0.9)]).token_ids
        assert alone[0] == beside[0], trial


def test_never_draws_masked_or_zero_probability_tokens():
    logits = torch.full((64,), float("-inf"))
    logits[[3, 40]] = torch.tensor([0.0, -30.0])  # token 40: prob ~1e-13, unreachable in float32
    for params in ({}, {"top_p": 0.999}, {"min_p": 0.0, "top_k": 64}):
        counts = draw_counts(logits, n=500, **params)
        assert counts[3] == 500


@pytest.mark.parametrize(("params", "u", "want"), [
    ({}, 0.0, 1), ({}, 1.0, 4),  # unsorted rows: the first and last token with mass
    ({"top_k": 2}, 0.0, 3), ({"top_k": 2}, 1.0, 2),  # sorted rows: ends of the kept prefix
    ({"top_p": 0.8, "seed": 1}, 1.0, 2), ({"min_p": 0.5}, 1.0, 3),
])
def test_inverse_cdf_ends(monkeypatch, params, u, want):
    """u at the very ends of [0, 1] (1.0 stands for u * total rounding up to the total)."""
    monkeypatch.setattr(torch, "rand", lambda *size, generator=None: torch.full(size, u))
    logits = torch.tensor([[float("-inf"), 0.0, 1.0, 2.0, -1.0, float("-inf")]])
    assert Sampler({EOS})(logits, [seq(**params)]).token_ids == [want]


def test_greedy_is_argmax():
    logits = torch.randn(16, 1000)
    logits[3, 7] = logits[3].max()  # a tie: the lowest id wins, as torch.argmax
    out = Sampler({EOS})(logits, [seq(temperature=0) for _ in range(16)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 16
    mixed = [seq(temperature=0 if i % 2 else 1.0, top_p=0.5, seed=i) for i in range(16)]
    out = Sampler({EOS})(logits, mixed)
    assert out.token_ids[1::2] == logits[1::2].argmax(-1).tolist()


def test_seeded_row_is_reproducible_and_independent_of_the_batch():
    steps, vocab = 12, 500
    step_logits = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(1)) * 3
    params = {"seed": 7, "temperature": 0.9, "top_p": 0.95, "top_k": 50,
              "repetition_penalty": 1.2}

    def run(with_others: bool) -> list[int]:
        target = seq(**params)
        others = [seq(temperature=0), seq(temperature=1.3), seq(seed=99, min_p=0.1),
                  seq(temperature=0.7, presence_penalty=1.0, logprobs=3)] if with_others else []
        batch = others[:2] + [target] + others[2:]
        torch.manual_seed(len(batch))  # the global RNG state must not matter either
        for logits in step_logits:
            rows = torch.randn(len(batch), vocab) * 3
            rows[2 if with_others else 0] = logits
            out = Sampler({EOS})(rows, batch)
            for s, t in zip(batch, out.token_ids, strict=True):
                s.token_ids.append(t)
        return target.output_token_ids

    alone = run(False)
    assert run(False) == alone == run(True)
    assert len(set(alone)) > 1
    other_seed = seq(**{**params, "seed": 8})
    tokens = []
    for logits in step_logits:
        tokens += Sampler({EOS})(logits[None], [other_seed]).token_ids
        other_seed.token_ids.append(tokens[-1])
    assert tokens != alone


def test_repetition_penalty_matches_hf():
    logits = torch.randn(3, 50) * 4
    seqs = [seq([1, 4, 4, 9], [4, 20], repetition_penalty=1.3),
            seq([0], [], temperature=0),
            seq([7, 8], [30, 31, 30], repetition_penalty=0.8)]
    got = apply_penalties(logits, seqs)
    for i, s in enumerate(seqs):
        hf = RepetitionPenaltyLogitsProcessor(s.params.repetition_penalty)
        want = hf(torch.tensor([s.token_ids]), logits[i:i + 1].clone())[0]
        torch.testing.assert_close(got[i], want)
    assert not torch.equal(got[0], logits[0])


def test_presence_and_frequency_follow_openai():
    logits = torch.randn(1, 40)
    s = seq([3, 3, 5], [5, 9, 9, 9], presence_penalty=0.5, frequency_penalty=-0.3)
    got = apply_penalties(logits, [s])[0]
    want = logits[0].clone()
    for t in set(s.output_token_ids):  # prompt tokens are not penalised
        c = s.output_token_ids.count(t)
        want[t] -= c * -0.3 + 0.5
    torch.testing.assert_close(got, want)


def test_penalties_leave_empty_rows_alone():
    logits = torch.randn(2, 20)
    seqs = [Sequence("r", [], SamplingParams(repetition_penalty=2.0, presence_penalty=1.0)),
            seq([0, 1], [], repetition_penalty=1.0, presence_penalty=1.0, frequency_penalty=1)]
    torch.testing.assert_close(apply_penalties(logits, seqs), logits, rtol=0, atol=0)


def test_min_tokens_blocks_eos_and_stop_tokens():
    logits = torch.zeros(4, 10)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    seqs = [seq(output=[1], temperature=0, min_tokens=2, stop_token_ids=[7]),
            seq(output=[1, 1], temperature=0, min_tokens=2, stop_token_ids=[7]),
            seq(output=[], temperature=0, min_tokens=1, ignore_eos=True),
            seq(output=[], min_tokens=3, stop_token_ids=[7])]
    assert Sampler({EOS})(logits, seqs).token_ids[:3] == [0, EOS, EOS]
    counts = draw_counts(logits[0], n=300, min_tokens=3, stop_token_ids=[7])
    assert counts[EOS] == counts[7] == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_log_softmax_of_the_model(temperature):
    logits = torch.randn(3, 100) * 2
    seqs = [seq(temperature=temperature, logprobs=4, top_k=2 if temperature else 0),
            seq(temperature=temperature, logprobs=0),
            seq(temperature=temperature)]
    torch.manual_seed(0)
    out = Sampler({EOS})(logits, seqs)
    lp = torch.log_softmax(logits, -1)
    top4 = lp[0].topk(4).indices.tolist()
    assert list(out.logprobs[0])[:4] == top4 and out.token_ids[0] in top4[:2]
    assert len(out.logprobs[0]) == 4
    assert list(out.logprobs[1]) == [out.token_ids[1]]
    assert out.logprobs[2] is None
    for i in (0, 1):
        for t, v in out.logprobs[i].items():
            assert math.isclose(v, lp[i, t].item(), abs_tol=1e-5)


def test_logprobs_include_the_chosen_token():
    n = 200
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]]).expand(n, -1).contiguous()
    torch.manual_seed(0)
    out = Sampler({EOS})(logits, [seq(logprobs=1) for _ in range(n)])
    lp = torch.log_softmax(logits[0], -1)
    others = 0
    for t, d in zip(out.token_ids, out.logprobs, strict=True):
        assert list(d)[0] == 5 and set(d) == {5, t}
        assert math.isclose(d[t], lp[t].item(), abs_tol=1e-6)
        others += t != 5
    assert others > 50


def test_logprobs_are_taken_after_penalties_and_min_tokens():
    logits = torch.randn(1, 30)
    s = seq(output=[3, 3, 4], temperature=0, logprobs=30, frequency_penalty=0.7, min_tokens=5)
    out = Sampler({EOS})(logits, [s])
    processed = apply_penalties(logits, [s])[0]
    processed[EOS] = float("-inf")
    want = torch.log_softmax(processed, -1)
    assert len(out.logprobs[0]) == 30 and out.logprobs[0][EOS] == float("-inf")
    for t, v in out.logprobs[0].items():
        assert math.isclose(v, want[t].item(), abs_tol=1e-5)
