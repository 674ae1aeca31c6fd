"""``LLM``: the offline facade, as in vLLM."""

from collections.abc import Sequence as Seq
from itertools import count
from typing import Any

from tqdm import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = count()

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for every prompt (text or token ids) and returns the outputs in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        engine = self.engine
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for request_id, prompt, p in zip(ids, prompts, params, strict=True):
                engine.add_request(request_id, prompt, p)
                added.append(request_id)
        except ValueError:
            for request_id in added:  # all or nothing: leave the engine as it was
                engine.abort(request_id)
            raise
        requests = {i: engine.requests[i] for i in ids}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
            while engine.has_unfinished():
                bar.update(sum(d.finished for d in engine.step()))
        return [self._output(request_id, requests[request_id]) for request_id in ids]

    def _output(self, request_id: str, request: Any) -> RequestOutput:
        outputs = [CompletionOutput(seq.index, request.detokenizers[seq.seq_id].text,
                                    seq.output_token_ids, seq.finish_reason,
                                    seq.logprobs if seq.params.logprobs is not None else None)
                   for seq in sorted(request.seqs, key=lambda s: s.index)]
        return RequestOutput(request_id, request.prompt_token_ids, outputs,
                             request.seqs[0].num_cached_tokens)

    def stats(self) -> dict[str, float | str]:
        return self.engine.stats()
