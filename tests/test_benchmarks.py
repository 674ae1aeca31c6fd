"""The benchmarks run end to end on tiny workloads, into a temporary folder. Their speed figures
are not checked here (speed is shown by running them in full: benchmarks/RESULTS.md); what
they compare besides is: pagedq's greedy tokens against both transformers runs, the prompt's
blocks held once by a job's samples, the queue's tokens against ``LLM.generate``'s."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SMALL = ["--model", "tiny", "--threads", "1"]


@pytest.fixture
def run_benchmark(tmp_path: Path):
    def run(script: str, *args: str) -> dict:
        env = {**os.environ, "PAGEDQ_BENCH_OUT": str(tmp_path),
               "PAGEDQ_VLLM_PYTHON": str(tmp_path / "no-vllm" / "python")}
        done = subprocess.run([sys.executable, str(BENCHMARKS / script), *SMALL, *args],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
        return {"stdout": done.stdout, **{p.stem: json.loads(p.read_text())
                                          for p in tmp_path.glob("*.json")}}

    return run


def test_throughput(run_benchmark) -> None:
    out = run_benchmark("throughput.py", "--num-requests", "4", "--min-prompt", "4",
                        "--max-prompt", "40", "--min-output", "4", "--max-output", "12",
                        "--batch-sizes", "2,4", "--cb-limits", "2048:256,64:2")
    systems = [r["system"] for r in out["throughput-tiny"]["results"]]
    assert systems == ["pagedq", "hf-static B=2", "hf-static B=4", "hf-cb 2048:256", "hf-cb 64:2"]
    assert out["throughput-tiny"]["greedy_agreement_first_diff"] == {
        "hf-static": [None] * 4, "hf-cb": [None] * 4}
    assert "pagedq vs hf-cb: agree" in out["stdout"] and "best hf-cb: hf-cb " in out["stdout"]


def test_throughput_peers(run_benchmark) -> None:
    """Each system in a process of its own (one round: each child starts torch, ~10 s); vLLM's
    venv is missing here, and the benchmark says so and carries on."""
    out = run_benchmark("throughput.py", "--num-requests", "3", "--min-prompt", "4",
                        "--max-prompt", "30", "--min-output", "2", "--max-output", "6",
                        "--peers", "vllm,hf-static", "--batch-sizes", "2", "--rounds", "1")
    rows = out["throughput-peers-tiny"]["rows"]
    assert [(r["system"], r["round"], r["call"]) for r in rows] == [
        ("pagedq", 0, "first"), ("pagedq", 0, "steady"),
        ("hf-static B=2", 0, "first"), ("hf-static B=2", 0, "steady")]
    assert [r["identical"] for r in rows] == ["reference", "reference", "3/3", "3/3"]
    assert all(r["peak_rss_mb"] > 0 for r in rows)
    assert out["throughput-peers-tiny"]["divergences"] == []
    assert "vllm left out: no " in out["stdout"]


ADJUDICATE = """
import json, sys
sys.path.append(sys.argv[1])
from adjudicate import adjudicate
from peers import greedy_divergences
from engine import LLM, SamplingParams

