"""Sampling's traffic between host and device, none of it waiting on the device: the host's
inputs (temperatures, uniform numbers, row indices) go up through pinned memory, a step's
tokens and the logprobs asked for come down the same way, copied as soon as they are queued.
A plain copy from pageable memory, or ``tolist``, waits for everything queued before it: under
async scheduling (engine.async_step) that is the step being launched, which then would not
overlap the host's work at all."""

from dataclasses import dataclass

import torch

from engine.sequence import Sequence


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # None where the seq asked for no logprobs


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; on CUDA, through pinned memory, without waiting."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def rows_on(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row indices as an index tensor on ``device``."""
    return to_device(torch.tensor(rows, dtype=torch.int64), device)


class Sampled:
    """A step's sampled tokens ``[len(seqs)]`` on the device, and the logprobs its rows ask for
    (the log-softmax of ``logits``: the top ones and the chosen token's), computed at once and
    copied to pinned host memory (on CUDA): ``read`` waits for this step's copies only, not
    for whatever the stream was given after them (the next step, under async scheduling)."""

    def __init__(self, tokens: torch.Tensor, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        self.tokens, self.seqs = tokens, seqs
        self.wanted = [(i, n) for i, s in enumerate(seqs) if (n := s.params.logprobs) is not None]
        parts = [tokens]
        if self.wanted:
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
