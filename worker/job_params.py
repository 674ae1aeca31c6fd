"""A job as the engine's inputs: its prompt as token ids, and its ``sampling`` as the engine's
parameters: ``SamplingParams``, or, for a beam search (``beam_width`` >= 2),
``BeamSearchParams``. The protocol has already refused a beam job with n > 1, a temperature > 0
or no max_tokens."""

from collections.abc import Mapping
from typing import cast

from transformers import PreTrainedTokenizerBase

from engine.sampling_params import BeamSearchParams, SamplingParams
from producer.protocol import Job, Sampling

BEAM_FIELDS = {"beam_width", "length_penalty", "early_stopping"}


def engine_params(sampling: Sampling) -> tuple[SamplingParams, BeamSearchParams | None]:
    """The params each sequence runs under, and the beam search's (None: sampling). A beam
    search uses max_tokens, ignore_eos and include_stop_str_in_output of the other fields."""
    if sampling.beam_width < 2:
        return SamplingParams(**sampling.model_dump(exclude=BEAM_FIELDS)), None
    if sampling.max_tokens is None:  # Sampling's validator requires it with beam_width > 1
        raise ValueError("beam search needs max_tokens")
    beam = BeamSearchParams(beam_width=sampling.beam_width, max_tokens=sampling.max_tokens,
                            ignore_eos=sampling.ignore_eos,
                            length_penalty=sampling.length_penalty,
                            early_stopping=sampling.early_stopping,
                            include_stop_str_in_output=sampling.include_stop_str_in_output)
    return beam.sampling_params(), beam


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, job: Job) -> list[int]:
    """The job's prompt as token ids: chat messages through the model's chat template."""
    if job.messages is not None:
        chat = [m.model_dump() for m in job.messages]
        encoded = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)
        return list(cast(Mapping[str, list[int]], encoded)["input_ids"])
    if job.prompt is None:  # Job's validator requires a prompt or messages
        raise ValueError("a job needs a prompt or messages")
    return tokenizer.encode(job.prompt) if isinstance(job.prompt, str) else list(job.prompt)
