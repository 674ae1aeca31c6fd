"""A request as the engine holds it, and the checks a prompt passes at admission."""

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from engine.beam_search import BeamGroup
from engine.detokenizer import Detokenizer
from engine.sampling_params import BeamSearchParams, SamplingParams
from engine.sequence import Sequence


@dataclass
class Resume:
    """Where a sample stopped when another worker ran it: its output tokens and how much of
    their text was handed out; None for a sample that had finished."""

    token_ids: list[int]
    emitted_chars: int


@dataclass
class Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: dict[int, Detokenizer]  # by seq_id
    num_samples: int  # the samples this engine runs: n, less those finished before a resume
    group: BeamGroup | None = None  # a beam search's state; its beams are not in seqs
    final_only: bool = False  # LLMEngine.add_request's: text read only once a sample finishes

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.num_samples and all(s.is_finished for s in self.seqs)


@dataclass
class Limits:
    """What bounds a request: the model's vocabulary and context, the KV pool, the slots."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int


def check_beam(beam: BeamSearchParams, params: SamplingParams | None,
               resume: list[Resume | None] | None, limits: Limits) -> None:
    if params is not None:
        what = (f"n={params.n}" if params.n > 1 else f"temperature={params.temperature}"
                if params.temperature > 0 else "SamplingParams")
        raise ValueError(f"beam search takes its parameters from BeamSearchParams (beam=); it "
                         f"does not combine with {what}")
    if beam.beam_width > limits.max_num_seqs:  # it would wait for its slots forever
        raise ValueError(f"beam_width={beam.beam_width} exceeds max_num_seqs="
                         f"{limits.max_num_seqs}")
    if resume is not None:
        raise ValueError("a beam search cannot resume: it restarts (it streamed nothing)")


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str | list[int],
               max_tokens: int | None, width: int, limits: Limits) -> tuple[list[int], int]:
    """The prompt's token ids and max_tokens (None: up to the context), once both are known to
    fit the model, and the pool with ``width`` sequences sharing the prompt."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < limits.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids outside the vocabulary [0, {limits.vocab_size}): "
                         f"{bad[:5]}")
    room = limits.max_model_len - len(ids)
    if room < 1:
        raise ValueError(f"the prompt has {len(ids)} tokens; this model's maximum context "
                         f"length is {limits.max_model_len}")
    max_tokens = max_tokens or room
    if max_tokens > room:
        raise ValueError(f"prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds "
                         f"the maximum context length {limits.max_model_len}")
    # The prompt's full blocks once, then each sequence's own blocks.
    bs = limits.block_size
    need = len(ids) // bs + width * -(-(len(ids) % bs + max_tokens) // bs)
    if need > limits.num_blocks:
        raise ValueError(f"{width} sequence(s) of {len(ids) + max_tokens} tokens need {need} KV "
                         f"blocks; the pool has {limits.num_blocks}")
    return ids, max_tokens
