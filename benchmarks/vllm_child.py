"""Runs one benchmark spec on vLLM's CPU build: started by benchmarks/peers.py with
.venv-vllm's interpreter, so it imports vllm and the standard library only (never pagedq).

Reads the spec JSON (``peers.make_spec``) and runs its calls one after the other on one
``LLM``, as benchmarks/peers_child.py runs pagedq's (call 0 the process's first, no warm-up):
each call's requests at once with token-id prompts (``TokensPrompt``). Writes the result
JSON: per call its requests' samples' token ids and the wall and CPU seconds of ``generate``,
and the peak RSS, of this process and vLLM's engine process together (``proctree``).

    .venv-vllm/bin/python benchmarks/vllm_child.py SPEC.json RESULT.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# benchmarks/queue.py would shadow the standard library's queue (vllm imports it).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]
from peers_child import sample_tokens, timed_call  # noqa: E402
from proctree import peak_rss_mb  # noqa: E402


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(spec["threads"])
    started = time.perf_counter()
    llm = LLM(spec["model"], dtype=spec["dtype"], block_size=spec["vllm_block_size"],
              max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"],
              enable_prefix_caching=spec["prefix_caching"], seed=0,
              max_model_len=spec["max_model_len"])
    setup = time.perf_counter() - started
    calls = []
    for requests in spec["calls"]:
        prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in requests]
        params = [SamplingParams(n=r["n"], temperature=r["temperature"], seed=r["seed"],
                                 max_tokens=r["max_tokens"], ignore_eos=True, detokenize=True)
                  for r in requests]
        outs, clock = timed_call(llm.generate, prompts, params, use_tqdm=False)
        calls.append(clock | {"tokens": sample_tokens(outs)})
    result = {"system": "vllm", "calls": calls, "setup_seconds": setup,
              "peak_rss_mb": peak_rss_mb(), "extra": {"vllm_block_size": spec["vllm_block_size"]}}
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
