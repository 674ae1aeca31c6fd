"""A step's sampled tokens, and the logprobs asked for, on their way to the host without
waiting for what is queued after them: ``tolist`` would wait for everything queued before the
copy, under async scheduling (engine.async_step) the next step too. (The way up:
engine.transfer.)"""

from dataclasses import dataclass

import torch

from engine.sequence import Sequence
from engine.transfer import rows_on


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # None where the seq asked for no logprobs


class Sampled:
    """A step's sampled tokens ``[len(seqs)]`` on the device, and the logprobs its rows ask for
    (the log-softmax of ``logits``: the top ones and the chosen token's), computed at once and
    copied to pinned host memory (on CUDA): ``read`` waits for this step's copies only, not
    for whatever the stream was given after them (the next step, under async scheduling)."""

    def __init__(self, tokens: torch.Tensor, logits: torch.Tensor | None,
                 seqs: list[Sequence]) -> None:
        """``logits``: None where no row asks for logprobs (a greedy head's tokens)."""
        self.tokens, self.seqs = tokens, seqs
        self.wanted = [(i, n) for i, s in enumerate(seqs) if (n := s.params.logprobs) is not None]
        parts = [tokens]
        if self.wanted:
            if logits is None:
                raise ValueError("logprobs asked for without the logits")
            rows = rows_on([i for i, _ in self.wanted], tokens.device)
            lp = torch.log_softmax(logits[rows], dim=-1)
            top_v, top_i = lp.topk(min(max(n for _, n in self.wanted), lp.shape[1]), dim=-1)
            parts += [top_v, top_i, lp.gather(1, tokens[rows].unsqueeze(1)).squeeze(1)]
        self.host, self.copied = parts, None
        if tokens.is_cuda:
            self.host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(
                p, non_blocking=True) for p in parts]
            self.copied = torch.cuda.Event()
            self.copied.record()

    def read(self) -> SamplerOutput:
        if self.copied is not None:
            self.copied.synchronize()
        token_ids = self.host[0].tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(self.seqs)
        if self.wanted:
            top_v, top_i, chosen = (t.tolist() for t in self.host[1:])
            for j, (i, n) in enumerate(self.wanted):
                top = dict(zip(top_i[j][:n], top_v[j][:n], strict=True))
                top[token_ids[i]] = chosen[j]
                logprobs[i] = top
        return SamplerOutput(token_ids, logprobs)
