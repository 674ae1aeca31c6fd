"""Which side of a greedy divergence transformers takes (benchmarks/peers.py's report).

pagedq and vLLM compute the same float32 arithmetic and agree token for token on nearly every
run: throughput.py's random-26m round 1 of session 59 gave vLLM 115/128 and 110/128 against
pagedq's same-round run, where the same prompts had agreed 128/128 in round 0 and did again in
six later processes of each (two calls each). The table then left open which engine moved, so
pagedq's later rounds are held to its round 0 (the same prompts), and the report keeps the
diverging requests (``Divergence``, up to ``MAX_CASES`` a run and call: peers.py) and asks
transformers, the reference of pagedq's parity tests, for each: ``transformers`` greedy, batch
1, from the same prompt, and how many leading tokens each side shares with it. Greedy requests
only: sampled ones agree by chance.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import log, shared_prefix

MAX_CASES = 4


@dataclass
class Divergence:
    """One request on which a system's tokens left pagedq's reference run's."""

    system: str
    round: int
    call: int
    request: int
    prompt: list[int]
    reference: list[int]  # pagedq's (its round 0's for pagedq's later rounds)
    other: list[int]


def adjudicate(model: Path, dtype: str, cases: list[Divergence]) -> list[dict[str, Any]]:
    """Per case, the leading tokens pagedq's reference and the other run share with
    transformers' greedy tokens, and which side is closer; printed and returned."""
    if not cases:
        return []
    from hf_runs import load_hf, static_batch

    hf = load_hf(model, argparse.Namespace(dtype=dtype, device="cpu"))
    verdicts = []
    for case in cases:
        ref = static_batch(hf, [case.prompt], len(case.reference))[0]
        ours, theirs = shared_prefix(ref, case.reference), shared_prefix(ref, case.other)
        closer = ("reference" if ours > theirs else case.system if theirs > ours else "neither")
        verdicts.append({"system": case.system, "round": case.round, "call": case.call,
                         "request": case.request, "tokens": len(ref),
                         "reference_agrees": ours, "other_agrees": theirs, "closer": closer})
        log(f"divergence {case.system} round {case.round} call {case.call} request "
            f"{case.request}: transformers shares {ours}/{len(ref)} tokens with pagedq's "
            f"reference, {theirs} with {case.system}'s")
    return verdicts

