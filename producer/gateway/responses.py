"""OpenAI's response bodies and stream chunks, built from pagedq's results and events.

Decisions:
- Tokens in ``logprobs`` are named ``token_id:{id}``, the format of vLLM's
  ``--return-tokens-as-token-ids``: the gateway holds no tokenizer (the producer side never
  imports transformers), and a token id is exact where a decoded piece of a multi-byte
  character is not. ``text_offset`` and ``bytes`` are null for the same reason.
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


def token_name(token_id: int) -> str:
    return f"token_id:{token_id}"


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
        self.top = (request.top_logprobs or 0) if self.chat else None

    @property
    def object_id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.id}"

    def job_ids(self, count: int) -> list[str]:
        """The ids of the request's jobs: one per prompt."""
        return [f"{self.id}-{i}" for i in range(count)]

    def logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None
                 ) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        if self.chat:
            return {"content": [
                {"token": token_name(t), "logprob": lp[t], "bytes": None,
                 "top_logprobs": [{"token": token_name(k), "logprob": v, "bytes": None}
                                  for k, v in list(lp.items())[:self.top]]}
                for t, lp in zip(token_ids, logprobs, strict=True)], "refusal": None}
        return {"tokens": [token_name(t) for t in token_ids],
                "token_logprobs": [lp[t] for t, lp in zip(token_ids, logprobs, strict=True)],
                "top_logprobs": [{token_name(k): v for k, v in lp.items()} for lp in logprobs],
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
                                self.logprobs(out.token_ids, out.logprobs),
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
                                  self.logprobs(event.token_ids, event.logprobs), None,
                                  delta=True)
        return self._envelope([choice], chunk=True)

    def usage_chunk(self, usages: list[Usage]) -> dict[str, Any]:
        return self._envelope([], chunk=True) | {"usage": usage_body(usages)}
