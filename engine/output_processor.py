"""A step's sampled tokens into its sequences and out as deltas: stop checks, text, finished
requests (vLLM v1's ``OutputProcessor``)."""

from engine.async_step import Launched, take_token
from engine.outputs import RequestDelta, SampleDelta
from engine.request import Request
from engine.scheduler import Scheduler
from engine.sequence import Sequence


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, requests: dict[str, Request],
                 eos_token_ids: set[int], max_model_len: int) -> None:
        self.scheduler = scheduler
        self.requests = requests  # the engine's, by request id
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.tokens_generated = 0  # by sampling (beam searches count their own)

    def length_done(self, seq: Sequence) -> bool:
        """Whether the sequence has all the tokens it may have (max_tokens None: up to the
        context)."""
        max_tokens = seq.params.max_tokens
        return ((max_tokens is not None and seq.num_output_tokens >= max_tokens)
                or len(seq) >= self.max_model_len)

    def read(self, launched: Launched) -> list[RequestDelta]:
        """A launched step's tokens into its sequences (waiting for them); its deltas, the
        beam searches it finished first."""
        results = launched.results
        deltas: dict[str, list[SampleDelta]] = {}
        if launched.sampled is not None:
            out = launched.sampled.read()
            for i, seq in enumerate(launched.sampled.seqs):
                if seq.is_finished:  # aborted, or stopped by a token read since the launch
                    continue
                deltas.setdefault(seq.request_id, []).append(
                    self._append(seq, out.token_ids[i], out.logprobs[i]))
        for request_id, samples in deltas.items():
            # a request finishes on a step one of its samples does
            finished = (any(sample.finish_reason for sample in samples)
                        and self.requests[request_id].finished)
            if finished:
                del self.requests[request_id]
            results.append(RequestDelta(request_id, samples, finished))
        return results

    def _append(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> SampleDelta:
        take_token(seq, token)
        self.tokens_generated += 1
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        params = seq.params
        reason = None
        if (token in params.stop_token_ids
                or (not params.ignore_eos and token in self.eos_token_ids)):
            reason = "stop"
        elif self.length_done(seq):
            reason = "length"
        detokenizer = self.requests[seq.request_id].detokenizers[seq.seq_id]
        if detokenizer.add([token]):
            reason = "stop"
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return SampleDelta(seq.index, [token], detokenizer.pop_delta(finished=reason is not None),
                           [logprobs] if logprobs is not None else None, reason)
