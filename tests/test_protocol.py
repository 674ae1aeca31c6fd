"""The wire models (producer.protocol): sampling fields agree with the engine's
SamplingParams, the caps the wire adds, and bad jobs refused with the reason."""

import math

import pytest
from pydantic import ValidationError

from producer import Sampling
from producer.protocol import MAX_N, MAX_TOKENS, Job

# (sampling keywords, accepted?) — the engine's SamplingParams must agree on every row
SAMPLING_TABLE = [
    ({}, True), ({"n": MAX_N}, True), ({"temperature": 0}, True), ({"temperature": math.inf}, True),
    ({"top_p": 1}, True), ({"top_k": -1}, True), ({"top_k": 50}, True), ({"min_p": 1}, True),
    ({"repetition_penalty": 0.5}, True), ({"presence_penalty": -2}, True),
    ({"frequency_penalty": 2}, True), ({"max_tokens": None}, True), ({"max_tokens": 1}, True),
    ({"min_tokens": 5, "max_tokens": 5}, True), ({"stop": "x"}, True), ({"stop": ["a", "b"]}, True),
    ({"stop_token_ids": [0, 2]}, True), ({"seed": 3}, True), ({"logprobs": 0}, True),
    ({"n": 0}, False), ({"temperature": -0.1}, False), ({"temperature": math.nan}, False),
    ({"top_p": 0}, False), ({"top_p": 1.5}, False), ({"top_k": -2}, False),
    ({"min_p": -0.1}, False), ({"min_p": 1.1}, False), ({"repetition_penalty": 0}, False),
    ({"presence_penalty": 2.5}, False), ({"frequency_penalty": -3}, False),
    ({"max_tokens": 0}, False), ({"min_tokens": -1}, False),
    ({"min_tokens": 6, "max_tokens": 5}, False), ({"stop": [""]}, False), ({"stop": ""}, False),
    ({"stop_token_ids": [-1]}, False), ({"logprobs": -1}, False),
]


@pytest.mark.parametrize(("kwargs", "ok"), SAMPLING_TABLE, ids=lambda v: str(v))
def test_sampling_accepts_and_rejects_what_the_engine_does(kwargs: dict, ok: bool) -> None:
    from engine.sampling_params import SamplingParams  # imported here: engine/__init__ has torch

    for make in (SamplingParams, Sampling):
        if ok:
            make(**kwargs)
        else:
            with pytest.raises(ValueError):
                make(**kwargs)


def test_wire_caps_beyond_the_engine() -> None:
    """Documented differences: the wire refuses absurd sizes the engine would take."""
    for kwargs, field in [({"n": MAX_N + 1}, "n"), ({"logprobs": 21}, "logprobs"),
                          ({"max_tokens": MAX_TOKENS + 1}, "max_tokens")]:
        with pytest.raises(ValidationError, match=field):
            Sampling(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "exactly one of prompt and messages"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one"),
    ({"prompt": ""}, "the prompt is empty"),
    ({"prompt": [1, -2]}, "greater than or equal to 0"),
    ({"messages": []}, "messages is empty"),
    ({"messages": [{"role": "robot", "content": "b"}]}, "role"),
    ({"prompt": "a", "id": "has:colon"}, "pattern"),
    ({"prompt": "a", "queue": "a,b"}, "pattern"),
    ({"prompt": "a", "sampling": {"temperature": -1}}, "temperature"),
    ({"prompt": "a", "sampling": {"tempreature": 1}}, "tempreature"),
])
def test_bad_jobs_are_refused_with_the_reason(kwargs: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Job(**{"id": "j1", **kwargs})
