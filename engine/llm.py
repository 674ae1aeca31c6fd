"""``LLM``: the offline facade, as in vLLM."""

import gc
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from itertools import count
from typing import Any, cast

from tqdm import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    RequestOutput,
)
from engine.sampling_params import BeamSearchParams, SamplingParams


@contextmanager
def heap_frozen() -> Iterator[None]:
    """The objects alive when a run starts kept out of the garbage collector's sight until it
    ends (``gc.freeze``, undone by ``gc.unfreeze``), unless the process froze some itself.

    Why: loading leaves ~420k long-lived objects (the tokenizer's, the model's, torch's), and a
    full collection mid-run walked them for 205 ms (random-26m's 128 requests, 21 s). vLLM's
    engine core freezes its heap once after start-up; ``LLM`` runs in its host's process, so it
    freezes only for the run and hands every object back to the collector after it (a freeze
    and an unfreeze each splice lists: no walk)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = count()

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for every prompt (text or token ids) and returns the outputs in order."""
        one = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        batch = cast(Seq[str | list[int]], [prompts] if one else prompts)
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(batch)
        if len(params) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(params)} SamplingParams")
        engine = self.engine
        ids = self._add([(f"llm-{next(self._ids)}", prompt, {"params": p, "final_only": True})
                         for prompt, p in zip(batch, params, strict=True)])
        requests = {i: engine.requests[i] for i in ids}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar, heap_frozen():
            while engine.has_unfinished():
                bar.update(sum(d.finished for d in engine.step()))
        return [self._output(request_id, requests[request_id]) for request_id in ids]

    def beam_search(self, prompts: str | list[int] | dict | Seq[str | list[int] | dict],
                    params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: one output per prompt, in order, each with the
        ``beam_width`` best hypotheses, best first. Prompts as ``generate`` takes them, or
        vLLM's ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``. Every prompt's beams run
        in the core together, as one continuous batch."""
        one = isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int))
        texts = [self._prompt(p) for p in
                 cast(Seq[str | list[int] | dict], [prompts] if one else prompts)]
        ids = self._add([(f"llm-{next(self._ids)}", p, {"beam": params}) for p in texts])
        finished = {}
        with (tqdm(total=len(ids), desc="beam search", disable=not use_tqdm) as bar,
              heap_frozen()):
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    finished[delta.request_id] = delta
                    bar.update(delta.finished)
        outputs = []
        for request_id, prompt in zip(ids, texts, strict=True):
            head = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            # a beam search's samples carry their logprobs and score (BeamSearcher._result)
            outputs.append(BeamSearchOutput([
                BeamSearchSequence(head + s.token_ids, cast(list[dict[int, float]], s.logprobs),
                                   cast(float, s.cum_logprob), s.text, s.finish_reason)
                for s in finished[request_id].samples]))
        return outputs

    @staticmethod
    def _prompt(prompt: str | list[int] | dict) -> str | list[int]:
        if not isinstance(prompt, dict):
            return prompt
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got {prompt}")

    def _add(self, requests: list[tuple[str, str | list[int], dict[str, Any]]]) -> list[str]:
        """Adds every request or, on a bad one, none (the engine is left as it was)."""
        added = []
        try:
            for request_id, prompt, kwargs in requests:
                self.engine.add_request(request_id, prompt, **kwargs)
                added.append(request_id)
        except ValueError:
            for request_id in added:
                self.engine.abort(request_id)
            raise
        return added

    def _output(self, request_id: str, request: Any) -> RequestOutput:
        outputs = [CompletionOutput(seq.index, request.detokenizers[seq.seq_id].text,
                                    seq.output_token_ids, seq.finish_reason,
                                    seq.logprobs if seq.params.logprobs is not None else None)
                   for seq in sorted(request.seqs, key=lambda s: s.index)]
        return RequestOutput(request_id, request.prompt_token_ids, outputs,
                             request.seqs[0].num_cached_tokens)

    def stats(self) -> dict[str, float | str]:
        return self.engine.stats()
