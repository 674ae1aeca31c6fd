"""Batched sampling: penalties, min_tokens, greedy / temperature / top-k / top-p / min-p.

Semantics follow vLLM and HF. Everything is vectorised over the batch; only drawing each
row's uniform number is a Python loop, because a seeded row must draw from its own generator
so that its tokens never depend on the rest of the batch.
"""

import sys

import torch

import kernels
from engine.sampled import Sampled, SamplerOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.transfer import rows_on, to_device


def _padded(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """Rows padded by repeating their first token (0 for an empty row)."""
    width = max(1, max(map(len, rows)))
    return to_device(torch.tensor([r + [r[0] if r else 0] * (width - len(r)) for r in rows]),
                     device)


def _column(xs: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    return to_device(torch.tensor(xs, dtype=dtype).unsqueeze(1), device)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition penalty (HF: over prompt + output tokens, positive logits divided, negative
    multiplied), then frequency and presence penalties (OpenAI: over output tokens only), as
    vLLM orders them. Returns a new tensor when a row is penalised, else `logits` itself.

    Works on the rows' token ids (gather / scatter), not on [rows, vocab] masks. A token
    that occurs twice, or as padding, is written twice with the same value, which is
    harmless for every penalty but frequency's, which the padding mask keeps exact. Rows
    without penalties take part with no tokens, which changes nothing.
    """
    active = [s.params.penalized for s in seqs]
    if not any(active):
        return logits
    dev, dt = logits.device, logits.dtype
    logits = logits.clone()
    seen = [s.token_ids if a else [] for s, a in zip(seqs, active, strict=True)]
    outs = [s.output_token_ids if a else [] for s, a in zip(seqs, active, strict=True)]
    # Penalties are neutral on an empty row, whose padding (token 0) must stay untouched;
    # in other rows the padding repeats a token, and only frequency needs it masked out.
    def neutral(rows: list[list[int]], attr: str, value: float) -> torch.Tensor:
        return _column([getattr(s.params, attr) if r else value
                        for s, r in zip(seqs, rows, strict=True)], dev, dt)

    ids = _padded(seen, dev)
    score = logits.gather(1, ids)
    rep = neutral(seen, "repetition_penalty", 1.0)
    logits.scatter_(1, ids, torch.where(score < 0, score * rep, score / rep))

    ids = _padded(outs, dev)
    real = torch.arange(ids.shape[1], device=dev) < _column(list(map(len, outs)), dev)
    logits.scatter_add_(1, ids, -neutral(outs, "frequency_penalty", 0.0) * real)
    logits.scatter_(1, ids, logits.gather(1, ids) - neutral(outs, "presence_penalty", 0.0))
    return logits


def _filter(probs: torch.Tensor,
            params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, top-p and min-p. Returns the candidates' probabilities, most likely first and
    zero where filtered out, and their token ids. In that order each filter keeps a prefix,
    so their intersection is a prefix too and always holds the most likely token."""
    dev, vocab = probs.device, probs.shape[1]
    top_k = _column([p.top_k if 0 < p.top_k < vocab else vocab for p in params], dev)
    # With top-k on every row, a partial top-k replaces the full sort (the expensive part).
    # Whether a row takes it depends on the rows around it, and it leaves ties in no set
    # order (200 of 200 rows with ties came out of topk in another order than the sort's), so
    # a seeded draw could change with its batch: its candidates are put in the full sort's
    # order (equal probabilities, lowest id first), and where ties straddle its cut (which
    # of them it kept is arbitrary), the full sort runs instead.
    width = int(top_k.max()) if all(p.top_k > 0 for p in params) else vocab
    if width < vocab:
        sp, order = probs.topk(width, dim=-1)
        if bool(((probs >= sp[:, -1:]).sum(dim=-1) > width).any()):
            width = vocab
        else:
            order, by_id = order.sort(dim=-1)
            sp, by_prob = sp.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
            order = order.gather(1, by_prob)
    if width == vocab:
        sp, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = torch.arange(width, device=dev) < top_k
    cum = sp.cumsum(dim=-1)
    # Top-p over the top-k-renormalised mass: keep a token while the mass before it falls
    # short of top_p, i.e. the smallest set whose mass reaches top_p. top_p == 1 skips the
    # test outright, so float rounding in the cumsum cannot drop the tail.
    top_p = _column([p.top_p if p.top_p < 1 else float("inf") for p in params], dev)
    mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
    keep &= mass_before < top_p * cum.gather(1, top_k.clamp(max=width) - 1)
    keep &= sp >= _column([p.min_p for p in params], dev) * sp[:, :1]  # relative to the top
    return sp * keep, order


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first position whose cumulative weight exceeds u * total. A zero-weight
    position never passes the strict '>' unless rounding pushes u * total to the end, hence
    the clamp to the last position with weight."""
    cdf = weights.cumsum(dim=-1)
    positions = torch.arange(weights.shape[1], device=weights.device)
    last = torch.where(weights > 0, positions, 0).amax(dim=-1, keepdim=True)
    target = u * cdf.gather(1, last)
    return torch.searchsorted(cdf, target, right=True).clamp(max=last).squeeze(1)


def draw_uniform(generator: torch.Generator) -> torch.Tensor:
    """The whole use the sampler makes of a seeded sample's generator: one uniform number per
    sampled token, nothing else. ``skip_draws`` relies on it to resume a sample."""
    return torch.rand(1, generator=generator)


def skip_draws(generator: torch.Generator, num_tokens: int) -> None:
    """Advances a seeded sample's generator past the draws of ``num_tokens`` sampled tokens, so
    that a resumed sample draws what it would have drawn had it never stopped."""
    for _ in range(num_tokens):
        draw_uniform(generator)


class Sampler:
    """Picks one token per row of `logits` [N, V] (float32; row i belongs to seqs[i]).

    Greedy rows (temperature 0) take the argmax. A row with a generator (a seed) draws one
    uniform number per step from it and nothing else, and every tensor op is row-wise, so
    its tokens are the same alone or in any batch (exactly tied probabilities included:
    ``_filter`` orders them as the full sort does on either of its paths).

    Logprobs are the log-softmax of the logits after penalties and the min_tokens mask, but
    before temperature, top-k, top-p and min-p: what the model, as penalised, predicts, not
    what the filters let through. (vLLM's default, raw_logprobs, is taken before penalties
    too.) Each dict holds the top-`logprobs` tokens, most likely first, plus the chosen one.
    """

    def __init__(self, eos_token_ids: set[int]) -> None:
        self.eos_token_ids = sorted(eos_token_ids)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        return self.sample(logits, seqs).read()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
        """The tokens, left on the logits' device until ``Sampled.read``."""
        logits = self._mask_min_tokens(apply_penalties(logits, seqs), seqs)
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if len(rows) == len(seqs):
            return Sampled(self._draw(logits, seqs), logits, seqs)
        tokens = kernels.argmax(logits)  # greedy rows; ties go to the lowest id, as in HF
        if rows:
            index = rows_on(rows, logits.device)
            tokens[index] = self._draw(logits[index], [seqs[i] for i in rows])
        return Sampled(tokens, logits, seqs)

    def argmax_only(self, seqs: list[Sequence]) -> bool:
        """Whether each row's token is the argmax of its raw logits and nothing else reads
        them: greedy, no logprobs, no penalties, no min_tokens mask, not a beam's, no samples
        to fork from it."""
        return all(s.params.greedy and s.params.logprobs is None and not s.params.penalized
                   and s.group is None and not s.pending_forks
                   for s in seqs) and not self._min_tokens_cells(seqs, sys.maxsize)

    def _min_tokens_cells(self, seqs: list[Sequence], vocab: int) -> list[tuple[int, int]]:
        """Under min_tokens, every token that would stop the sequence (as vLLM: the
        stop_token_ids, and eos unless ignore_eos makes it an ordinary token): (row, id)."""
        return [(i, t) for i, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens
                for t in s.params.stop_token_ids + ([] if s.params.ignore_eos
                                                    else self.eos_token_ids)
                if t < vocab]

    def _mask_min_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Forbids ``_min_tokens_cells``."""
        cells = self._min_tokens_cells(seqs, logits.shape[1])
        if not cells:
            return logits
        logits = logits.clone()
        rows, cols = zip(*cells, strict=True)
        logits[rows_on(list(rows), logits.device), rows_on(list(cols), logits.device)] = (
            float("-inf"))
        return logits

    @staticmethod
    def _draw(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Temperature, then top-k / top-p / min-p, then one inverse-CDF draw per row."""
        dev = logits.device
        temps = _column([s.params.temperature for s in seqs], dev, logits.dtype)
        probs = torch.softmax(logits / temps, dim=-1)
        u = torch.rand(len(seqs), 1)  # global RNG, for unseeded rows
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                u[i] = draw_uniform(seq.generator)
        u = to_device(u, dev)
        filtered = [i for i, s in enumerate(seqs)
                    if s.params.top_k > 0 or s.params.top_p < 1 or s.params.min_p > 0]
        if not filtered:
            return _inverse_cdf(probs, u)
        params = [seqs[i].params for i in filtered]
        if len(filtered) == len(seqs):
            kept, order = _filter(probs, params)
            return order.gather(1, _inverse_cdf(kept, u).unsqueeze(1)).squeeze(1)
        picked = torch.empty(len(seqs), dtype=torch.long, device=dev)
        plain = sorted(set(range(len(seqs))) - set(filtered))
        if plain:
            rows = rows_on(plain, dev)
            picked[rows] = _inverse_cdf(probs[rows], u[rows])
        index = rows_on(filtered, dev)
        kept, order = _filter(probs[index], params)
        positions = _inverse_cdf(kept, u[index]).unsqueeze(1)
        picked[index] = order.gather(1, positions).squeeze(1)
        return picked
