"""The greedy tokens of a float32 model on the CPU without its float32 output layer
(``kernels.cpu_greedy``): the logits of a bfloat16 copy, a proven bound on their distance from
the float32 ones, and the float32 logits of the few tokens within it of the best. The tokens
are those of ``kernels.argmax`` over the float32 logits, bit for bit, ties included.

Why: a decode step's output layer is its largest product (SmolLM2: 49,152 x 576, 113 MB of
float32 weights). The bfloat16 copy reads half the bytes, and computes on AMX's tiles where the
CPU has them: at 32 rows 9.7 ms for the float32 logits and their argmax against 3.7 (a Xeon
with AMX, 2 threads), at one row 4.1 against 2.5. The bound let through 2 tokens a row at the
median, 10 at most, on SmolLM2's states of random prompts.

It serves only steps whose rows need nothing but the argmax (``Sampler.argmax_only``); the
rest, and rows the bound cannot settle, compute the float32 logits as before.

Past ``max_rows`` rows the float32 layer computes the tokens instead: the copy's logits are
compute-bound there, and not every CPU computes bfloat16 faster than float32. An Intel Xeon
(Emerald Rapids) whose VM hid AMX runs ``vdpbf16ps`` at a quarter of its float32 FMAs' rate,
half their multiply-adds: SmolLM2's head at 32 rows took 10.3 ms against the float32 layer's
6.3, at one row 1.0 against 1.9 (2 threads). ``probe`` finds the bound at load (there, on
SmolLM2, in 126-143 ms).
"""

import sys
from functools import partial

import torch

import kernels
from engine.cpu_linear import PackedLinear
from engine.models import LlamaForCausalLM
from engine.timing import best_seconds
from kernels import cpu_greedy

# the row counts ``probe`` times, the two ways alternating, best of PROBE_RUNS each
PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64)
PROBE_RUNS = 3


class GreedyHead:
    def __init__(self, lm_head: PackedLinear, weights: cpu_greedy.GreedyWeights) -> None:
        self.lm_head = lm_head
        self.weights = weights
        self.max_rows = sys.maxsize  # past it the float32 layer serves (``bind`` probes it)

    @classmethod
    def bind(cls, model: LlamaForCausalLM) -> "GreedyHead | None":
        """The head of a model whose output layer is ``cpu_gemv``'s float32 panels, with no
        bias, where the C kernels and their bfloat16 build run; else None."""
        head = getattr(model, "lm_head", None)
        if (not isinstance(head, PackedLinear) or head.panels is None
                or head.panels.dtype != torch.float32 or head.bias is not None
                or not cpu_greedy.available()):
            return None
        vocab, hidden = head.out_features, head.in_features
        weight = head.panels.transpose(1, 2).reshape(-1, hidden)[:vocab]
        embedding = model.model.embed_tokens.weight.detach()
        # a tied embedding holds the rows contiguous: a token's weights in one run
        exact = (embedding if embedding.shape == weight.shape and embedding.is_contiguous()
                 and torch.equal(embedding, weight) else head.panels)
        greedy = cls(head, cpu_greedy.prepare(weight, exact, head.block))
        greedy.max_rows = greedy.probe()
        return greedy

    def probe(self) -> int:
        """The most rows of ``PROBE_ROWS`` up to which the bfloat16 copy's tokens came faster
        than the float32 layer's (``sys.maxsize`` where it led at every count; 0 where it led
        at none), on random states; it stops at the first count it lost."""
        gen = torch.Generator().manual_seed(0)
        best = 0
        for rows in PROBE_ROWS:
            hidden = torch.randn(rows, self.lm_head.in_features, generator=gen)
            seconds = best_seconds((partial(cpu_greedy.tokens, hidden, self.weights),
                                    partial(self._float32_tokens, hidden)), PROBE_RUNS)
            if seconds[0] > seconds[1]:
                return best
            best = rows
        return sys.maxsize

    @property
    def served(self) -> int | str:
        """For the start-up log: the most rows it serves ("all"; 0: none)."""
        return "all" if self.max_rows == sys.maxsize else self.max_rows

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """``kernels.argmax(self.lm_head(hidden))``: int64 [rows]."""
        if hidden.shape[0] > self.max_rows:
            return self._float32_tokens(hidden)
        tokens = cpu_greedy.tokens(hidden, self.weights)
        unsettled = (tokens < 0).nonzero().squeeze(1)
        if unsettled.numel():  # float32 logits of those rows: their bits in any batch
            tokens[unsettled] = self._float32_tokens(hidden[unsettled].contiguous())
        return tokens

    def _float32_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of the float32 layer's logits: what ``tokens`` returns, the long way."""
        return kernels.argmax(self.lm_head(hidden))
