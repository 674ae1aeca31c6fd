"""The greedy tokens of a float32 model on the CPU without its float32 output layer
(``kernels.cpu_greedy``): the logits of a low-precision copy, a proven bound on their distance
from the float32 ones, and the float32 logits of the few tokens within it of the best. The
tokens are those of ``kernels.argmax`` over the float32 logits, bit for bit, ties included.

Why: a decode step's output layer is its largest product (SmolLM2: 49,152 x 576, 113 MB of
float32 weights). A copy reads fewer bytes and computes faster: the bfloat16 copy on AMX's
tiles where the CPU has them (at 32 rows 9.7 ms for the float32 logits and their argmax
against 3.7, a Xeon with AMX, 2 threads; at one row 4.1 against 2.5), the int8 copy
(``cpu_screen.c``) a quarter of the bytes and twice the FMA's multiply-adds an instruction
anywhere. The bound let through 2 tokens a row at the median, 10 at most, on SmolLM2's states
of random prompts (bfloat16).

It serves only steps whose rows need nothing but the argmax (``Sampler.argmax_only``); the
rest, and rows the bound cannot settle, compute the float32 logits as before.

Which way serves a step's rows is timed at load (``probe``), per row count: the copies'
logits are compute-bound at many rows, and not every CPU computes them faster than float32.
An Intel Xeon (Emerald Rapids) whose VM hid AMX runs ``vdpbf16ps`` at a quarter of its float32
FMAs' rate, half their multiply-adds: SmolLM2's head at 32 rows took 10.3 ms against the
float32 layer's 6.3, at one row 1.0 against 1.9 (2 threads). The bfloat16 copy is built only
where the CPU multiplies bfloat16 pairs (AVX-512 BF16, AMX): elsewhere it widens them to
float32 for the same FMAs, and the int8 copy computes twice as fast from half its bytes.
"""

import sys
from functools import partial

import torch

import kernels
from engine.cpu_linear import PackedLinear
from engine.models import LlamaForCausalLM
from engine.timing import best_seconds
from kernels import cpu_gemv, cpu_greedy

# the row counts ``probe`` times, the ways alternating, best of PROBE_RUNS each
PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64)
PROBE_RUNS = 3


class GreedyHead:
    def __init__(self, lm_head: PackedLinear, copies: list[cpu_greedy.GreedyWeights]) -> None:
        self.lm_head = lm_head
        # (most rows, the copy that serves them, None: the float32 layer), rows ascending;
        # the last serves any count past it too (``bind`` probes them)
        self.routes: list[tuple[int, cpu_greedy.GreedyWeights | None]] = [
            (sys.maxsize, copies[0])]
        self.copies = copies

    @classmethod
    def bind(cls, model: LlamaForCausalLM) -> "GreedyHead | None":
        """``build``'s head, its routes probed, the copies no route takes dropped."""
        greedy = cls.build(model)
        if greedy is not None:
            greedy.routes = greedy.probe()
            greedy.copies = [copy for copy in greedy.copies
                             if any(served is copy for _, served in greedy.routes)]
        return greedy

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> "GreedyHead | None":
        """The head of a model whose output layer is ``cpu_gemv``'s float32 panels, with no
        bias, where the C kernels run (else None): its copies, the first serving every row
        count."""
        head = getattr(model, "lm_head", None)
        if (not isinstance(head, PackedLinear) or head.panels is None
                or head.panels.dtype != torch.float32 or head.bias is not None
                or not cpu_greedy.available()):
            return None
        vocab, hidden = head.out_features, head.in_features
        weight = head.panels.transpose(1, 2).reshape(-1, hidden)[:vocab]
        if not torch.isfinite(weight).all():
            return None
        embedding = model.model.embed_tokens.weight.detach()
        # a tied embedding holds the rows contiguous: a token's weights in one run
        exact = (embedding if embedding.shape == weight.shape and embedding.is_contiguous()
                 and torch.equal(embedding, weight) else head.panels)
        copies = [torch.int8, torch.bfloat16] if cpu_gemv.paired() else [torch.int8]
        return cls(head, [cpu_greedy.prepare(weight, exact, head.block, copy)
                          for copy in copies])

    def probe(self) -> list[tuple[int, cpu_greedy.GreedyWeights | None]]:
        """``routes``: at each count of ``PROBE_ROWS``, the way whose tokens came fastest on
        random states, the copies and the float32 layer alternating; neighbouring counts with
        one way merged, the last count's way serving past it."""
        gen = torch.Generator().manual_seed(0)
        ways: list[cpu_greedy.GreedyWeights | None] = [*self.copies, None]
        routes: list[tuple[int, cpu_greedy.GreedyWeights | None]] = []
        for rows in PROBE_ROWS:
            hidden = torch.randn(rows, self.lm_head.in_features, generator=gen)
            seconds = best_seconds([partial(self._tokens, hidden, way) for way in ways],
                                   PROBE_RUNS)
            fastest = ways[seconds.index(min(seconds))]
            if routes and routes[-1][1] is fastest:
                routes.pop()
            routes.append((rows, fastest))
        return [*routes[:-1], (sys.maxsize, routes[-1][1])]

    @property
    def served(self) -> str:
        """For the start-up log: which way serves which rows ("int8 to 16, float32 past")."""
        named = [(rows, "float32" if way is None else way.name) for rows, way in self.routes]
        return ", ".join(f"{name} to {rows}" if rows < sys.maxsize else f"{name} past"
                         for rows, name in named)

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """``kernels.argmax(self.lm_head(hidden))``: int64 [rows]."""
        way = next(way for rows, way in self.routes if hidden.shape[0] <= rows)
        return self._tokens(hidden, way)

    def _tokens(self, hidden: torch.Tensor,
                way: cpu_greedy.GreedyWeights | None) -> torch.Tensor:
        if way is None:
            return self._float32_tokens(hidden)
        tokens = cpu_greedy.tokens(hidden, way)
        unsettled = (tokens < 0).nonzero().squeeze(1)
        if unsettled.numel():  # float32 logits of those rows: their bits in any batch
            tokens[unsettled] = self._float32_tokens(hidden[unsettled].contiguous())
        return tokens

    def _float32_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of the float32 layer's logits: what ``tokens`` returns, the long way."""
        return kernels.argmax(self.lm_head(hidden))
