"""A sequence: one sample of one request, with its KV block table."""

from enum import Enum, auto
from itertools import count
from typing import TYPE_CHECKING

import torch

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.beam_search import BeamGroup


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 0, arrival: float = 0.0, index: int = 0) -> None:
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.index = index  # which of the request's n samples
        self.params = params
        self.priority = priority
        self.arrival = arrival
        self.status = SequenceStatus.WAITING
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, taken from the prefix cache at admission
        self.block_table: list[int] = []
        self.finish_reason: str | None = None
        self.logprobs: list[dict[int, float]] = []
        # Requests with n > 1 prefill once, then fork into n samples (see Scheduler).
        self.pending_forks = params.n - 1 if index == 0 else 0
        self.group: BeamGroup | None = None  # the beam search this sequence is part of
        # Async scheduling (engine.async_step): while a step that sampled this sequence's last
        # token runs, ``token_ids`` ends with a placeholder and this is the token's row among
        # that step's sampled tokens
        self.pending_row: int | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            # Each sample draws from its own stream, so its output never depends on the batch.
            self.generator = torch.Generator().manual_seed(params.seed * 1_000_003 + index)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_slots(self) -> int:
        """The sequence slots this waiting sequence takes once it runs: its samples or beams."""
        return self.group.width if self.group is not None else self.pending_forks + 1

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def fork(self, index: int) -> "Sequence":
        """A new sample (or beam) sharing this sequence's tokens; the block table is forked by
        the BlockManager."""
        child = Sequence(self.request_id, self.prompt_token_ids, self.params, self.priority,
                         self.arrival, index)
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        child.logprobs = list(self.logprobs)
        child.group = self.group
        return child
