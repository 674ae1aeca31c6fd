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
"""

import torch

import kernels
from engine.cpu_linear import PackedLinear
from engine.models import LlamaForCausalLM
from kernels import cpu_greedy


class GreedyHead:
    def __init__(self, lm_head: PackedLinear, weights: cpu_greedy.GreedyWeights) -> None:
        self.lm_head = lm_head
        self.weights = weights

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
        return cls(head, cpu_greedy.prepare(weight, exact, head.block))

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """``kernels.argmax(self.lm_head(hidden))``: int64 [rows]."""
        tokens = cpu_greedy.tokens(hidden, self.weights)
        unsettled = (tokens < 0).nonzero().squeeze(1)
        if unsettled.numel():  # float32 logits of those rows: their bits in any batch
            tokens[unsettled] = kernels.argmax(self.lm_head(hidden[unsettled].contiguous()))
        return tokens
