"""Systems side by side, each in a process of its own, alternating over rounds.

A spec (JSON) names the model, the requests (token-id prompt, n, temperature, seed,
max_tokens; always ignore_eos) and the engine limits. Every system runs it in a fresh process,
so that its peak RSS and CPU seconds are its own, in the order pagedq, peer, peer, ... and
again for each round: a load that comes and goes on the shared cores then hits every system
alike. Systems:

- ``pagedq``: ``LLM.generate`` (this file run as a script in the project's venv), with
  tcmalloc preloaded as vLLM has it (the transformers peers too);
- ``hf-static B=b`` / ``hf-cb T:R``: benchmarks/hf_runs.py (greedy);
- ``vllm``: vLLM's CPU build in .venv-vllm (benchmarks/vllm_peer.sh builds it), through
  benchmarks/vllm_child.py, with what its CPU docs advise: tcmalloc and Intel's OpenMP
  preloaded, ``VLLM_CPU_OMP_THREADS_BIND`` on our threads' cores (its default keeps a core
  for its scheduler), ``VLLM_CPU_KVCACHE_SPACE=4`` (pagedq's default KV budget, GiB), and
  its own OpenMP wait policy (pagedq's processes keep benchmarks/common.py's PASSIVE).

    python benchmarks/peers.py SYSTEM SPEC.json RESULT.json   (the child; peers.run does it)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
if __name__ == "__main__":  # as a child: keep benchmarks/queue.py from shadowing queue
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]
from common import OUT_DIR, format_table, log, write_json  # noqa: E402
from proctree import cpu_seconds, peak_rss_mb  # noqa: E402

ROOT = _HERE.parent
VLLM_PYTHON = Path(os.environ.get("PAGEDQ_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
KV_CACHE_GIB = 4
TCMALLOC = Path("/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def make_spec(model: Path, requests: list[dict[str, Any]], *, threads: int, block_size: int,
              vllm_block_size: int, prefix_caching: bool, max_num_seqs: int = 256,
              max_num_batched_tokens: int = 2048, max_model_len: int = 2048) -> dict[str, Any]:
    """``requests``: dicts of prompt (token ids), n, temperature, seed, max_tokens."""
    return {"model": str(model), "requests": requests, "threads": threads,
            "block_size": block_size, "vllm_block_size": vllm_block_size,
            "prefix_caching": prefix_caching, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens, "max_model_len": max_model_len}


def greedy_requests(prompts: list[list[int]], output_lens: list[int]) -> list[dict[str, Any]]:
    return [{"prompt": p, "n": 1, "temperature": 0.0, "seed": None, "max_tokens": n}
            for p, n in zip(prompts, output_lens, strict=True)]


def vllm_missing() -> str | None:
    """Why vLLM cannot run here, or None."""
    if not VLLM_PYTHON.exists():
        return f"no {VLLM_PYTHON.parent.parent} (bash benchmarks/vllm_peer.sh builds it)"
    return None  # vllm-cpu 0.32 runs on AVX2-only CPUs too (checked on an AMD EPYC without
    # AVX-512); where it cannot start, ``alternate`` reports its error and carries on


def _preload(*libs: Path) -> str:
    return ":".join(str(p) for p in libs if p.exists())


def vllm_env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # vLLM's own choice
    env.update(LD_PRELOAD=_preload(TCMALLOC, VLLM_PYTHON.parent.parent / "lib" / "libiomp5.so"),
               VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
               VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", HF_HUB_OFFLINE="1",
               PYTHONPATH="", VLLM_LOGGING_LEVEL="WARNING")
    return env


def run(system: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Runs ``spec`` on ``system`` in a child process; returns its result (tokens per request
    and sample, seconds, cpu_seconds, peak_rss_mb, extra)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        if system == "vllm":
            cmd = [str(VLLM_PYTHON), str(_HERE / "vllm_child.py")]
            env = vllm_env(spec["threads"])
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), system]
            env = os.environ | {"LD_PRELOAD": _preload(TCMALLOC)}  # the allocator vLLM gets
        done = subprocess.run([*cmd, str(spec_path), str(out_path)], env=env, check=False,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{system} failed:\n{done.stderr[-3000:]}")
        result = json.loads(out_path.read_text())
    result["system"] = system
    log(f"{system}: {result['seconds']:.1f}s, peak RSS {result['peak_rss_mb']:.0f} MB")
    return result


def alternate(systems: list[str], spec: dict[str, Any], rounds: int) -> list[dict[str, Any]]:
    """Every system once per round, in the given order; results in run order, each with its
    round and the load average after it."""
    results, failed = [], set()
    for r in range(rounds):
        for system in [s for s in systems if s not in failed]:
            try:
                results.append(run(system, spec) | {"round": r, "load": os.getloadavg()[0]})
            except RuntimeError as e:
                if system == "pagedq":
                    raise
                print(f"{system} left out: {e}")
                failed.add(system)
    return results


def compare(title: str, systems: list[str], spec: dict[str, Any], rounds: int,
            out_name: str, args: dict[str, Any]) -> None:
    """Alternates ``systems`` (pagedq first) on ``spec``, prints the table and writes
    benchmarks/out/<out_name>.json; vLLM is left out, with the reason, where it cannot run."""
    if "vllm" in systems and (why := vllm_missing()):
        print(f"vllm left out: {why}")
        systems = [s for s in systems if s != "vllm"]
    rows = report(f"{title}, {spec['threads']} threads, {rounds} rounds",
                  alternate(systems, spec, rounds))
    write_json(OUT_DIR / f"{out_name}.json", {"args": args, "threads": spec["threads"],
                                              "rows": rows})


def agreement(ours: list[list[list[int]]], theirs: list[list[list[int]]]) -> tuple[int, str]:
    """How many requests have every sample's tokens identical, and where the first request
    that differs first differs ("-" when none does)."""
    same, first = 0, "-"
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a == b:
            same += 1
        elif first == "-":
            pos = next((j for s, t in zip(a, b, strict=True)
                        for j, (x, y) in enumerate(zip(s, t, strict=False)) if x != y), None)
            first = f"request {i} token {pos if pos is not None else 'length'}"
    return same, first


def _rate(tokens: int, seconds: float) -> float:
    """tokens / seconds; NaN for a run under the clock's tick (CPU time counts in 10 ms ticks:
    a tiny model's run can take none)."""
    return tokens / seconds if seconds > 0 else float("nan")


