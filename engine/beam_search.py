"""Beam search in the engine core: one request whose beams the scheduler runs together.

The rule is transformers' ``generate(num_beams=w, do_sample=False)`` (``_beam_search`` in
transformers 5), step for step and in float32 as there, so that the beams come out the same
and in the same order:

- every live beam's next-token logprobs plus its running score give ``w * vocab``
  candidates; the best ``K = max(2, 1 + #eos) * w`` are kept (with ``ignore_eos`` nothing is
  eos, so ``K = 2w``);
- a candidate that ends in eos, or reaches ``max_tokens``, is finished: among the first ``w``
  of the ``K`` it joins the finished hypotheses scored ``cum_logprob / gen_len **
  length_penalty`` (the ``w`` best are kept), beyond them it is dropped;
- the best ``w`` unfinished candidates are the next live beams, best first;
- the search ends when every candidate finished, when ``early_stopping`` is True and ``w``
  hypotheses are finished, or when the best live beam cannot beat the worst finished
  hypothesis any more (transformers' heuristic; see ``BeamSearchParams``).

Sharing is PagedAttention's: a survivor is its parent ``Sequence`` (for its first child) or
a fork of it (``BlockManager.fork``: every block shared, ref counts up); the shared, partly
filled last block is copied when a beam writes into it; a parent without survivors is freed
at once. Beams whose logits arrive in different steps (chunked recompute, a short budget)
wait for their siblings (``ready``). A preempted group keeps its beams' tokens and scores and
waits as one ``trunk`` sequence: their longest common prefix, recomputed once and then
forked into the beams again, so a preemption recomputes no prefix twice either.
"""

import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from engine.detokenizer import decode
from engine.outputs import RequestDelta, SampleDelta
from engine.sampling_params import BeamSearchParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


@dataclass
class Hypothesis:
    token_ids: list[int]  # output tokens, the eos included
    logprobs: list[dict[int, float]]
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty, in float32 as transformers
    finish_reason: str


