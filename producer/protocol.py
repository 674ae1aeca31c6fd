"""The wire protocol, version 1: every Redis key pagedq uses and the JSON it stores there.

JSON only, never pickle: producers may be untrusted. Keys (``{q}`` a queue name, ``{id}`` a job
id):

- ``pagedq:queue:{q}``: the job stream. Each entry has one field, ``job``: a ``Job`` as JSON.
  Workers read it through the consumer group ``GROUP``.
- ``pagedq:results:{id}``: the job's result stream. Each entry has one field, ``event``: an
  ``Event`` as JSON. It expires ``result_ttl`` seconds after its last write.
- ``pagedq:cancel:{id}``: present (with a TTL) once the job is to be canceled.
- ``pagedq:cancels``: the cancel notices, one stream for every queue: an entry (field ``job``,
  the id) follows each cancel key set, so that busy workers learn of it without asking
  (``worker.service``); capped at about ``CANCELS_MAX_LEN`` entries.
- ``pagedq:dead:{q}``: the dead-letter stream: entries with ``job`` (the raw field as received),
  ``reason`` and ``deliveries``.
- ``pagedq:wake:{c}``: a client's wake-up stream (``c``: a random id per client): its reader
  blocks on it beside the result streams, and a new reader of a job is added by an entry there.
- ``rq:*``: the RQ mirror (see ``producer.rq_mirror``): a view for rq-dashboard, never read back.
"""

from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PROTOCOL_VERSION: Final = 1  # Final: its type is Literal[1], as Job.v's
GROUP = "workers"
PREFIX = "pagedq"
MAX_N = 64  # samples per job: more is refused as absurd
MAX_TOKENS = 1 << 20  # a hard ceiling; the worker also checks the model's context
CANCELS_KEY = f"{PREFIX}:cancels"
CANCELS_MAX_LEN = 1000  # notices are read as they land; old ones only wait for the trim


def explain(error: Exception) -> str:
    """A validation error (pydantic's, or FastAPI's of a request body) in one line:
    ``field: reason; ...``; any other error as its message."""
    errors = getattr(error, "errors", None)
    if not callable(errors):
        return str(error)
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'job'}: {e['msg']}"
                     for e in errors())


def queue_key(queue: str) -> str:
    return f"{PREFIX}:queue:{queue}"


def results_key(job_id: str) -> str:
    return f"{PREFIX}:results:{job_id}"


def cancel_key(job_id: str) -> str:
    return f"{PREFIX}:cancel:{job_id}"


def dead_key(queue: str) -> str:
    return f"{PREFIX}:dead:{queue}"


def wake_key(client_id: str) -> str:
    return f"{PREFIX}:wake:{client_id}"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Sampling(_Strict):
    """The engine's SamplingParams, with the same names, defaults and bounds."""

    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS)
    min_tokens: int = Field(0, ge=0)
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Beam search (beam_width >= 2): the engine's BeamSearchParams. The result holds the
    # beam_width best hypotheses as samples 0.. (best first), each `done` with its cum_logprob.
    beam_width: int = Field(1, ge=1, le=MAX_N)
    length_penalty: float = Field(1.0, allow_inf_nan=False)
    early_stopping: bool | Literal["never"] = False

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value  # as SamplingParams accepts

    @model_validator(mode="after")
    def _min_le_max(self) -> "Sampling":
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                             f"({self.max_tokens})")
        # A job always carries a temperature (1.0 unless set), so only another one is refused.
        if self.beam_width > 1 and (self.n > 1 or self.max_tokens is None
                                    or self.temperature not in (0.0, 1.0)):
            raise ValueError("beam search (beam_width > 1) ranks beam_width sequences itself: "
                             "it takes neither n > 1 nor a sampling temperature (leave it at "
                             "its default or 0), and needs max_tokens")
        return self


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class Job(_Strict):
    """A generation job: exactly one of ``prompt`` (text or token ids) and ``messages`` (a chat,
    rendered with the model's chat template by the worker)."""

    v: Literal[1] = PROTOCOL_VERSION
    # RQ's own job-id rule: its started registry splits "{id}:{execution}" on ":"
    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")
    queue: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$")  # RQ joins names with ","
    prompt: str | list[Annotated[int, Field(ge=0)]] | None = None
    messages: list[ChatMessage] | None = None
    sampling: Sampling = Field(default_factory=Sampling)
    priority: int = 0  # lower runs first, as in vLLM
    deadline: float | None = None  # unix time; past it the job ends with finish reason "deadline"
    created_at: float = 0.0

    @model_validator(mode="after")
    def _one_prompt(self) -> "Job":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.prompt is not None and len(self.prompt) == 0:
            raise ValueError("the prompt is empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        return self


class Usage(_Strict):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Chunk(_Strict):
    """New tokens of one sample. ``seq`` counts the sample's chunks from 0, across workers: a
    reader that saw chunk k of a sample never sees another chunk k of it."""

    type: Literal["chunk"] = "chunk"
    sample: int
    seq: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    # with logprobs: the text of each token id named in token_ids and logprobs, decoded alone
    # (vLLM's logprob tokens), so that readers without the tokenizer can show them
    tokens: dict[int, str] | None = None


class Done(_Strict):
    """One sample finished: ``stop``, ``length``, ``abort`` (canceled) or ``deadline``."""

    type: Literal["done"] = "done"
    sample: int
    finish_reason: str
    usage: Usage
    cum_logprob: float | None = None  # beam search: the hypothesis' summed logprob


class End(_Strict):
    """The job finished; the last event of a job that did not fail."""

    type: Literal["end"] = "end"
    usage: Usage


class Error(_Strict):
    """The job failed; the last event of its stream."""

    type: Literal["error"] = "error"
    code: str  # "invalid_job", "invalid_request", "dead_letter", "internal"
    message: str


Event = Annotated[Chunk | Done | End | Error, Field(discriminator="type")]
EVENT_FIELD = "event"
JOB_FIELD = "job"
