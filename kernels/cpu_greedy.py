"""A greedy step's tokens without the float32 output layer (``cpu_greedy.c``, built by
``kernels.cpu_native``): the logits of a bfloat16 copy of the weights, a bound on their
distance from the float32 logits, and the float32 logits of only the tokens within it of the
best. The tokens are the float32 layer's argmax, ties to the lowest id, bit for bit: a token
is passed over only where its float32 logit is certainly below another's.

The bound. With ``w = hi + lo`` (``hi`` the bfloat16 copy, ``lo`` the exact rest) and ``x'``
the inputs as the bfloat16 product takes them, the float32 logit ``f`` and the approximation
``a`` of token j satisfy ``|f - x.w| <= g |x||w|`` and ``|a - x'.hi| <= g |x'||hi|`` (a sum of n
products in float32 in any order: ``g = n u / (1 - n u)``, ``u = 2^-24``, n the inputs plus 16
for the pairs' and blocks' additions), and ``x.w - x'.hi = x.lo + (x - x').hi``, so by
Cauchy-Schwarz ``|f - a| <= |x| (|lo| + g |w| + g |hi|) + |x - x'| |hi| (1 + g)``: ``|x| p +
|x - x'| q`` with ``p`` and ``q`` per token, computed here in float64 and rounded up. The
instructions take bfloat16 values below float's normal range as zero: the copy holds those
weights as zero, and the C side counts such inputs whole in ``|x - x'|``.
"""

from dataclasses import dataclass
from functools import cached_property

import torch

from kernels import cpu_gemv, cpu_native

# more tokens than this within the bound of a row's best: its float32 logits are cheaper whole
MAX_CANDIDATES = 64
_ROWS = 4096  # vocabulary rows a slice when the bound's terms are computed


def available() -> bool:
    return (cpu_native.function("pagedq_greedy") is not None
            and cpu_native.typed("pagedq_gemv", torch.bfloat16) is not None)


@dataclass
class GreedyWeights:
    """The output layer's bfloat16 copy in ``cpu_gemv``'s panels, each token's terms of the
    bound, ``p`` and ``q`` [vocab] (float32, rounded up) and their highest, and the float32
    weights whose logits the tokens are: ``exact`` as rows [vocab, hidden] (a tied
    embedding's) or as ``cpu_gemv``'s panels, summed in blocks of ``block`` inputs."""

    panels: torch.Tensor
    p: torch.Tensor
    q: torch.Tensor
    p_max: float
    q_max: float
    exact: torch.Tensor
    block: int

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


def prepare(weight: torch.Tensor, exact: torch.Tensor, block: int) -> GreedyWeights:
    """``weight`` [vocab, hidden], float32; ``exact`` and ``block``: ``GreedyWeights``'."""
    vocab, hidden = weight.shape
    hi = weight.to(torch.bfloat16)
    hi = torch.where(hi.float().abs() < torch.finfo(torch.float32).tiny, 0, hi)
    n = hidden + 16
    g = n * 2.0**-24 / (1 - n * 2.0**-24)
    p, q = torch.empty(vocab, dtype=torch.float64), torch.empty(vocab, dtype=torch.float64)
    for start in range(0, vocab, _ROWS):  # float64 a slice at a time: no 3 x 226 MB at once
        wide, hi_wide = weight[start:start + _ROWS].double(), hi[start:start + _ROWS].double()
        lo = wide - hi_wide  # exact: float32 minus its bfloat16 rounding
        p[start:start + _ROWS] = lo.norm(dim=1) + g * (wide.norm(dim=1) + hi_wide.norm(dim=1))
        q[start:start + _ROWS] = hi_wide.norm(dim=1) * (1 + g)
    p, q = _rounded_up(p), _rounded_up(q)
    return GreedyWeights(cpu_gemv.pack_panels(hi), p, q, float(p.max()), float(q.max()),
                         exact, block)


def _rounded_up(x: torch.Tensor) -> torch.Tensor:
    narrow = x.float()
    return torch.where(narrow.double() < x, torch.nextafter(narrow, torch.tensor(torch.inf)),
                       narrow).contiguous()


def tokens(x: torch.Tensor, weights: GreedyWeights) -> torch.Tensor:
    """The argmax of ``x`` [rows, hidden] (float32) times the float32 layer: int64 [rows], -1
    where a row is left to the caller (a non-finite value, more than ``MAX_CANDIDATES`` tokens
    within the bound)."""
    function = cpu_native.function("pagedq_greedy")
    if function is None:
        raise RuntimeError("greedy tokens: no C kernels on this machine")
    rows, hidden = x.shape
    x = x.contiguous()
    approx = cpu_gemv.gemv(x, weights.panels, None, weights.vocab, hidden)
    out = torch.empty(rows, dtype=torch.int64)
    function(x.data_ptr(), hidden, rows, approx.data_ptr(), weights.vocab, weights.vocab,
             weights.exact.data_ptr(), weights.strides.data_ptr(), hidden, weights.block,
             weights.p.data_ptr(), weights.q.data_ptr(), weights.p_max, weights.q_max,
             int(cpu_gemv.paired()), MAX_CANDIDATES, out.data_ptr(), torch.get_num_threads())
    return out
