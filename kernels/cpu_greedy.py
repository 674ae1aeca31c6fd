"""A greedy step's tokens without the float32 output layer (``cpu_greedy.c``, built by
``kernels.cpu_native``): the logits of a low-precision copy of the weights (bfloat16, or int8
with a scale per token: ``cpu_screen.c``), a bound on their distance from the float32 logits,
and the float32 logits of only the tokens within it of the best. The tokens are the float32
layer's argmax, ties to the lowest id, bit for bit: a token is passed over only where its
float32 logit is certainly below another's.

The bound. With ``w = hi + lo`` (``hi`` the copy's weights, ``lo`` the exact rest) and ``x'``
the inputs as the copy's product takes them, the float32 logit ``f`` and the approximation
``a`` of token j satisfy ``|f - x.w| <= g |x||w|`` and ``|a - x'.hi| <= g |x'||hi|`` (a sum of n
products in float32 in any order: ``g = n u / (1 - n u)``, ``u = 2^-24``, n the inputs plus 16
for the pairs' and blocks' additions; the int8 copy's sums are exact in int32, rounded only
where they become floats and are scaled), and ``x.w - x'.hi = x.lo + (x -
x').hi``, so by Cauchy-Schwarz ``|f - a| <= |x| (|lo| + g |w| + g |hi|) + |x - x'| |hi| (1 +
g)``: ``|x| p + |x - x'| q`` with ``p`` and ``q`` per token, computed here in float64 and
rounded up. The C side computes ``|x - x'|`` for each row: the int8 copy's inputs are
integers times the row's scale; AVX-512 BF16 rounds them to bfloat16 and takes values below
float's normal range as zero (the bfloat16 copy holds such weights as zero, and such inputs
count whole); elsewhere the bfloat16 copy widens to float32 and ``x' = x``.
"""

from dataclasses import dataclass
from functools import cached_property

import torch

from kernels import cpu_gemv, cpu_native

# more tokens than this within the bound of a row's best: its float32 logits are cheaper whole
MAX_CANDIDATES = 64
# tokens the AMX screen keeps a row a thread (those that may beat the running best) before it
# leaves the row to the caller: on 1,920 of SmolLM2's states (48 random prompts, 40 tokens
# each) 64 left 13 rows to the float32 layer, 256 and 1,024 none
SCREEN_KEPT = 1024
_ROWS = 4096  # vocabulary rows a slice when the bound's terms are computed
WEIGHT_MAX = 127  # the int8 copy's largest integer (cpu_screen.c sums in int32 by it)


def available() -> bool:
    return (cpu_native.function("pagedq_greedy") is not None
            and cpu_native.typed("pagedq_gemv", torch.bfloat16) is not None)


@dataclass
class GreedyWeights:
    """The output layer's copy: bfloat16 in ``cpu_gemv``'s panels (``scales`` None), or int8
    in ``cpu_screen.c``'s with each token's scale (float32 [vocab]); each token's terms of the
    bound, ``p`` and ``q`` [vocab] (float32, rounded up) and their highest, and the float32
    weights whose logits the tokens are: ``exact`` as rows [vocab, hidden] (a tied
    embedding's) or as ``cpu_gemv``'s panels, summed in blocks of ``block`` inputs."""

    panels: torch.Tensor
    scales: torch.Tensor | None
    p: torch.Tensor
    q: torch.Tensor
    p_max: float
    q_max: float
    exact: torch.Tensor
    block: int

    @property
    def name(self) -> str:
        return "bfloat16" if self.scales is None else "int8"

    @property
    def vocab(self) -> int:
        return self.p.shape[0]

    @cached_property
    def strides(self) -> torch.Tensor:
        """Where weight (j, i) lies in ``exact``: j // 16, j % 16 and i's strides (built once:
        every step's call passes it)"""
        if self.exact.dim() == 3:  # panels [vocab / 16, hidden, 16]
            strides = [self.exact.stride(0), 1, cpu_gemv.PANEL]
        else:
            strides = [cpu_gemv.PANEL * self.exact.stride(0), self.exact.stride(0), 1]
        return torch.tensor(strides, dtype=torch.int64)


def prepare(weight: torch.Tensor, exact: torch.Tensor, block: int,
            copy: torch.dtype = torch.int8) -> GreedyWeights:
    """``weight`` [vocab, hidden], float32; ``exact`` and ``block``: ``GreedyWeights``'; ``copy``
    the copy's type, ``torch.int8`` or ``torch.bfloat16``."""
    vocab, hidden = weight.shape
    n = hidden + 16
    g = n * 2.0**-24 / (1 - n * 2.0**-24)
    p, q = torch.empty(vocab, dtype=torch.float64), torch.empty(vocab, dtype=torch.float64)
    if copy == torch.int8:
        scales = (weight.abs().amax(dim=1) / WEIGHT_MAX).float()
        ints = torch.empty(vocab, hidden, dtype=torch.int8)
    else:
        scales = None
        bf16 = weight.to(torch.bfloat16)
        bf16 = torch.where(bf16.float().abs() < torch.finfo(torch.float32).tiny, 0, bf16)
    for start in range(0, vocab, _ROWS):  # float64 a slice at a time: no 3 x 226 MB at once
        rows = slice(start, start + _ROWS)
        wide = weight[rows].double()
        if scales is None:
            hi_wide = bf16[rows].double()
        else:  # hi = scale * the integers, exact in float64, as is wide - hi
            scale = scales[rows].double().unsqueeze(1)
            whole = (wide / scale.where(scale > 0, 1)).round().clamp(-WEIGHT_MAX, WEIGHT_MAX)
            ints[rows] = whole.to(torch.int8)
            hi_wide = whole * scale
        lo = wide - hi_wide  # exact: float32 minus its rounding in the copy
        p[rows] = lo.norm(dim=1) + g * (wide.norm(dim=1) + hi_wide.norm(dim=1))
        q[rows] = hi_wide.norm(dim=1) * (1 + g)
    p, q = _rounded_up(p), _rounded_up(q)
    panels = cpu_gemv.pack_panels(bf16) if scales is None else _int8_panels(ints)
    return GreedyWeights(panels, scales, p, q, float(p.max()), float(q.max()), exact, block)


