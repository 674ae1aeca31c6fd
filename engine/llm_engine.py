"""The step API that the worker drives: add requests, step, abort, stats."""

import dataclasses
import math
import time
from collections.abc import Iterable
from pathlib import Path

import structlog
import torch
from transformers import AutoTokenizer

from engine.async_step import Launched, can_overlap, defer
from engine.beam_search import BeamSearcher
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import Detokenizer, decode
from engine.loader import eos_token_ids, load_config
from engine.model_runner import ModelRunner, fit_kv_blocks
from engine.output_processor import OutputProcessor
from engine.outputs import RequestDelta, SampleDelta
from engine.quantization import checkpoint_quantization
from engine.request import Limits, Request, Resume, check_beam, prompt_ids
from engine.sampled import Sampled
from engine.sampler import Sampler, skip_draws
from engine.sampling_params import BeamSearchParams, SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.transfer import rows_on

log = structlog.get_logger()
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.model:
            path = Path(config.model)
        else:
            from engine.default_model import default_model_path  # converts on first use

            path = default_model_path()
        hf_config = load_config(path)
        self.quantization = checkpoint_quantization(hf_config, config.quantization)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.device = torch.device(config.device if config.device != "auto" else
                                   "cuda" if torch.cuda.is_available() else "cpu")
        dtype = _DTYPES.get(config.dtype) or (
            torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        limits = [hf_config.max_position_embeddings, getattr(hf_config, "sliding_window", None)
                  or math.inf, config.max_model_len or math.inf]
        self.max_model_len = int(min(limits))
        self.vocab_size = hf_config.vocab_size
        torch.manual_seed(config.seed)  # the draws of requests without a seed of their own
        self.model_runner = ModelRunner(
            path, hf_config, max_model_len=self.max_model_len, block_size=config.block_size,
            num_kv_blocks=config.num_kv_blocks or (
                lambda: fit_kv_blocks(config, hf_config, dtype, self.device, self.max_model_len)),
            dtype=dtype, device=self.device,
            cuda_graph_max_batch=0 if config.enforce_eager else config.max_num_seqs,
            kv_cache_dtype=config.kv_cache_dtype, calculate_kv_scales=config.calculate_kv_scales,
            reserve_kv_cache=config.reserve_kv_cache)
        num_blocks = self.model_runner.num_kv_blocks
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        self.eos_token_ids = eos_token_ids(path, self.tokenizer)
        self.sampler = Sampler(self.eos_token_ids)
        self.beam_search = BeamSearcher(self.scheduler, self.tokenizer, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.limits = Limits(self.vocab_size, self.max_model_len, config.block_size, num_blocks,
                             config.max_num_seqs)
        self.output = OutputProcessor(self.scheduler, self.requests, self.eos_token_ids,
                                      self.max_model_len)
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.device.type == "cuda")
        self.inflight: Launched | None = None  # the step launched ahead (async scheduling)
        log.info("engine ready", model=str(path), device=str(self.device), dtype=str(dtype),
                 activations=str(self.model_runner.model.model.embed_tokens.weight.dtype),
                 quantization=self.quantization, kv_blocks=num_blocks,
                 block_size=config.block_size, max_model_len=self.max_model_len,
                 **({"cpu_attention": self.model_runner.attention_body}
                    if self.model_runner.attention_body else {}),
                 **({"cpu_linear_rows": self.model_runner.linear_rows,
                     "cpu_decode": "native" if self.model_runner.cpu_decode else "modules",
                     "greedy_head_rows": getattr(self.model_runner.greedy_head, "served", 0)}
                    if self.model_runner.linear_rows else {}))

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, priority: int = 0,
                    resume: list[Resume | None] | None = None,
                    beam: BeamSearchParams | None = None, final_only: bool = False) -> None:
        """Validates and queues a request; raises ValueError with the reason otherwise.

        ``final_only``: the caller reads each sample's text only once it finishes (vLLM's
        ``RequestOutputKind.FINAL_ONLY``, as ``LLM.generate``): its deltas then carry the text
        whole on the last one, decoded once (``Detokenizer``), not token by token.

        ``resume`` (one entry per sample) continues a request from the tokens each sample had
        already produced: they are recomputed as part of its prompt, a seeded sample's
        generator is advanced past its draws, and the text continues where it stopped.

        ``beam`` runs a beam search instead of sampling (``params`` stays None), batched with
        the sampling requests. It streams nothing: its one delta, finished, holds the ranked
        hypotheses as samples (index = rank, best first, with ``cum_logprob``)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if beam is not None:
            check_beam(beam, params, resume, self.limits)
            ids, max_tokens = prompt_ids(self.tokenizer, prompt, beam.max_tokens,
                                         beam.beam_width, self.limits)
            group = self.beam_search.add(request_id, ids, dataclasses.replace(
                beam, max_tokens=max_tokens), priority)
            self.requests[request_id] = Request(ids, group.members[0].params, [], {}, 0, group)
            return
        params = params or SamplingParams()
        ids, max_tokens = prompt_ids(self.tokenizer, prompt, params.max_tokens, 1, self.limits)
        if params.n > self.config.max_num_seqs:  # it would wait for n free slots forever
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        params = dataclasses.replace(params, max_tokens=max_tokens)
        if resume is not None and len(resume) != params.n:
            raise ValueError(f"resume has {len(resume)} entries for n={params.n} samples")
        if resume is not None and final_only:
            raise ValueError("a resumed request streams its text on from where it stopped: "
                             "final_only does not apply")
        request = Request(ids, params, [], {}, params.n, final_only=final_only)
        for index, state in enumerate(resume or [Resume([], 0)]):
            if state is None:
                request.num_samples -= 1
                continue
            seq = Sequence(request_id, ids, params, priority, time.monotonic(), index)
            detokenizer = Detokenizer(self.tokenizer, params, final_only)
            if resume is not None:
                seq.pending_forks = 0  # every sample is its own sequence from here on
                seq.token_ids += state.token_ids
                detokenizer.resume(state.token_ids, state.emitted_chars)
                if seq.generator is not None and not params.greedy:
                    skip_draws(seq.generator, len(state.token_ids))
            request.seqs.append(seq)
            request.detokenizers[seq.seq_id] = detokenizer
        if not request.seqs:
            raise ValueError("every sample of the resumed request had finished")
        self.requests[request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestDelta | None:
        """Stops a request now and frees its blocks; returns its last delta (what text was held
        back), or None for an unknown or finished id."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.group is not None:
            self.beam_search.abort(request.group)
            return RequestDelta(request_id, [], finished=True)
        samples = []
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                text = request.detokenizers[seq.seq_id].pop_delta(finished=True)
                samples.append(SampleDelta(seq.index, [], text, finish_reason="abort"))
        return RequestDelta(request_id, samples, finished=True)

    def token_texts(self, token_ids: Iterable[int]) -> dict[int, str]:
        """Each token's text decoded alone, as vLLM names logprob tokens (a piece of a
        multi-byte character reads U+FFFD): what a reader without the tokenizer shows."""
        return {t: decode(self.tokenizer, [t]) for t in set(token_ids)}

    def has_unfinished(self) -> bool:
        return self.inflight is not None or self.scheduler.has_unfinished()

    def has_waiting(self) -> bool:
        """Whether some request waits to start (or to resume, preempted)."""
        return bool(self.scheduler.waiting)

    def step(self) -> list[RequestDelta]:
        """Runs a step and returns its deltas. Under async scheduling (engine.async_step) a
        step is launched one call ahead: the next is launched before this one is read."""
        launched, self.inflight = self.inflight or self._launch(), None
        if launched is None:
            return []
        following = None
        if self.async_scheduling and can_overlap(launched, self.beam_search.num_live):
            following = self._launch(launched)
        results = self.output.read(launched)
        self.block_manager.record_use(self.scheduler.running)
        if following is not None:  # its blocks' tokens are all known now
            for seq in following.batch:
                if not seq.is_finished:
                    self.block_manager.register_computed(seq)
        self.inflight = following
        return results

    def _launch(self, after: Launched | None = None) -> Launched | None:
        """Schedules and queues a step; ``after``: the step before it, not read yet."""
        held = defer(after, self.output.length_done) if after is not None else set()
        batch = self.scheduler.schedule(held)
        if not batch.seqs:
            return None
        prev = after.sampled.tokens if after is not None and after.sampled else None
        sampled, hidden = self.model_runner.run(batch, prev)
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += num_new
            if after is None:
                self.block_manager.register_computed(seq)
        if sampled and self.sampler.argmax_only(sampled):
            tokens = self.model_runner.greedy_tokens(hidden)
            if tokens is not None:  # no logits computed: nothing reads them
                return Launched(batch.seqs, Sampled(tokens, None, sampled), [])
        logits = self.model_runner.logits(hidden)
        sampled, logits, results = self.beam_search.step(sampled, logits)
        for delta in results:
            del self.requests[delta.request_id]
        seqs = sampled
        if any(seq.pending_forks for seq in sampled):  # prompts computed: n samples part here
            logits, seqs = self._fork(sampled, logits)
        return Launched(batch.seqs, self.sampler.sample(logits, seqs) if seqs else None, results)

    def _fork(self, sampled: list[Sequence],
              logits: torch.Tensor) -> tuple[torch.Tensor, list[Sequence]]:
        """Each sampled sequence with its samples still to fork, followed by them, and the
        logits repeated to match."""
        rows, seqs = [], []
        for row, seq in enumerate(sampled):
            group = [seq]
            if seq.pending_forks:
                group += self.scheduler.fork(seq)
                request = self.requests[seq.request_id]
                for child in group[1:]:
                    request.seqs.append(child)
                    request.detokenizers[child.seq_id] = Detokenizer(
                        self.tokenizer, seq.params, request.final_only)
            rows += [row] * len(group)
            seqs += group
        return logits[rows_on(rows, logits.device)], seqs

    def stats(self) -> dict[str, float | str]:
        bm = self.block_manager
        held, blocks = bm.held_slots(self.scheduler.running)
        return {
            "quantization": self.quantization,
            "kv_cache_dtype": self.config.kv_cache_dtype,
            "kv_bytes_per_token": self.model_runner.kv_bytes_per_token,  # K and V, all layers
            "kv_blocks_total": len(bm.blocks),
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_peak": bm.peak_blocks,
            "kv_utilization": bm.utilization(held, blocks),
            "kv_utilization_at_peak": bm.utilization_at_peak,
            "tokens_in_cache": held,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "preemptions": self.scheduler.num_preemptions,
            "tokens_generated": (self.output.tokens_generated
                                 + self.beam_search.tokens_generated),
            "beam_searches": self.beam_search.num_finished,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        }
