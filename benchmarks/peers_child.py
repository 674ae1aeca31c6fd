"""A system's side of benchmarks/peers.py: one spec's calls in this process, one after the
other, each timed on its own; written as JSON for the parent.

Call 0 is the process's first ``generate``, with nothing before it but building the engine (no
warm-up): what a user who starts a process and generates once waits for. The later calls run
fresh prompts of the same lengths, so the prefix cache holds none of them: the steady state.
The two differ (a first ``LLM`` in a process ran 1.6x slower than later ones on a 25M Llama).

    python benchmarks/peers_child.py SYSTEM SPEC.json RESULT.json   (peers.run starts it)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
# benchmarks/queue.py would shadow the standard library's queue
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]
from proctree import cpu_seconds, peak_rss_mb  # noqa: E402


def timed_call(generate: Any, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, float]]:
    """``generate(*args, **kwargs)``'s result, and its wall and CPU seconds (every process of
    this tree: vLLM's engine process too)."""
    wall, cpu = time.perf_counter(), cpu_seconds()
    out = generate(*args, **kwargs)
    return out, {"seconds": time.perf_counter() - wall, "cpu_seconds": cpu_seconds() - cpu}


def sample_tokens(outs: Any) -> list[list[list[int]]]:
    """Per request, each sample's token ids (pagedq's and vLLM's RequestOutput alike)."""
    return [[list(o.token_ids) for o in out.outputs] for out in outs]


def run_pagedq(spec: dict[str, Any]) -> dict[str, Any]:
    """pagedq's ``LLM.generate`` on every request of a call at once, call after call."""
    from engine import LLM, SamplingParams

    llm = LLM(spec["model"], dtype=spec["dtype"], device="cpu",
              enable_prefix_caching=spec["prefix_caching"], block_size=spec["block_size"],
              max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"],
              reserve_kv_cache=spec["reserve_kv_cache"])
    calls = []
    for requests in spec["calls"]:
        params = [SamplingParams(n=r["n"], temperature=r["temperature"], seed=r["seed"],
                                 max_tokens=r["max_tokens"], ignore_eos=True) for r in requests]
        outs, clock = timed_call(llm.generate, [r["prompt"] for r in requests], params,
                                 use_tqdm=False)
        calls.append(clock | {"tokens": sample_tokens(outs)})
    stats = llm.stats()
    extra = {k: stats[k] for k in ("kv_blocks_peak", "kv_blocks_total", "kv_utilization_at_peak",
                                   "preemptions", "prefix_cache_hits")}
    return {"calls": calls, "peak_rss_mb": peak_rss_mb(),
            "extra": extra | {"block_size": spec["block_size"]}}


def run_hf(system: str, spec: dict[str, Any]) -> dict[str, Any]:
    """transformers' static or continuous batching (benchmarks/hf_runs.py), greedy n=1."""
    import argparse

    import hf_runs
    from common import Workload

    if any(r["n"] != 1 or r["temperature"] != 0 for call in spec["calls"] for r in call):
        raise ValueError(f"{system}: the transformers peers run greedy n=1 requests only")
    model = hf_runs.load_hf(Path(spec["model"]), argparse.Namespace(device="cpu",
                                                                    dtype=spec["dtype"]))
    kind, _, size = system.partition(" ")
    calls = []
    for requests in spec["calls"]:
        wl = Workload([r["prompt"] for r in requests], [r["max_tokens"] for r in requests])
        if kind == "hf-static":
            result, tokens = hf_runs.run_hf_static(model, wl, int(size.removeprefix("B=")))
        else:
            limits = tuple(map(int, size.split(":")))
            result, tokens = hf_runs.run_hf_cb(model, wl, (limits[0], limits[1]))
        calls.append({"seconds": result.seconds, "cpu_seconds": result.cpu_seconds,
                      "tokens": [[t] for t in tokens]})
    return {"calls": calls, "peak_rss_mb": peak_rss_mb(), "extra": {}}


def main(system: str, spec_path: str, out_path: str) -> None:
    import torch

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    result = run_pagedq(spec) if system == "pagedq" else run_hf(system, spec)
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:4])