def _int8_panels(ints: torch.Tensor) -> torch.Tensor:
    """cpu_screen.c's layout of ``ints`` [vocab, hidden]: [vocab / 16][hidden / 2][16][2],
    outputs padded to 16 and inputs to even with zeros."""
    vocab, hidden = ints.shape
    padded = torch.zeros((vocab + 15) // 16 * 16, (hidden + 1) // 2 * 2, dtype=torch.int8)
    padded[:vocab, :hidden] = ints
    return padded.view(-1, 16, padded.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()


def _rounded_up(x: torch.Tensor) -> torch.Tensor:
    narrow = x.float()
    return torch.where(narrow.double() < x, torch.nextafter(narrow, torch.tensor(torch.inf)),
                       narrow).contiguous()


def approximate(x: torch.Tensor,
                weights: GreedyWeights) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The copy's logits of ``x`` [rows, hidden] (float32, contiguous) [rows, vocab], and each
    row's ``|x - x'|`` rounded up (None where the product takes ``x`` as it is)."""
    screen, bf16_rounding = (cpu_native.function(name) for name in (
        "pagedq_screen", "pagedq_bf16_rounding"))
    if screen is None or bf16_rounding is None:
        raise RuntimeError("greedy tokens: no C kernels on this machine")
    rows, hidden = x.shape
    rounding = torch.empty(rows)
    if weights.scales is None:
        approx = cpu_gemv.gemv(x, weights.panels, None, weights.vocab, hidden)
        if not cpu_gemv.paired():
            return approx, None
        # the products rounded the inputs to bfloat16
        bf16_rounding(x.data_ptr(), hidden, rows, hidden, rounding.data_ptr())
        return approx, rounding
    approx = torch.empty(rows, weights.vocab)
    if screen(x.data_ptr(), hidden, rows, weights.panels.data_ptr(), weights.scales.data_ptr(),
              approx.data_ptr(), weights.vocab, weights.vocab, hidden, rounding.data_ptr(),
              torch.get_num_threads()) != 0:
        raise MemoryError("greedy tokens: no memory for the int8 inputs")
    return approx, rounding


def tokens(x: torch.Tensor, weights: GreedyWeights) -> torch.Tensor:
    """The argmax of ``x`` [rows, hidden] (float32) times the float32 layer: int64 [rows], -1
    where a row is left to the caller (a non-finite value, more than ``MAX_CANDIDATES`` tokens
    within the bound)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if weights.scales is None and _tiles_tokens(x, weights, out):
        return out
    function = cpu_native.function("pagedq_greedy")
    if function is None:
        raise RuntimeError("greedy tokens: no C kernels on this machine")
    rows, hidden = x.shape
    approx, rounding = approximate(x, weights)
    function(x.data_ptr(), hidden, rows, approx.data_ptr(), weights.vocab, weights.vocab,
             weights.exact.data_ptr(), weights.strides.data_ptr(), hidden, weights.block,
             weights.p.data_ptr(), weights.q.data_ptr(), weights.p_max, weights.q_max,
             None if rounding is None else rounding.data_ptr(), MAX_CANDIDATES,
             out.data_ptr(), torch.get_num_threads())
    return out


def _tiles_tokens(x: torch.Tensor, weights: GreedyWeights, out: torch.Tensor) -> bool:
    """``tokens`` of the bfloat16 copy into ``out`` with the screen inside its product on AMX's
    tiles (``cpu_greedy_tiles.c``: no logits written); False where the tiles do not take these
    rows. Why: SmolLM2's head, 2 threads, a Xeon with AMX (family 6 model 167), medians of 21
    alternating with the logits written and screened, over six runs: 16 rows 1.60-1.75 against
    1.63-2.11 ms, 32 rows 1.74-1.98 against 2.05-2.98, 64 rows 2.94-3.55 against 3.93-6.37, 128
    rows 5.16-7.09 against 8.42-12.21; in ``batched.py``'s workload the head 0.469 against 0.554
    s a call, in ``throughput.py``'s SmolLM2 one 1.268 against 1.750 (medians, alternating
    calls)."""
    function = cpu_native.function("pagedq_greedy_tiles")
    rows, hidden = x.shape
    return function is not None and function(
        x.data_ptr(), hidden, rows, weights.panels.data_ptr(), weights.vocab,
        weights.exact.data_ptr(), weights.strides.data_ptr(), hidden, weights.block,
        weights.p.data_ptr(), weights.q.data_ptr(), weights.p_max, weights.q_max, SCREEN_KEPT,
        MAX_CANDIDATES, out.data_ptr(), torch.get_num_threads()) == 0
