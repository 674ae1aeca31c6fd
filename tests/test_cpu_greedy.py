"""Greedy tokens from a low-precision copy of the output layer (bfloat16, int8) and a bound
(``kernels.cpu_greedy``, ``engine.greedy_head``): the argmax of the float32 layer's logits, ties
to the lowest id, on rows built to sit at the bound's edge, and the engine's greedy streams
with and without it."""

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


COPIES = [torch.int8, torch.bfloat16]


@pytest.mark.parametrize(("vocab", "hidden", "block"), [(1000, 64, 64), (4099, 576, 576),
                                                         (2050, 1101, 512)])
@pytest.mark.parametrize("layout", ["rows", "panels"])
@pytest.mark.parametrize("copy", COPIES)
def test_tokens_are_the_float32_argmax(vocab: int, hidden: int, block: int, layout: str,
                                       copy: torch.dtype) -> None:
    weight = _layer(vocab, hidden, vocab)
    panels = cpu_gemv.pack_panels(weight)
    weights = cpu_greedy.prepare(weight, weight if layout == "rows" else panels, block, copy)
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


@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (2, 97), (3, 576), (12, 2048)])
def test_int8_logits_are_the_rounded_product(rows: int, hidden: int) -> None:
    """``cpu_screen.c``'s logits against torch in float64: each row's inputs rounded to
    integers of at most 16,383 (fewer where int32 sums need it: 8,256 at 2,048 inputs) times
    the row's scale, by the copy's weights, within float32's rounding of the sums; and its
    ``|x - x'|`` that of those inputs, rounded up."""
    vocab = 1000  # a partial last panel
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(vocab, hidden, generator=gen) * 0.05
    weights = cpu_greedy.prepare(weight, weight, hidden)
    x = torch.randn(rows, hidden, generator=gen) * 5
    x[0, 3] = 40
    approx, rounding = cpu_greedy.approximate(x, weights)
    most = min(16383, (2**31 - 1) // (2 * 127 * ((hidden + 1) // 2)))
    tau = x.abs().amax(dim=1, keepdim=True) / most
    x_hat = (x / tau).round().clamp(-most, most).double() * tau.double()
    scales = weights.scales.double().unsqueeze(1)
    hi = (weight.double() / scales).round().clamp(-127, 127) * scales
    size = x_hat.norm(dim=1, keepdim=True) * hi.norm(dim=1)
    assert ((approx.double() - x_hat @ hi.T).abs() <= 1e-6 * size).all()
    assert rounding is not None
    distance = (x.double() - x_hat).norm(dim=1)
    assert (rounding.double() >= distance).all()
    assert (rounding.double() <= distance * (1 + 1e-5)).all()


def test_bound_holds_where_inputs_and_weights_round_badly() -> None:
    """Inputs halfway between bfloat16 values, tiny and subnormal weights: the approximation
    is as far off as it gets, and the tokens stay the float32 argmax."""
    vocab, hidden = 512, 96
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(vocab, hidden, generator=gen)
    weight[::7] *= 1e-39  # subnormal: the bfloat16 copy holds zero
    weight[1] = weight[2] + weight[2].abs() * 2.0**-8  # a bfloat16 step apart
    panels = cpu_gemv.pack_panels(weight)
    weights = cpu_greedy.prepare(weight, panels, hidden, torch.bfloat16)
    halfway = (1 + 2.0**-8) * torch.randint(1, 4, (64, hidden), generator=gen).float()
    x = torch.cat([halfway, weight[1:3] * 3, torch.full((1, hidden), 1e-39)])
    tokens = cpu_greedy.tokens(x, weights)
    reference = _reference(x, panels, vocab, hidden)
    assert torch.equal(tokens[tokens >= 0], reference[tokens >= 0])
    assert (tokens[:66] >= 0).all()


def test_int8_bound_holds_where_inputs_and_weights_round_badly() -> None:
    """The int8 copy's worst cases: inputs halfway between the row's integer steps, a row
    whose one large input leaves the rest rounded to zero, weights halfway between steps, a
    row of zeros (no scale) and subnormal rows (subnormal scales), two tokens an int8 step
    apart: the tokens stay the float32 argmax."""
    vocab, hidden = 640, 97  # an odd count: the last pair padded
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(vocab, hidden, generator=gen)
    weight[::9] *= 1e-39
    weight[4] = 0
    weight[6] = (torch.randint(-127, 127, (hidden,), generator=gen) + 0.5) / 127
    weight[6, 0] = 1.0  # its scale is 1 / 127: every other weight halfway between steps
    weight[1] = weight[2] + weight[2].abs().max() / 127  # an int8 step apart
    panels = cpu_gemv.pack_panels(weight)
    weights = cpu_greedy.prepare(weight, panels, hidden)
    halfway = torch.randint(-16000, 16000, (64, hidden), generator=gen).float() + 0.5
    halfway[:, 0] = 16383  # the row's scale 1: the others halfway
    outlier = torch.randn(4, hidden, generator=gen)
    outlier[:, 5] = 1e6
    x = torch.cat([halfway * 1e-3, outlier, weight[[1, 2, 6]] * 3,
                   torch.full((1, hidden), 1e-39)])
    tokens = cpu_greedy.tokens(x, weights)
    reference = _reference(x, panels, vocab, hidden)
    assert torch.equal(tokens[tokens >= 0], reference[tokens >= 0])
    assert (tokens[:64] >= 0).all() and (tokens[68:71] >= 0).all()


def test_int8_bound_covers_the_rounding_that_reorders_tokens() -> None:
    """Two pairs of tokens whose int8 approximations rank them the other way round: 30 beats
    40 in the approximation only through the rounding of the inputs (row 0), 10 beats 20 only
    through the rounding of the weights (row 1); the true argmax, 40 and 20, is found only
    where the bound counts each rounding."""
    vocab, hidden = 300, 64
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(vocab, hidden, generator=gen) * 0.01
    base = torch.randint(-60, 61, (hidden,), generator=gen).float()
    base[0], base[1:8] = 127, 0  # each token's scale 1 / 127: these weights exact in int8
    weight[[10, 20, 30, 40]] = base / 127
    weight[10, 1] = 60.6 / 127  # rounds up to 61 steps
    weight[20, 2], weight[20, 3] = 60.4 / 127, 0.3 / 127  # round down to 60 and 0
    weight[30, 4] = 100 / 127
    weight[40, 5], weight[40, 6], weight[40, 7] = 100 / 127, 100 / 127, -100 / 127
    x = torch.randint(-1000, 1001, (2, hidden), generator=gen).float()
    x[:, 0], x[:, 1:8] = 16383, 0  # each row's scale 1: integer inputs are exact
    x[0, 4:8] = torch.tensor([100.6, 100.4, 100.4, 100.0])  # round to 101, 100, 100, 100
    x[1, 1:4] = 1000
    panels = cpu_gemv.pack_panels(weight)
    tokens = cpu_greedy.tokens(x, cpu_greedy.prepare(weight, panels, hidden))
    approx = (x.double().round() @ (weight.double() * 127).round().T).argmax(dim=1)
    assert approx.tolist() == [30, 10]
    assert tokens.tolist() == _reference(x, panels, vocab, hidden).tolist() == [40, 20]


@pytest.mark.skipif(not cpu_gemv.tiles(576, torch.bfloat16), reason="no AMX tiles here")
def test_amx_screen_gives_the_written_logits_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The screen inside AMX's product (``cpu_greedy_tiles.c``) against the screen of the
    logits written out: the same tokens, the float32 argmax, on random rows and near ties,
    and on a layer whose logits rise along the vocabulary, so that every token is the running
    best when it comes and each thread's kept tokens fill their list, which sheds those the
    risen threshold passes over."""
    vocab, hidden = 4099, 576
    gen = torch.Generator().manual_seed(6)
    rise = torch.randn(hidden, generator=gen)
    rise /= rise.norm()
    rising = torch.randn(vocab, hidden, generator=gen) * 1e-6 + rise * torch.arange(
        vocab).unsqueeze(1) * 1e-3
    ties = _layer(vocab, hidden, 6)
    for weight, x in [
        (ties, torch.cat([torch.randn(30, hidden, generator=gen) * 20, ties[[0, 11]] * 400])),
        (rising, rise * torch.tensor([[20.0], [50.0], [200.0], [1000.0]] * 3)),
    ]:
        panels = cpu_gemv.pack_panels(weight)
        weights = cpu_greedy.prepare(weight, panels, hidden, torch.bfloat16)
        with monkeypatch.context() as patched:
            patched.setattr(cpu_greedy, "_tiles_tokens", lambda *args: False)
            written = cpu_greedy.tokens(x, weights)
        screened = cpu_greedy.tokens(x, weights)
        assert (screened >= 0).all()
        assert torch.equal(screened, written)
        assert torch.equal(screened, _reference(x, panels, vocab, hidden))
    assert vocab > 2 * cpu_greedy.SCREEN_KEPT and (screened == vocab - 1).all()


@pytest.mark.parametrize("copy", COPIES)
def test_non_finite_rows_are_left_to_the_layer(copy: torch.dtype) -> None:
    weight = _layer(300, 32, 2)
    weights = cpu_greedy.prepare(weight, weight, 32, copy)
    x = torch.randn(4, 32)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[3] = 3e38  # logits past float's range
    tokens = cpu_greedy.tokens(x, weights)
    assert tokens[0] >= 0 and (tokens[1:] == -1).all()


def _copies(llm: LLM) -> list[GreedyHead]:
    """The model's heads, one per copy, each serving every row count."""
    built = GreedyHead.build(llm.engine.model_runner.model)
    assert built is not None
    return [GreedyHead(built.lm_head, [copy]) for copy in built.copies]


def test_head_falls_back_to_the_float32_layer(tiny_llama3: Path,
                                              make_llm: Callable[..., LLM]) -> None:
    """Rows the bound cannot settle (here: every logit tied) still get the float32 argmax."""
    for head in _copies(make_llm(tiny_llama3)):
        assert head.copies[0].exact.dim() == 2  # tied: the embedding's rows
        hidden = torch.randn(3, head.lm_head.in_features)
        hidden[1] = 0
        expected = kernels.argmax(head.lm_head(hidden))
        assert torch.equal(head.tokens(hidden), expected) and expected[1] == 0


def test_routes_take_each_count_to_its_way(tiny_llama3: Path,
                                           make_llm: Callable[..., LLM]) -> None:
    """The probe's routes: counts of ``PROBE_ROWS`` ascending, the last open-ended, each way a
    kept copy or the float32 layer; rows on either side of a route's end get the float32
    argmax."""
    head = make_llm(tiny_llama3).engine.model_runner.greedy_head
    assert isinstance(head, GreedyHead)
    counts = [rows for rows, _ in head.routes]
    assert counts == sorted(counts) and counts[-1] == sys.maxsize
    assert set(counts[:-1]) <= set(PROBE_ROWS)
    assert all(way is None or any(way is copy for copy in head.copies)
               for _, way in head.routes)
    assert head.served.endswith("past")
    copy = _copies(make_llm(tiny_llama3))[0].copies[0]
    head.routes = [(4, copy), (sys.maxsize, None)]
    hidden = torch.randn(5, head.lm_head.in_features)
    hidden[1] = 0  # every logit tied: the lowest id
    assert head.served == f"{copy.name} to 4, float32 past"
    assert torch.equal(head.tokens(hidden), kernels.argmax(head.lm_head(hidden)))
    assert torch.equal(head.tokens(hidden[:4]), kernels.argmax(head.lm_head(hidden[:4])))


@pytest.mark.parametrize("model", ["tiny_llama", "smollm2"])
def test_greedy_streams_equal_without_the_head(model: str, request: pytest.FixtureRequest,
                                               make_llm: Callable[..., LLM]) -> None:
    """The same greedy tokens whether a copy or the float32 layer picks them, beside rows
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
    for head in [*_copies(llm), None]:  # every step's rows through each copy, then none
        runner.greedy_head = head
        runs.append([[list(o.outputs[0].token_ids) for o in llm.generate(
            prompts, params, use_tqdm=False)] for params in (greedy, mixed)])
    assert all(run == runs[-1] for run in runs)
