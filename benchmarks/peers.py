"""Systems side by side, each in a process of its own, alternating over rounds.

A spec (JSON) names the model, the calls (each a list of requests: token-id prompt, n,
temperature, seed, max_tokens; always ignore_eos) and the engine limits. Every system runs it
in a fresh process, so that its peak RSS and CPU seconds are its own, in the order pagedq,
peer, peer, ... and again for each round: a load that comes and goes on the shared cores then
hits every system alike. A process runs the calls one after the other: call 0 is its first
``generate`` (``first`` in the table), the later ones fresh prompts of the same lengths
(``steady``); each is timed and compared on its own. Systems:

- ``pagedq``: ``LLM.generate`` (benchmarks/peers_child.py, in the project's venv), with
  tcmalloc preloaded as vLLM has it (the transformers peers too);
- ``hf-static B=b`` / ``hf-cb T:R``: benchmarks/hf_runs.py (greedy), also through
  peers_child.py;
- ``vllm``: vLLM's CPU build in .venv-vllm (benchmarks/vllm_peer.sh builds it), through
  benchmarks/vllm_child.py, with what its CPU docs advise: tcmalloc and Intel's OpenMP
  preloaded, ``VLLM_CPU_OMP_THREADS_BIND`` on our threads' cores (its default keeps a core
  for its scheduler), ``VLLM_CPU_KVCACHE_SPACE=4`` (pagedq's default KV budget, GiB), and
  its own OpenMP wait policy (pagedq's processes keep benchmarks/common.py's PASSIVE).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from adjudicate import MAX_CASES, Divergence, adjudicate
from common import OUT_DIR, format_table, log, write_json

_HERE = Path(__file__).resolve().parent

ROOT = _HERE.parent
VLLM_PYTHON = Path(os.environ.get("PAGEDQ_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
# vLLM's processes start elsewhere than benchmarks/, whose queue.py would stand in for the
# standard library's where its subprocesses (-m) put their folder on the path
VLLM_CWD = tempfile.gettempdir()
KV_CACHE_GIB = 4
TCMALLOC = Path("/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def make_spec(model: Path, calls: list[list[dict[str, Any]]], *, threads: int,
              block_size: int, vllm_block_size: int, prefix_caching: bool,
              max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
              max_model_len: int = 2048, dtype: str = "float32") -> dict[str, Any]:
    """``calls``: per call, its requests, dicts of prompt (token ids), n, temperature, seed,
    max_tokens. ``dtype``: every system's weights and activations (float32, the parity mode,
    or bfloat16). pagedq's pool is reserved at start-up (``reserve_kv_cache``), as vLLM's CPU
    backend allocates its own, outside the timed calls."""
    return {"model": str(model), "calls": calls, "threads": threads, "dtype": dtype,
            "block_size": block_size, "vllm_block_size": vllm_block_size,
            "prefix_caching": prefix_caching, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens, "max_model_len": max_model_len,
            "reserve_kv_cache": True}


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
    """Runs ``spec`` on ``system`` in a child process; returns its result (per call: tokens
    per request and sample, seconds, cpu_seconds; peak_rss_mb, extra)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        if system == "vllm":
            cmd = [str(VLLM_PYTHON), str(_HERE / "vllm_child.py")]
            env = vllm_env(spec["threads"])
        else:
            cmd = [sys.executable, str(_HERE / "peers_child.py"), system]
            env = os.environ | {"LD_PRELOAD": _preload(TCMALLOC)}  # the allocator vLLM gets
        done = subprocess.run([*cmd, str(spec_path), str(out_path)], env=env, check=False,
                              cwd=VLLM_CWD if system == "vllm" else None,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{system} failed:\n{done.stderr[-3000:]}")
        result = json.loads(out_path.read_text())
    result["system"] = system
    seconds = ", ".join(f"{c['seconds']:.1f}s" for c in result["calls"])
    log(f"{system}: {seconds}, peak RSS {result['peak_rss_mb']:.0f} MB")
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
    results = alternate(systems, spec, rounds)
    rows = report(f"{title}, {spec['threads']} threads, {rounds} rounds", results)
    verdicts = adjudicate(Path(spec["model"]), spec["dtype"],
                          greedy_divergences(results, spec["calls"]))
    write_json(OUT_DIR / f"{out_name}.json", {"args": args, "threads": spec["threads"],
                                              "rows": rows, "divergences": verdicts})


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


def _call_name(call: int) -> str:
    return "first" if call == 0 else "steady"


def _reference(ours: dict[int, list[dict[str, Any]]], run: dict[str, Any]
               ) -> list[dict[str, Any]]:
    """The pagedq calls whose tokens ``run``'s are held to: its same round's; for pagedq's own
    later rounds, its round 0's (every round runs the same prompts)."""
    return ours[0 if run["system"] == "pagedq" else run["round"]]


def greedy_divergences(results: list[dict[str, Any]], calls: list[list[dict[str, Any]]]
                       ) -> list[Divergence]:
    """The greedy requests (one sample, temperature 0) on which a run left its reference
    (``_reference``), up to MAX_CASES a run and call."""
    ours = {r["round"]: r["calls"] for r in results if r["system"] == "pagedq"}
    cases = []
    for r in results:
        if r["system"] == "pagedq" and r["round"] == 0:
            continue
        ref = _reference(ours, r)
        for i, c in enumerate(r["calls"]):
            found = [Divergence(r["system"], r["round"], i, k, req["prompt"], a[0], b[0])
                     for k, (req, a, b) in enumerate(zip(calls[i], ref[i]["tokens"], c["tokens"],
                                                         strict=True))
                     if req["n"] == 1 and req["temperature"] == 0 and a != b]
            cases += found[:MAX_CASES]
    return cases


def report(title: str, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Prints one row per run and call (pagedq's run of the same round and call as each ratio's
    numerator and the greedy reference, its round 0's for its own later rounds; sampled requests
    are compared too, but agree only by chance) and the mean ratios per peer, first calls and
    steady ones apart; returns the rows for the JSON."""
    ours = {r["round"]: r["calls"] for r in results if r["system"] == "pagedq"}
    rows = []
    for r in results:
        for i, c in enumerate(r["calls"]):
            base, ref = ours[r["round"]][i], _reference(ours, r)[i]
            out = sum(len(s) for req in c["tokens"] for s in req)
            tok_s, tok_cpu = _rate(out, c["seconds"]), _rate(out, c["cpu_seconds"])
            base_out = sum(len(s) for req in base["tokens"] for s in req)
            same, first = agreement(ref["tokens"], c["tokens"])
            reference = r["system"] == "pagedq" and r["round"] == 0
            rows.append({"system": r["system"], "round": r["round"], "call": _call_name(i),
                         "seconds": c["seconds"], "tok_s": tok_s,
                         "pagedq_x": _rate(base_out, base["seconds"]) / tok_s,
                         "cpu_seconds": c["cpu_seconds"], "tok_cpu_s": tok_cpu,
                         "pagedq_x_cpu": _rate(base_out, base["cpu_seconds"]) / tok_cpu,
                         "peak_rss_mb": r["peak_rss_mb"],
                         "identical": "reference" if reference else f"{same}/{len(c['tokens'])}",
                         "first_divergence": first,
                         "load": r["load"], "extra": r.get("extra", {})})
    print(f"\n== {title} ==")
    keys = ["system", "round", "call", "seconds", "tok_s", "pagedq_x", "cpu_seconds",
            "tok_cpu_s", "pagedq_x_cpu", "peak_rss_mb", "identical", "first_divergence", "load"]
    print(format_table(["system", "round", "call", "seconds", "output tok/s", "pagedq x",
                        "cpu s", "tok/cpu-s", "pagedq x (cpu)", "peak RSS MB", "identical",
                        "first divergence", "load"], [[row[k] for k in keys] for row in rows]))
    print("call: first, the process's first generate (no warm-up); steady, a later one on "
          "fresh prompts; pagedq x: the same round and call's pagedq over the row; cpu s: CPU "
          "seconds of the system's processes (vLLM's engine process included); identical: "
          "requests whose tokens equal the same round's pagedq's (pagedq's own later rounds: "
          "its round 0's, the same prompts); load: 1-min load average after the process "
          "(above the thread count: shared); peak RSS: the process's, over all its calls")
    for system in dict.fromkeys(r["system"] for r in rows if r["system"] != "pagedq"):
        for call in dict.fromkeys(r["call"] for r in rows):
            mine = [r for r in rows if r["system"] == system and r["call"] == call]
            print(f"pagedq vs {system}, {call} calls: "
                  f"x{sum(r['pagedq_x'] for r in mine) / len(mine):.2f} tok/s, "
                  f"x{sum(r['pagedq_x_cpu'] for r in mine) / len(mine):.2f} per CPU-second "
                  f"(mean of {len(mine)})")
    return rows