def report(title: str, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Prints one row per run (pagedq's run of the same round as each ratio's numerator and
    the greedy reference; sampled requests are compared too, but agree only by chance) and
    the mean ratios per peer; returns the rows for the JSON."""
    ours = {r["round"]: r for r in results if r["system"] == "pagedq"}
    rows = []
    for r in results:
        base = ours[r["round"]]
        out = sum(len(s) for req in r["tokens"] for s in req)
        tok_s, tok_cpu = _rate(out, r["seconds"]), _rate(out, r["cpu_seconds"])
        base_out = sum(len(s) for req in base["tokens"] for s in req)
        same, first = agreement(base["tokens"], r["tokens"])
        rows.append({"system": r["system"], "round": r["round"], "seconds": r["seconds"],
                     "tok_s": tok_s, "pagedq_x": base_out / base["seconds"] / tok_s,
                     "cpu_seconds": r["cpu_seconds"], "tok_cpu_s": tok_cpu,
                     "pagedq_x_cpu": _rate(base_out, base["cpu_seconds"]) / tok_cpu,
                     "peak_rss_mb": r["peak_rss_mb"], "identical": f"{same}/{len(r['tokens'])}",
                     "first_divergence": first, "load": r["load"], "extra": r.get("extra", {})})
    print(f"\n== {title} ==")
    keys = ["system", "round", "seconds", "tok_s", "pagedq_x", "cpu_seconds", "tok_cpu_s",
            "pagedq_x_cpu", "peak_rss_mb", "identical", "first_divergence", "load"]
    print(format_table(["system", "round", "seconds", "output tok/s", "pagedq x", "cpu s",
                        "tok/cpu-s", "pagedq x (cpu)", "peak RSS MB", "identical",
                        "first divergence", "load"], [[row[k] for k in keys] for row in rows]))
    print("pagedq x: the same round's pagedq over the row; cpu s: CPU seconds of the system's "
          "processes (vLLM's engine process included); identical: requests whose tokens equal "
          "pagedq's; load: 1-min load average after the run (above the thread count: shared)")
    for system in dict.fromkeys(r["system"] for r in rows if r["system"] != "pagedq"):
        mine = [r for r in rows if r["system"] == system]
        print(f"pagedq vs {system}: x{sum(r['pagedq_x'] for r in mine) / len(mine):.2f} tok/s, "
              f"x{sum(r['pagedq_x_cpu'] for r in mine) / len(mine):.2f} per CPU-second "
              f"(mean of {len(mine)} rounds)")
    return rows


def run_pagedq(spec: dict[str, Any]) -> dict[str, Any]:
    """pagedq on a spec, in this process: ``LLM.generate`` on every request at once, after a
    short warm-up."""
    from engine import LLM, SamplingParams

    llm = LLM(spec["model"], dtype="float32", device="cpu",
              enable_prefix_caching=spec["prefix_caching"], block_size=spec["block_size"],
              max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"])
    requests = spec["requests"]
    params = [SamplingParams(n=r["n"], temperature=r["temperature"], seed=r["seed"],
                             max_tokens=r["max_tokens"], ignore_eos=True) for r in requests]
    llm.generate([requests[0]["prompt"][:8]], SamplingParams(temperature=0, max_tokens=4,
                                                             ignore_eos=True), use_tqdm=False)
    wall, cpu = _clock()
    outs = llm.generate([r["prompt"] for r in requests], params, use_tqdm=False)
    wall, cpu = _clock(wall, cpu)
    stats = llm.stats()
    extra = {k: stats[k] for k in ("kv_blocks_peak", "kv_blocks_total", "kv_utilization_at_peak",
                                   "preemptions", "prefix_cache_hits")}
    return {"seconds": wall, "cpu_seconds": cpu, "peak_rss_mb": peak_rss_mb(),
            "tokens": [[list(o.token_ids) for o in out.outputs] for out in outs],
            "extra": extra | {"block_size": spec["block_size"]}}


def _clock(wall: float = 0.0, cpu: float = 0.0) -> tuple[float, float]:
    import time

    return time.perf_counter() - wall, cpu_seconds() - cpu


def _run_hf(system: str, spec: dict[str, Any]) -> dict[str, Any]:
    import argparse

    import hf_runs
    from common import Workload

    if any(r["n"] != 1 or r["temperature"] != 0 for r in spec["requests"]):
        raise ValueError(f"{system}: the transformers peers run greedy n=1 requests only")
    wl = Workload([r["prompt"] for r in spec["requests"]],
                  [r["max_tokens"] for r in spec["requests"]])
    model = hf_runs.load_hf(Path(spec["model"]), argparse.Namespace(device="cpu",
                                                                    dtype="float32"))
    hf_runs.static_batch(model, wl.prompts[:2], 4)  # warm-up
    kind, _, size = system.partition(" ")
    if kind == "hf-static":
        result, tokens = hf_runs.run_hf_static(model, wl, int(size.removeprefix("B=")))
    else:
        limits = tuple(map(int, size.split(":")))
        result, tokens = hf_runs.run_hf_cb(model, wl, (limits[0], limits[1]))
    return {"seconds": result.seconds, "cpu_seconds": result.cpu_seconds,
            "peak_rss_mb": peak_rss_mb(), "tokens": [[t] for t in tokens], "extra": {}}


def _child(system: str, spec_path: str, out_path: str) -> None:
    import torch

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    result = run_pagedq(spec) if system == "pagedq" else _run_hf(system, spec)
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    _child(*sys.argv[1:4])
