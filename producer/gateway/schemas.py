"""OpenAI's request bodies for ``/v1/completions`` and ``/v1/chat/completions``, with vLLM's
extra sampling parameters, and their translation into pagedq jobs (``Client.submit``'s
keywords).

Decisions, as vLLM's server does:
- Unknown fields are ignored (OpenAI's SDKs send fields a local server has no use for, such as
  ``store`` or ``service_tier``); fields pagedq cannot honour when set (``echo``, ``suffix``,
  ``logit_bias``, ``best_of`` > ``n``, ``tools``, non-text message parts) get a 400.
- ``max_tokens`` defaults to 16 on completions (OpenAI's and vLLM's default) and to "until the
  end of the context" on chat; ``max_completion_tokens`` wins over ``max_tokens``.
- A prompt list (strings or token-id lists) becomes one job per prompt; choice ``i * n + j`` is
  sample ``j`` of prompt ``i``, as OpenAI numbers them.
- Beam search as vLLM's server takes it: ``use_beam_search`` with ``n`` the beam width (each of
  the ``n`` best hypotheses is a choice, best first), ``length_penalty`` and ``early_stopping``
  (ignored without ``use_beam_search``, as vLLM does); ``beam_width`` (pagedq's job field) is
  accepted instead of ``use_beam_search`` + ``n``. Nothing streams before the search ends: a
  streamed beam search sends every choice's text at the end.
- The ``developer`` role is sent as ``system``: pagedq's chat templates know the three classic
  roles only.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..core import new_job
from ..protocol import MAX_N, explain

PromptIds = list[Annotated[int, Field(ge=0)]]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    # vLLM's extra parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    priority: int = 0
    use_beam_search: bool = False
    beam_width: int | None = Field(None, ge=1, le=MAX_N)
    length_penalty: float = Field(1.0, allow_inf_nan=False)
    early_stopping: bool | Literal["never"] = False

    @model_validator(mode="after")
    def _unsupported(self) -> "_Request":
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.beam_width is not None:  # pagedq's name: n beams returned
            if self.n not in (1, self.beam_width):
                raise ValueError("beam_width sets n: leave n out or equal to it")
            self.use_beam_search, self.n = True, self.beam_width
        return self

    def _search(self) -> dict[str, Any]:
        """The job's beam search fields (n beams, one job), or nothing."""
        if not self.use_beam_search:
            return {"n": self.n}
        return {"n": 1, "beam_width": self.n, "length_penalty": self.length_penalty,
                "early_stopping": self.early_stopping}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and (self.stream_options or {}).get("include_usage"))

    def _logprobs(self) -> int | None:
        raise NotImplementedError

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling(self) -> dict[str, Any]:
        """The job's sampling keywords; absent ones keep SamplingParams' defaults."""
        given = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                 "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
                 "presence_penalty": self.presence_penalty, "seed": self.seed,
                 "frequency_penalty": self.frequency_penalty,
                 "stop_token_ids": self.stop_token_ids, "logprobs": self._logprobs()}
        return {**self._search(), "max_tokens": self._max_tokens(), "stop": self.stop or [],
                "min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
                "skip_special_tokens": self.skip_special_tokens,
                "include_stop_str_in_output": self.include_stop_str_in_output,
                **{k: v for k, v in given.items() if v is not None}}

    def prompts(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def specs(self) -> list[dict[str, Any]]:
        """``Client.submit_many``'s specs: one job per prompt."""
        return [{**prompt, **self.sampling(), "priority": self.priority}
                for prompt in self.prompts()]


class CompletionRequest(_Request):
    prompt: str | list[str] | PromptIds | list[PromptIds]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _completion_only(self) -> "CompletionRequest":
        if self.echo or self.suffix:
            raise ValueError("echo and suffix are not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n: pagedq returns every sample")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is empty")
        return self

    def _logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[dict[str, Any]]:
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [{"prompt": prompt}]
        return [{"prompt": p} for p in prompt]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def wire(self) -> dict[str, str]:
        content = self.content or ""
        text = content if isinstance(content, str) else "".join(p.text for p in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None

    @model_validator(mode="after")
    def _chat_only(self) -> "ChatCompletionRequest":
        if self.tools:
            raise ValueError("tools are not supported")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def prompts(self) -> list[dict[str, Any]]:
        return [{"messages": [m.wire() for m in self.messages]}]


ENDPOINTS: dict[str, type[_Request]] = {"/v1/completions": CompletionRequest,
                                        "/v1/chat/completions": ChatCompletionRequest}
Request = CompletionRequest | ChatCompletionRequest


class BatchLine(BaseModel):
    """One line of an OpenAI batch input file."""

    custom_id: str = Field(min_length=1)
    method: Literal["POST"]
    url: Literal["/v1/completions", "/v1/chat/completions"]
    body: dict[str, Any]

    def request(self) -> Request:
        request = ENDPOINTS[self.url].model_validate(self.body)
        if request.stream:
            raise ValueError("stream is not supported in a batch")
        return request  # type: ignore[return-value]


def parse_batch(content: str, endpoint: str) -> tuple[list[tuple[str, Request]],
                                                      list[dict[str, Any]]]:
    """The lines of a batch input file as ``(custom_id, request)``, and OpenAI's error entries
    (``code``, ``message``, ``param``, ``line`` from 1) for every bad one: each line must be a
    request to ``endpoint`` that makes valid jobs, with a ``custom_id`` of its own."""
    lines: list[tuple[str, Request]] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, text in enumerate(content.splitlines(), 1):
        if not text.strip():
            continue
        try:
            line = BatchLine.model_validate_json(text)
            if line.url != endpoint:
                raise ValueError(f"url {line.url} is not the batch's endpoint {endpoint}")
            if line.custom_id in seen:
                raise ValueError(f"custom_id {line.custom_id!r} is not unique")
            request = line.request()
            for spec in request.specs():
                new_job("check", **spec)
        except ValueError as exc:  # pydantic's ValidationError and InvalidJob are ValueErrors
            errors.append({"code": "invalid_request", "message": explain(exc), "param": None,
                           "line": number})
            continue
        seen.add(line.custom_id)
        lines.append((line.custom_id, request))
    return lines, errors
