"""Sampling parameters, validated at construction as vLLM's are."""

import math
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    seed: int | None = None
    logprobs: int | None = None  # top-k logprobs per token, plus the chosen one
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1 or 0 (off) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0,
             f"repetition_penalty must be positive, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.logprobs is None or self.logprobs >= 0,
             f"logprobs must be non-negative, got {self.logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be non-negative integers"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """A repetition, presence or frequency penalty: sampling reads the tokens so far."""
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0)


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters, plus transformers' ``early_stopping``.

    Scoring follows transformers' ``generate(num_beams=...)``: a finished hypothesis scores
    ``cum_logprob / generated_len ** length_penalty`` (vLLM divides by prompt + output length
    instead; transformers' rule is the one the parity tests hold us to). ``early_stopping``:
    True stops once ``beam_width`` hypotheses are finished; False (transformers' default) stops
    once the best running beam, scored at its current length, cannot beat the worst finished
    one; "never" scores it at ``max_tokens`` when ``length_penalty`` > 0. ``temperature`` > 0
    divides the logits before the log-softmax, as vLLM's ``beam_search`` does; 0 leaves them.
    ``beam_width`` 1 is greedy search whatever ``early_stopping``, as in transformers.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | Literal["never"] = False

    def __post_init__(self) -> None:
        checks = [
            (isinstance(self.beam_width, int) and self.beam_width >= 1,
             f"beam_width must be an integer of at least 1, got {self.beam_width!r}"),
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             f"max_tokens must be an integer of at least 1, got {self.max_tokens!r}"),
            (self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}"),
            (math.isfinite(self.length_penalty),
             f"length_penalty must be a finite number, got {self.length_penalty}"),
            (self.early_stopping in (True, False, "never"),
             f"early_stopping must be True, False or 'never', got {self.early_stopping!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def sampling_params(self) -> SamplingParams:
        """What each beam runs under: one token per step, chosen by the beam search."""
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos,
                              include_stop_str_in_output=self.include_stop_str_in_output)
