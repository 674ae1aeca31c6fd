"""Async scheduling, as vLLM's ``async_scheduling``: the next step is scheduled and launched
while this one's sampled tokens are still on the device, so that the host's work around a
step (reading its tokens back, detokenizing, stop checks, scheduling, staging the next inputs)
runs while the GPU computes instead of between its steps. On an H100 the host took 0.25 ms of a
1.36 ms batch-1 decode step and 4.3 of 7.6 ms at batch 256 (session 18), serial with the
kernels. With it (session 20, random-1b, bf16): a batch-1 step 1.45 -> 1.25 ms (its kernels
1.12), 256 requests 1.20 -> 1.07 s, every output the same.

The contract (``LLMEngine.step`` keeps it, in this order):
1. A step's tokens stay on the device until read (``engine.sampled.Sampled``: a pinned copy
   queued right behind the sampling, so reading waits for that step only, not for the next
   one), and nothing a launch sends up waits for the device (``engine.transfer``).
2. Before step N is read, each sequence it sampled that has not finished gets a placeholder as
   its last token and ``pending_row``, its token's row in N; the model runner takes those rows'
   input ids from N's tokens on the device (``StepInputs.deferred``). ``defer`` does this, and
   N is read in the same ``step`` call: between calls no sequence holds a placeholder (the
   step in flight has advanced ``num_computed_tokens``; its tokens are not in ``token_ids``).
3. Sequences that N's token finishes by length (``max_tokens``, the context) are known before
   N is read: they are held out of step N+1. A stop (eos, stop ids, stop strings) or an abort
   is known only later: such a sequence was computed in N+1 too, and N+1's token for it is
   dropped when N+1 is read (it is finished by then); a seeded sample has then drawn one
   number more than it emitted, which no resume needs (it finished).
4. N is read: placeholders are replaced by the tokens, then N+1's new full blocks go into the
   prefix cache (a block is known by its tokens).
Not overlapped (``can_overlap``): while a beam search is live (its next step depends on this
one's logits, on the host) or where a sequence N sampled has a repetition, presence or
frequency penalty (they read its tokens on the host). CUDA only by default: on the CPU the
host and the model share the same cores, and every op finishes before the next is queued.
"""

from collections.abc import Callable
from dataclasses import dataclass

from engine.outputs import RequestDelta
from engine.sampled import Sampled
from engine.sequence import Sequence

PLACEHOLDER = -1  # the token id of a token still on the device


@dataclass
class Launched:
    """A step queued on the device, its tokens not read yet."""

    batch: list[Sequence]  # its scheduled sequences, ``num_computed_tokens`` advanced
    sampled: Sampled | None  # the sequences that sample in it and their tokens; None: none
    results: list[RequestDelta]  # beam searches it finished (read at launch)


def can_overlap(launched: Launched, num_live_beams: int) -> bool:
    """Whether the step after ``launched`` may be launched before ``launched`` is read."""
    if num_live_beams:
        return False
    return launched.sampled is None or not any(
        seq.params.penalized for seq in launched.sampled.seqs)


def defer(launched: Launched, length_done: Callable[[Sequence], bool]) -> set[int]:
    """Gives each unfinished sequence ``launched`` sampled its placeholder token; returns the
    ids of those that token finishes by length, to hold out of the next step."""
    held = set()
    for row, seq in enumerate(launched.sampled.seqs if launched.sampled else []):
        if seq.is_finished:
            continue
        seq.token_ids.append(PLACEHOLDER)
        seq.pending_row = row
        if length_done(seq):
            held.add(seq.seq_id)
    return held


def take_token(seq: Sequence, token: int) -> None:
    """A read token into ``seq``: in place of its placeholder, or appended."""
    if seq.pending_row is None:
        seq.token_ids.append(token)
    else:
        seq.token_ids[-1] = token
        seq.pending_row = None

