"""Greedy tokens from a bfloat16 copy of the output layer and a bound (``kernels.cpu_greedy``,
``engine.greedy_head``): the argmax of the float32 layer's logits, ties to the lowest id, on
rows built to sit at the bound's edge, and the engine's greedy streams with and without it."""

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import kernels
from engine import LLM, SamplingParams
from engine.greedy_head import PROBE_ROWS, GreedyHead
from kernels import cpu_gemv, cpu_greedy

pytestmark = pytest.mark.skipif(not cpu_greedy.available(), reason="no C kernels here")


def _layer(vocab: int, hidden: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=gen) * 0.05
    # near ties: rows a last bit or a bfloat16 step apart from row 0, and exact repeats of it
    weight[7] = weight[0]
    weight[3] = torch.nextafter(weight[0], torch.tensor(1.0))
    weight[11] = weight[0] * (1 + 2.0**-9)
    weight[5] = weight[0]
    return weight


def _reference(x: torch.Tensor, panels: torch.Tensor, vocab: int, block: int) -> torch.Tensor:
    return kernels.argmax(cpu_gemv.gemv(x, panels, None, vocab, block))


@pytest.mark.parametrize(("vocab", "hidden", "block"), [(1000, 64, 64), (4099, 576, 576),
                                                         (2050, 1100, 512)])
@pytest.mark.parametrize("layout", ["rows", "panels"])
def test_tokens_are_the_float32_argmax(vocab: int, hidden: int, block: int,
                                       layout: str) -> None:
    weight = _layer(vocab, hidden, vocab)
    panels = cpu_gemv.pack_panels(weight)
    weights = cpu_greedy.prepare(weight, weight if layout == "rows" else panels, block)
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(40, hidden, generator=gen) * 20
    x[:8] = weight[0] * 400  # row 0 and its near copies lead: ties and near ties
    x[8] = weight[11] * 400
    x[9] = 0  # every logit zero: a tie of the whole vocabulary
    tokens = cpu_greedy.tokens(x, weights)
    reference = _reference(x, panels, vocab, block)
    settled = tokens >= 0
    assert torch.equal(tokens[settled], reference[settled])
    assert tokens[9] == -1  # more candidates than MAX_CANDIDATES: left to the float32 layer
    assert settled.sum() >= 38


def test_bound_holds_where_inputs_and_weights_round_badly() -> None:
    """Inputs halfway between bfloat16 values, tiny and subnormal weights: the approximation
    is as far off as it gets, and the tokens stay the float32 argmax."""
    vocab, hidden = 512, 96
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(vocab, hidden, generator=gen)
    weight[::7] *= 1e-39  # subnormal: the bfloat16 copy holds zero
    weight[1] = weight[2] + weight[2].abs() * 2.0**-8  # a bfloat16 step apart
    panels = cpu_gemv.pack_panels(weight)
    weights = cpu_greedy.prepare(weight, panels, hidden)
    halfway = (1 + 2.0**-8) * torch.randint(1, 4, (64, hidden), generator=gen).float()
    x = torch.cat([halfway, weight[1:3] * 3, torch.full((1, hidden), 1e-39)])
    tokens = cpu_greedy.tokens(x, weights)
    reference = _reference(x, panels, vocab, hidden)
    assert torch.equal(tokens[tokens >= 0], reference[tokens >= 0])
    assert (tokens[:66] >= 0).all()


def test_non_finite_rows_are_left_to_the_layer() -> None:
    weight = _layer(300, 32, 2)
    weights = cpu_greedy.prepare(weight, weight, 32)
    x = torch.randn(4, 32)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[3] = 3e38  # logits past float's range
    tokens = cpu_greedy.tokens(x, weights)
    assert tokens[0] >= 0 and (tokens[1:] == -1).all()


def test_head_falls_back_to_the_float32_layer(tiny_llama3: Path,
                                              make_llm: Callable[..., LLM]) -> None:
    """Rows the bound cannot settle (here: every logit tied) still get the float32 argmax."""
    head = make_llm(tiny_llama3).engine.model_runner.greedy_head
    assert isinstance(head, GreedyHead)
    assert head.weights.exact.dim() == 2  # tied: the embedding's rows
    hidden = torch.randn(3, head.lm_head.in_features)
    hidden[1] = 0
    expected = kernels.argmax(head.lm_head(hidden))
    assert torch.equal(head.tokens(hidden), expected) and expected[1] == 0


def test_rows_past_max_rows_take_the_float32_layer(tiny_llama3: Path,
                                                    make_llm: Callable[..., LLM]) -> None:
    """Past ``max_rows`` the float32 layer picks the tokens (the same ones); the probe's bound
    is one of the counts it timed, none or all."""
    head = make_llm(tiny_llama3).engine.model_runner.greedy_head
    assert isinstance(head, GreedyHead)
    assert head.max_rows in (0, *PROBE_ROWS, sys.maxsize)
    hidden = torch.randn(5, head.lm_head.in_features)
    hidden[1] = 0  # every logit tied: the lowest id
    head.max_rows = 4
    assert torch.equal(head.tokens(hidden), kernels.argmax(head.lm_head(hidden)))
    assert torch.equal(head.tokens(hidden[:4]), kernels.argmax(head.lm_head(hidden[:4])))


@pytest.mark.parametrize("model", ["tiny_llama", "smollm2"])
def test_greedy_streams_equal_without_the_head(model: str, request: pytest.FixtureRequest,
                                               make_llm: Callable[..., LLM]) -> None:
    """The same greedy tokens whether the head or the float32 layer picks them, beside rows
    that need the logits (logprobs, a penalty) in the same steps."""
    llm = make_llm(request.getfixturevalue(model))
    runner = llm.engine.model_runner
    assert runner.greedy_head is not None
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 400, (n,), generator=gen).tolist() for n in (3, 17, 40, 9)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    mixed = [greedy, greedy, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                            logprobs=2),
             SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                            repetition_penalty=1.3)]
    runs = []
    bound = runner.greedy_head
    bound.max_rows = sys.maxsize  # every step's rows through the bfloat16 copy, whatever the probe
    for head in (bound, None):
        runner.greedy_head = head
        runs.append([[list(o.outputs[0].token_ids) for o in llm.generate(
            prompts, params, use_tqdm=False)] for params in (greedy, mixed)])
    assert runs[0] == runs[1]
