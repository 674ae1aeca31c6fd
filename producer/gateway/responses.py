"""OpenAI's response bodies and stream chunks, built from pagedq's results and events.

Decisions:
- Tokens in ``logprobs`` are their text decoded alone, as vLLM's server shows them (a piece of
  a multi-byte character reads U+FFFD), with ``bytes`` its UTF-8. The gateway holds no tokenizer
  (the producer side never imports transformers): the worker sends each token's text with the
  logprobs (``Chunk.tokens``). An event without it (from an older worker) names the token
  ``token_id:{id}``, the format of vLLM's ``--return-tokens-as-token-ids``, with ``bytes``
  null. ``text_offset`` is null.
- Completions' ``top_logprobs`` hold what the engine returns: the top ``logprobs`` tokens plus
  the chosen one (vLLM's rule); chat's ``top_logprobs`` hold exactly ``top_logprobs`` entries.
- ``finish_reason`` is the engine's: ``stop``, ``length``, or ``abort`` (canceled) and
  ``deadline``, which OpenAI's API does not have and vLLM passes through as well.
"""

import time
import uuid
from typing import Any

from ..core import JobResult
from ..protocol import Chunk, Done, Usage
from .schemas import ChatCompletionRequest, Request


def _token(token_id: int, texts: dict[int, str] | None) -> tuple[str, list[int] | None]:
    """A logprob token's name and bytes."""
    if texts is None or token_id not in texts:
        return f"token_id:{token_id}", None
    return texts[token_id], list(texts[token_id].encode())


def usage_body(usages: list[Usage]) -> dict[str, int]:
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


class Formatter:
    """Shapes one request's answers: a whole body (``body``) or stream chunks (``role_chunks``,
    ``chunk``, ``finish``, ``usage_chunk``)."""

    def __init__(self, request: Request, request_id: str | None = None) -> None:
        self.request = request
        self.chat = isinstance(request, ChatCompletionRequest)
        self.id = request_id or uuid.uuid4().hex
        self.created = int(time.time())
        self.top = ((request.top_logprobs or 0) if isinstance(request, ChatCompletionRequest)
                    else None)

    @property
    def object_id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.id}"

    def job_ids(self, count: int) -> list[str]:
        """The ids of the request's jobs: one per prompt."""
        return [f"{self.id}-{i}" for i in range(count)]

    def logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                 texts: dict[int, str] | None) -> dict[str, Any] | None:
        """OpenAI's ``logprobs`` of a choice; ``texts``: each token id's text, where known."""
        if logprobs is None:
            return None
        if self.chat:
            def entry(token_id: int, logprob: float) -> dict[str, Any]:
                name, raw = _token(token_id, texts)
                return {"token": name, "logprob": logprob, "bytes": raw}
            return {"content": [
                entry(t, lp[t]) | {"top_logprobs": [entry(k, v)
                                                    for k, v in list(lp.items())[:self.top]]}
                for t, lp in zip(token_ids, logprobs, strict=True)], "refusal": None}
        return {"tokens": [_token(t, texts)[0] for t in token_ids],
                "token_logprobs": [lp[t] for t, lp in zip(token_ids, logprobs, strict=True)],
                "top_logprobs": [{_token(k, texts)[0]: v for k, v in lp.items()}
                                 for lp in logprobs],
                "text_offset": None}

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        return {"id": self.object_id, "object": kind, "created": self.created,
                "model": self.request.model, "choices": choices}

    def _choice(self, index: int, text: str, logprobs: dict[str, Any] | None,
                finish_reason: str | None, delta: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if not self.chat:
            choice["text"] = text
        elif delta:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        return choice | {"logprobs": logprobs, "finish_reason": finish_reason}

    def body(self, results: list[JobResult]) -> dict[str, Any]:
        """The whole response of a request whose jobs (one per prompt) have ended."""
        n = self.request.n
        choices = [self._choice(i * n + out.index, out.text,
                                self.logprobs(out.token_ids, out.logprobs, out.tokens),
                                out.finish_reason, delta=False)
                   for i, result in enumerate(results) for out in result.outputs]
        usages = [r.usage for r in results if r.usage is not None]
        return self._envelope(choices, chunk=False) | {"usage": usage_body(usages)}

    def role_chunks(self, prompts: int) -> list[dict[str, Any]]:
        """Chat streams open each choice with the assistant role, as OpenAI's do."""
        if not self.chat:
            return []
        return [self._envelope([{"index": i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}], chunk=True)
                for i in range(prompts * self.request.n)]

    def chunk(self, prompt: int, event: Chunk | Done) -> dict[str, Any]:
        index = prompt * self.request.n + event.sample
        if isinstance(event, Done):
            choice = self._choice(index, "", None, event.finish_reason, delta=True)
        else:
            choice = self._choice(index, event.text,
                                  self.logprobs(event.token_ids, event.logprobs, event.tokens),
                                  None,
                                  delta=True)
        return self._envelope([choice], chunk=True)

    def usage_chunk(self, usages: list[Usage]) -> dict[str, Any]:
        return self._envelope([], chunk=True) | {"usage": usage_body(usages)}
