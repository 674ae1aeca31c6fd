"""What the engine returns: per-step deltas (the step API) and whole results (``LLM``)."""

from dataclasses import dataclass, field


@dataclass
class SampleDelta:
    """One sample's progress in one engine step."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    cum_logprob: float | None = None  # beam search: the hypothesis' summed logprob

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestDelta:
    request_id: str
    samples: list[SampleDelta]
    finished: bool  # every sample of the request has finished


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0


@dataclass
class BeamSearchSequence:
    """One ranked hypothesis of a beam search, as vLLM's: ``tokens`` is prompt + output."""

    tokens: list[int]
    logprobs: list[dict[int, float]]
    cum_logprob: float
    text: str
    finish_reason: str | None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first
