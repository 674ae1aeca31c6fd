"""How many jobs a worker reads: only those its engine could start within a short look-ahead
(``LOOKAHEAD_STEPS`` steps), counted in sequence slots (each sample of a job counts), KV blocks
and prefill tokens. The rest stay in the stream for its peers.

Why: a job read is this worker's until it ends (a stream has no way to hand an entry back), so
a worker that reads all it could ever hold (256 slots) keeps a burst waiting inside itself while
its peers idle (96 jobs: 7.9 s on one worker, 8.1 s on two, before this). Reading only what
starts soon lets a busy worker take less per read (its room is taken, its steps are longer)
and an idle one take the rest within its next read.

Four steps, not two: a burst then waits inside the engine together, where the scheduler
starts its shortest prompts first (engine/scheduler.py). ``serve.py``'s burst (32 prompts of
64-256 tokens, SmolLM2, 2,048-token steps of ~2.3 s on 2 cores; session 62): at two steps each
read took at most 16 jobs (4,096 tokens at 256 a job), the first full step finished 13 of
them in landing order, and the p50 TTFT was 4.81-4.85 s; at four the step after the first job's
finished 17 of them, p50 2.55-2.56 s, p99 and rates 1, 2 and 4 as before. ``scale.py``
(96 jobs, 1 and 2 workers) split 48/48 either way, 1.74x against 1.78x.

A job's needs are only known once it is read, so a read is sized by the largest needs among
the last ``WINDOW`` jobs this worker started; before the first, by a seed chosen large (4
samples of 256 prompt tokens). An empty worker always reads at least one job, whatever the
estimate, so no job is ever left behind by a pessimistic one.
"""

from collections import deque
from dataclasses import dataclass

from engine.llm_engine import LLMEngine

LOOKAHEAD_STEPS = 4
WINDOW = 64


@dataclass(frozen=True)
class Need:
    """What one job takes to start: sequences, KV blocks, prefill tokens."""

    seqs: int
    blocks: int
    tokens: int


def need(engine: LLMEngine, prompt_tokens: int, n: int) -> Need:
    """A job's prompt blocks and one block more for each sample past the first (its copy of
    the partly filled last block)."""
    blocks = -(-(prompt_tokens + 1) // engine.config.block_size) + n - 1
    return Need(n, blocks, prompt_tokens)


class Intake:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.seed = need(engine, 256, 4)
        self.recent: deque[Need] = deque(maxlen=WINDOW)

    def started(self, prompt_tokens: int, n: int) -> None:
        """A job started: its needs join the estimate."""
        self.recent.append(need(self.engine, prompt_tokens, n))

    def count(self, unadmitted: int) -> int:
        """Jobs to read now, ``unadmitted`` being those read and not handed to the engine."""
        room = self.engine.scheduler.room(LOOKAHEAD_STEPS)
        recent = self.recent or [self.seed]
        seqs = max(n.seqs for n in recent)
        blocks = max(n.blocks for n in recent)
        tokens = max(max(n.tokens for n in recent), 1)
        fits = min(room.seqs // seqs, room.blocks // blocks, room.tokens // tokens) - unadmitted
        if fits < 1 and not unadmitted and not self.engine.has_unfinished():
            return 1  # an empty engine starts any job it can ever run
        return max(fits, 0)