prompts = [[5, 9, 17, 33], [40, 41, 42, 43, 44, 45]]
llm = LLM(sys.argv[2], dtype="float32", device="cpu")
ours = [[list(o.outputs[0].token_ids)] for o in llm.generate(
    prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
theirs = [ours[0], [ours[1][0][:3] + [(ours[1][0][3] + 1) % 100] + ours[1][0][4:]]]
calls = [[{"prompt": p, "n": 1, "temperature": 0.0, "seed": None, "max_tokens": 8}
          for p in prompts]]
results = [{"system": "pagedq", "round": 0, "calls": [{"tokens": ours}]},
           {"system": "peer", "round": 0, "calls": [{"tokens": theirs}]},
           {"system": "pagedq", "round": 1, "calls": [{"tokens": ours}]}]
print(json.dumps(adjudicate(sys.argv[2], "float32", greedy_divergences(results, calls))))
"""


def test_divergence_adjudicated(tiny_llama: Path) -> None:
    """A peer's tokens that leave pagedq's at one request (a token changed, by hand: no engine
    here leaves transformers' tokens): that request alone is taken to transformers, which
    shares all 8 tokens with pagedq's and 3 with the peer's."""
    done = subprocess.run([sys.executable, "-c", ADJUDICATE, str(BENCHMARKS), str(tiny_llama)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [
        {"system": "peer", "round": 0, "call": 0, "request": 1, "tokens": 8,
         "reference_agrees": 8, "other_agrees": 3, "closer": "reference"}]


def test_single_stream(run_benchmark) -> None:
    """Token by token through LLM and through the queue (worker processes on a private
    redis-server, with the stream interval and without): the same greedy tokens every way."""
    out = run_benchmark("single_stream.py", "--prompt-lens", "5,20", "--max-tokens", "4",
                        "--rounds", "1")
    rows = out["single-stream-tiny"]["rows"]
    ways = ["LLM", "queue", "queue, each step"]
    assert [(r["way"], r["prompt_len"]) for r in rows] == [(w, n) for n in (5, 20) for w in ways]
    assert all(r["same_tokens"] for r in rows if r["way"] != "LLM")
    assert all(r["ttft_ms"] > 0 and r["decode_tok_s"] > 0 for r in rows)


def test_sharing(run_benchmark) -> None:
    n, prompt_len, block_size = 3, 40, 16
    out = run_benchmark("sharing.py", "--n", str(n), "--prompt-len", str(prompt_len),
                        "--max-tokens", "4")
    peaks = {r["system"]: r["kv_blocks_peak"] for r in out["sharing-tiny"]["rows"]}
    # the prompt's full blocks once, and each sample its own block for the rest
    assert peaks[f"n={n} shared"] == prompt_len // block_size + n
    assert peaks[f"{n} separate, no prefix cache"] == n * -(-(prompt_len + 4) // block_size)


def test_queue(run_benchmark) -> None:
    out = run_benchmark("queue.py", "--num-requests", "4", "--repeats", "1", "--min-prompt",
                        "4", "--max-prompt", "32", "--min-output", "2", "--max-output", "8",
                        "--latency-jobs", "2", "--latency-tokens", "4", "--jobs", "40",
                        "--submit-batch", "20", "--jobs-model", "tiny")
    result = out["queue"]
    assert result["throughput"]["token_ids_equal"] == 4
    assert result["latency"]["chunks"] == 2 * 4  # a chunk per token, each timed
    assert result["jobs"]["jobs"] == 40


def test_beam(run_benchmark) -> None:
    out = run_benchmark("beam.py", "--num-requests", "2", "--width", "2", "--max-tokens", "4")
    result = out["beam-tiny"]
    assert [r["system"] for r in result["results"]] == ["pagedq", "transformers"]
    assert result["identical_beams"] == {"pagedq vs transformers": [True, True]}
    pagedq = result["results"][0]
    assert pagedq["kv_blocks_peak"] < pagedq["kv_blocks_separate"]


def test_kv_fp8(run_benchmark) -> None:
    """At a budget of 10 fp32 blocks the workload preempts; fp8's 4x the blocks hold it."""
    out = run_benchmark("kv_fp8.py", "--num-requests", "4", "--min-prompt", "8",
                        "--max-prompt", "16", "--min-output", "32", "--max-output", "40",
                        "--budgets", "4,0.00004")  # sequences of 5 to 7 blocks of 8
    rows = {(r["budget_gib"], r["kv_cache_dtype"]): r for r in out["kv-fp8-tiny"]["results"]}
    assert list(rows) == [(4.0, "auto"), (4.0, "fp8"), (0.00004, "auto"), (0.00004, "fp8")]
    auto, fp8 = rows[0.00004, "auto"], rows[0.00004, "fp8"]
    assert auto["kv_blocks_total"] == 10 and fp8["kv_blocks_total"] >= 39
    assert auto["preemptions"] > 0 and fp8["preemptions"] == 0
    assert "x auto" in out["stdout"]


def test_gateway(run_benchmark) -> None:
    out = run_benchmark("gateway.py", "--num-requests", "6", "--repeats", "1", "--rate", "20",
                        "--min-output", "4", "--max-output", "8", "--streams", "50")
    assert out["gateway"]["trace"]["greedy_agreement"]  # the same texts on both paths
    assert out["gateway"]["streams"]["held"] == 50
    assert "throughput ratio (gateway / client)" in out["stdout"]


def test_serve_keeps_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A system keeps up with the rates up to the request rate it served in the burst, its
    capacity; unknown without a burst."""
    monkeypatch.setattr(sys, "path", [*sys.path, str(BENCHMARKS)])
    keeps_up = __import__("serve_stats").keeps_up
    by_rate = {"1": {"req_s": 0.99}, "2": {"req_s": 1.48}, "4": {"req_s": 1.89},
               "burst": {"req_s": 1.89}}
    assert keeps_up(by_rate) == {"1": True, "2": False, "4": False, "burst": None}
    assert keeps_up(by_rate | {"burst": {"req_s": 2.62}})["2"] is True
    assert keeps_up({"1": {"req_s": 0.99}}) == {"1": None}


def test_serve(run_benchmark) -> None:
    """Poisson arrivals and a burst through the queue; vLLM's venv is missing here, and the
    benchmark says so and carries on."""
    out = run_benchmark("serve.py", "--rates", "20,burst", "--num-requests", "4",
                        "--min-prompt", "4", "--max-prompt", "12", "--min-output", "2",
                        "--max-output", "6")
    results = out["serve-tiny"]["results"]
    assert list(results) == ["pagedq"] and list(results["pagedq"]) == ["20", "burst"]
    for r in results["pagedq"].values():
        assert r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] > 0 and r["tok_s"] > 0
    assert results["pagedq"]["20"]["keeps_up"] in (True, False)
    assert results["pagedq"]["burst"]["keeps_up"] is None
    assert "vllm left out: no " in out["stdout"]
