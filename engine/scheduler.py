"""Continuous batching under one token budget per step, with chunked prefill and preemption by
recompute.

Each step the running sequences go first (oldest first), each taking the tokens it still has to
compute (one, once decoding), then waiting sequences are admitted while budget, sequence slots
and blocks last. When a running sequence needs a block and none is free, the youngest running
sequence is preempted: its blocks are freed (its full blocks stay in the prefix cache) and it
goes back to the waiting queue to be recomputed later.

Admission order: priority first (lower value first, as vLLM), then the shortest prefill first
among the waiting sequences that arrived together (within ``SHORTEST_FIRST_WINDOW_S`` of the
oldest of that priority, among its first ``SHORTEST_FIRST_SCAN``); otherwise arrival. A burst
of prompts then gets its first tokens sooner: a prefill is compute-bound, so each request's
first token waits for the prompts computed before it, and the short ones first make the median
wait shorter while the last prompt finishes no later (the same prompts are computed either
way). vLLM admits first come, first served. 32 prompts of 64-256 tokens added to the engine
at once (SmolLM2, an Intel Xeon, 2 threads, three draws): first come, first served gave their
first tokens at a median of 3.0-3.7 s, the last at 3.7-4.5 s; shortest first at 1.4-1.8 s, the
last at 3.8-4.5 s. A worker reads up to four steps' worth at a time (``worker/intake.py``), so
a burst waits together there too (at two steps' worth the gain had mostly vanished). The
window bounds what a long prompt can be passed by: only prompts that arrived within the window
after it.
"""

from bisect import insort
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus

SHORTEST_FIRST_WINDOW_S = 1.0
SHORTEST_FIRST_SCAN = 64  # bounds the scan (an offline call may add thousands at once)


def _age(seq: Sequence) -> tuple[int, float, int]:
    """Sort key: lower priority value first (as vLLM), then arrival, then creation."""
    return seq.priority, seq.arrival, seq.seq_id


def _prefill_left(seq: Sequence) -> int:
    return len(seq) - seq.num_computed_tokens


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)


@dataclass
class Room:
    """``Scheduler.room()``: free sequence slots, KV blocks and prefill tokens (each may be
    negative: over-committed)."""

    seqs: int
    blocks: int
    tokens: int


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by _age
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def room(self, steps: int = 1) -> Room:
        """What could still start within the next ``steps`` steps, after the sequences held: a
        service that feeds the engine (worker/intake.py) reads only that much new work and
        leaves the rest to its peers. Counts sequence slots (a waiting sequence counts its
        samples or beams), KV blocks (free and evictable ones, less the prompt blocks of the
        waiting sequences and one block per running sequence per ``block_size`` steps of
        growth) and prefill tokens (the token budget of ``steps`` steps, less one decode token
        per running sequence and step, less the waiting prompts). O(running + waiting)."""
        bs = self.block_manager.block_size
        held = sum(1 + s.pending_forks for s in self.running) + sum(
            s.num_slots for s in self.waiting)
        waiting_tokens = sum(len(s) - s.num_computed_tokens for s in self.waiting)
        waiting_blocks = sum(-(-len(s) // bs) for s in self.waiting)
        growth = -(-len(self.running) * steps // bs)
        return Room(seqs=self.max_num_seqs - held,
                    blocks=self.block_manager.num_free_blocks - waiting_blocks - growth,
                    tokens=steps * (self.max_num_batched_tokens - len(self.running))
                    - waiting_tokens)

    def add(self, seq: Sequence) -> None:
        insort(self.waiting, seq, key=_age)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _unit_end(self, i: int) -> int:
        """The end of the unit starting at ``running[i]``: a beam group's sequences (kept
        together in ``running``), else the sequence alone."""
        group, end = self.running[i].group, i + 1
        while group is not None and end < len(self.running) and self.running[end].group is group:
            end += 1
        return end

    def schedule(self, held: set[int] | frozenset[int] = frozenset()) -> SchedulerOutput:
        """``held``: ids of running sequences to leave out of this step (under async
        scheduling, those that a token not yet read finishes: engine.async_step)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.seq_id in held:
                i += 1
                continue
            unit = [seq] if seq.group is None else self.running[i:self._unit_end(i)]
            mark = len(out.seqs), len(out.copies), budget
            for seq in unit:
                num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
                if num_new == 0:  # a beam that waits for its siblings' logits, or no budget
                    continue
                while not self.block_manager.append_slots(seq, num_new, out.copies):
                    # Everything before i is scheduled; the youngest of the rest makes room.
                    self._preempt(max(self.running[i:], key=_age))
                    preempted = True
                    if seq.status != SequenceStatus.RUNNING:
                        break
                else:
                    out.add(seq, num_new)
                    budget -= num_new
                if seq.status != SequenceStatus.RUNNING:  # its whole unit went back to wait
                    del out.seqs[mark[0]:], out.num_new_tokens[mark[0]:], out.copies[mark[1]:]
                    budget = mark[2]
                    break
            else:
                i += len(unit)
        # Admitting while preempting would only thrash: the freed blocks are for the running.
        while self.waiting and budget > 0 and not preempted:
            at = self._next_waiting()
            seq = self.waiting[at]
            if len(self.running) + seq.num_slots > self.max_num_seqs:
                break
            num_new = self.block_manager.allocate(seq, budget)
            if num_new == 0:
                break
            del self.waiting[at]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.add(seq, num_new)
            budget -= num_new
        return out

    def _next_waiting(self) -> int:
        """The index in ``waiting`` of the sequence to admit next: of those that arrived within
        the window of the oldest waiting one, of its priority, the one with the fewest tokens
        to compute (the older of equals). ``waiting`` is in ``_age`` order, so they lead it."""
        head = self.waiting[0]
        best, fewest = 0, _prefill_left(head)
        for i in range(1, min(len(self.waiting), SHORTEST_FIRST_SCAN)):
            seq = self.waiting[i]
            if (seq.priority != head.priority
                    or seq.arrival - head.arrival > SHORTEST_FIRST_WINDOW_S):
                break
            left = _prefill_left(seq)
            if left < fewest:
                best, fewest = i, left
        return best

    def _preempt(self, seq: Sequence) -> None:
        """Preempts by recompute; a beam preempts its whole group, which waits as one trunk
        (``BeamGroup.park``)."""
        group = seq.group
        beams = group if group is not None and seq is not group.trunk else None
        for member in beams.live if beams is not None else [seq]:
            self.running.remove(member)
            self.block_manager.free(member)
        if beams is not None:
            seq = beams.park()
        seq.status = SequenceStatus.WAITING
        self.add(seq)
        self.num_preemptions += 1

    def replace(self, old: list[Sequence], new: list[Sequence]) -> None:
        """Puts a beam group's ``new`` sequences where its ``old`` ran, freeing those of
        ``old`` that are not in ``new`` (the survivors share their blocks through forks)."""
        position = self.running.index(old[0])
        kept = set(map(id, new))
        for seq in old:
            self.running.remove(seq)
            if id(seq) not in kept:
                self.block_manager.free(seq)
                seq.status = SequenceStatus.FINISHED
        self.running[position:position] = new

    def fork(self, seq: Sequence) -> list[Sequence]:
        """Split a request whose prompt is now computed into its n samples, sharing blocks."""
        children = [seq.fork(index) for index in range(1, seq.pending_forks + 1)]
        seq.pending_forks = 0
        position = self.running.index(seq) + 1
        for child in children:
            self.block_manager.fork(seq, child)
        self.running[position:position] = children
        return children

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
