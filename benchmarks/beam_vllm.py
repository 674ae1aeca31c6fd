"""vLLM's ``LLM.beam_search`` on one spec, for benchmarks/beam.py: run with the vLLM venv's
interpreter, so it imports vllm and the standard library only (never pagedq).

    VENV/bin/python benchmarks/beam_vllm.py SPEC.json RESULT.json

Writes the timed call's wall seconds and each request's beams, best first, as
(prompt + output tokens, cum_logprob).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# benchmarks/queue.py would shadow the standard library's queue (vllm imports it).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import torch
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    torch.set_num_threads(spec["threads"])
    llm = LLM(spec["model"], dtype="float32", seed=0, max_model_len=2048)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    llm.beam_search(prompts[:1], BeamSearchParams(beam_width=spec["width"], max_tokens=4))
    params = BeamSearchParams(beam_width=spec["width"], max_tokens=spec["max_tokens"])
    wall = time.perf_counter()
    outs = llm.beam_search(prompts, params)
    wall = time.perf_counter() - wall
    beams = [[(list(s.tokens), s.cum_logprob) for s in o.sequences] for o in outs]
    # No CPU seconds: the model runs in vLLM's engine process, not in this one.
    Path(out_path).write_text(json.dumps({"system": "vllm", "seconds": wall,
                                          "cpu_seconds": None, "beams": beams}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