@dataclass
class BeamGroup:
    request_id: str
    params: BeamSearchParams
    eos_token_ids: set[int]  # empty under ignore_eos
    trunk: Sequence | None  # the sequence to compute before the beams (the prompt, at first)
    live: list[Sequence] = field(default_factory=list)  # best first
    scores: torch.Tensor = field(default_factory=lambda: torch.zeros(1))  # float32, per beam
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    ready: dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id -> its logits row
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied
    done: bool = False

    @property
    def width(self) -> int:
        return self.params.beam_width

    @property
    def members(self) -> list[Sequence]:
        """The sequences that compute now: the trunk while there is one, else the beams."""
        return [self.trunk] if self.trunk is not None else self.live

    def collect(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor | None:
        """Takes one member's logits row; returns every member's, in order, once all came."""
        self.ready[seq.seq_id] = logits
        members = self.members
        if any(s.seq_id not in self.ready for s in members):
            return None
        return torch.stack([self.ready.pop(s.seq_id) for s in members])

    def advance(self, logits: torch.Tensor) -> list[tuple[int, int, float]]:
        """One beam step over the live beams' logits ``[len(live), vocab]``: updates the
        finished hypotheses and the stopping state; returns the survivors, best first, as
        (parent row, token, its logprob)."""
        w, lp, vocab = self.width, self.params.length_penalty, logits.shape[1]
        # One beam is greedy search, as transformers runs num_beams=1: done at the first eos.
        early_stopping = True if w == 1 else self.params.early_stopping
        if self.params.temperature > 0:
            logits = logits / self.params.temperature
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        flat = (logprobs + self.scores[:, None]).flatten()
        top_v, top_i = flat.topk(min(max(2, 1 + len(self.eos_token_ids)) * w, flat.numel()))
        parents, tokens = (top_i // vocab).tolist(), (top_i % vocab).tolist()
        gen_len = self.live[0].num_output_tokens + 1
        ends = [t in self.eos_token_ids or gen_len >= self.params.max_tokens for t in tokens]
        token_lps = logprobs[top_i // vocab, top_i % vocab].tolist()
        full = len(self.finished) == w
        if self.improvable and not (full and early_stopping is True):
            scores = (top_v / (gen_len ** lp)).tolist()
            cums = top_v.tolist()
            new = [self._hypothesis(parents[j], tokens[j], token_lps[j], cums[j], scores[j])
                   for j in range(min(w, len(tokens))) if ends[j]]
            # Stable: on a tie the older hypothesis stays ahead, as in transformers' topk.
            self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:w]
        keep = [j for j in range(len(tokens)) if not ends[j]][:w]
        self.scores = top_v[keep]
        if self.improvable and keep:
            length = (self.params.max_tokens if early_stopping == "never" and lp > 0
                      else gen_len)
            best = float(self.scores[0] / (length ** lp))
            worst = self.finished[-1].score if len(self.finished) == w else -1.0e9
            self.improvable = best > worst
        self.done = (not keep or not self.improvable
                     or (len(self.finished) == w and early_stopping is True))
        return [] if self.done else [(parents[j], tokens[j], token_lps[j]) for j in keep]

    def _hypothesis(self, parent: int, token: int, logprob: float, cum: float,
                    score: float) -> Hypothesis:
        beam = self.live[parent]
        return Hypothesis(beam.output_token_ids + [token], beam.logprobs + [{token: logprob}],
                          cum, score, "stop" if token in self.eos_token_ids else "length")

    def park(self) -> Sequence:
        """After the group's beams were preempted (their blocks freed): the trunk to recompute,
        their longest common prefix, short of their last token so that each beam has one of
        its own to compute and sample from."""
        first = self.live[0].token_ids
        common = len(first) - 1
        for beam in self.live[1:]:
            common = min(common, next(i for i, (a, b) in enumerate(zip(first, beam.token_ids,
                                                                       strict=True)) if a != b))
        self.ready.clear()
        for beam in self.live:
            beam.status = SequenceStatus.WAITING
        head = self.live[0]
        self.trunk = Sequence(self.request_id, first[:common], head.params, head.priority,
                              head.arrival)
        self.trunk.group = self
        return self.trunk


class BeamSearcher:
    """The engine's side of its beam groups: routes their logits out of a step, forks the
    survivors, frees the dead, and hands out each group's ranked result when it is done."""

    def __init__(self, scheduler: Scheduler, tokenizer: PreTrainedTokenizerBase,
                 eos_token_ids: set[int]) -> None:
        self.scheduler = scheduler
        self.block_manager = scheduler.block_manager
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.tokens_generated = 0
        self.num_finished = 0  # beam searches that ran to their end
        self.num_live = 0  # beam searches added and not yet finished or aborted

    def add(self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams,
            priority: int) -> BeamGroup:
        seq = Sequence(request_id, prompt_token_ids, params.sampling_params(), priority,
                       time.monotonic())
        group = BeamGroup(request_id, params,
                          set() if params.ignore_eos else set(self.eos_token_ids), seq)
        seq.group = group
        self.scheduler.add(seq)
        self.num_live += 1
        return group

    def abort(self, group: BeamGroup) -> None:
        """Frees every block of the group (parked beams hold none)."""
        for seq in group.members:
            self.scheduler.finish(seq, "abort")
        group.done = True
        self.num_live -= 1

    def step(self, sampled: list[Sequence], logits: torch.Tensor
             ) -> tuple[list[Sequence], torch.Tensor, list[RequestDelta]]:
        """Takes the beams' rows out of a step's ``(sampled, logits)`` and advances the groups
        whose members all have logits now; returns the other rows and the finished groups'
        results."""
        rows = [i for i, seq in enumerate(sampled) if seq.group is None]
        if len(rows) == len(sampled):
            return sampled, logits, []
        results = []
        for i, seq in enumerate(sampled):
            group = seq.group
            batch = None if group is None else group.collect(seq, logits[i])
            if group is None or batch is None:
                continue
            if group.trunk is not None and group.live:  # recomputed after a preemption
                self._rebuild(group, group.trunk)
                continue
            if group.trunk is not None:  # the prompt is computed: it is the first beam
                group.live, group.trunk = [group.trunk], None
            self._advance(group, batch)
            if group.done:
                self.num_finished += 1
                self.num_live -= 1
                results.append(self._result(group))
        return [sampled[i] for i in rows], logits[rows], results

    def _rebuild(self, group: BeamGroup, trunk: Sequence) -> None:
        for beam in group.live:
            self.block_manager.fork(trunk, beam)
            beam.num_computed_tokens = trunk.num_computed_tokens
            beam.status = SequenceStatus.RUNNING
        group.trunk = None
        self.scheduler.replace([trunk], group.live)

    def _advance(self, group: BeamGroup, logits: torch.Tensor) -> None:
        survivors = group.advance(logits)
        parents, children, taken = group.live, [], set()
        for p, _, _ in survivors:  # every fork before any parent takes its new token
            children.append(parents[p] if p not in taken else self._fork(parents[p]))
            taken.add(p)
        for child, (_, token, logprob) in zip(children, survivors, strict=True):
            child.token_ids.append(token)
            child.logprobs.append({token: logprob})
        self.tokens_generated += len(children)
        self.scheduler.replace(parents, children)
        group.live = children

    def _fork(self, parent: Sequence) -> Sequence:
        child = parent.fork(parent.index)
        self.block_manager.fork(parent, child)
        return child

    def _result(self, group: BeamGroup) -> RequestDelta:
        samples = []
        for rank, h in enumerate(group.finished):
            # vLLM's text: the output without its eos.
            ids = h.token_ids[:-1] if h.finish_reason == "stop" else h.token_ids
            text = decode(self.tokenizer, ids, skip_special_tokens=True)
            samples.append(SampleDelta(rank, h.token_ids, text, h.logprobs, h.finish_reason,
                                       h.cum_logprob))
        return RequestDelta(group.request_id, samples, finished=True)
