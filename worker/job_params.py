"""A job's ``sampling`` as the engine's parameters: ``SamplingParams``, or, for a beam search
(``beam_width`` >= 2), ``BeamSearchParams``. The protocol has already refused a beam job with
n > 1, a temperature > 0 or no max_tokens."""

from engine.sampling_params import BeamSearchParams, SamplingParams
from producer.protocol import Sampling

BEAM_FIELDS = {"beam_width", "length_penalty", "early_stopping"}


def engine_params(sampling: Sampling) -> tuple[SamplingParams, BeamSearchParams | None]:
    """The params each sequence runs under, and the beam search's (None: sampling). A beam
    search uses max_tokens, ignore_eos and include_stop_str_in_output of the other fields."""
    if sampling.beam_width < 2:
        return SamplingParams(**sampling.model_dump(exclude=BEAM_FIELDS)), None
    beam = BeamSearchParams(beam_width=sampling.beam_width, max_tokens=sampling.max_tokens,
                            ignore_eos=sampling.ignore_eos,
                            length_penalty=sampling.length_penalty,
                            early_stopping=sampling.early_stopping,
                            include_stop_str_in_output=sampling.include_stop_str_in_output)
    return beam.sampling_params(), beam
