"""pagedq's engine: continuous batching over a paged KV cache, vLLM's API."""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    RequestDelta,
    RequestOutput,
    SampleDelta,
)
from engine.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence",
           "CompletionOutput", "EngineConfig", "LLMEngine", "RequestDelta", "RequestOutput",
           "SampleDelta", "SamplingParams"]
