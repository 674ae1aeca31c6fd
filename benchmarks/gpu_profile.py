"""On a CUDA GPU: where a decode step's time goes, and prefill attention's rate.

``--decode MODEL``: ``engine.step()`` at batch 1 (and ``--batches``) with CUDA graphs, under
``torch.profiler``: the GPU kernels by device time per step, the step's phases (scheduling,
input building, graph replay, logits, sampling, appending) by host time, and how much of the
step the GPU is busy. A step far above its floor with the GPU mostly idle is host-bound; one
with the GPU busy is kernel-bound. ``--sweep`` (the prefill kernel's launch shapes),
``--attention-peers`` (torch's fused attention on fresh prompts) and ``--fresh`` (the engine's
two routes for fresh prompts): ``gpu_prefill.py``.

    python benchmarks/gpu_profile.py --decode random-1b --sweep --out out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]
from common import format_table, log, model_path  # noqa: E402

# isort: split
import torch  # noqa: E402
from gpu_kernels import ceilings  # noqa: E402
from gpu_prefill import attention_peers, engine_prefill, fresh_prefill, sweep_prefill  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

# (owner under the engine, method): each becomes a profiler range "phase:owner.method"
PHASES = [("scheduler", "schedule"), ("model_runner", "_gather"), ("model_runner", "run"),
          ("beam_search", "step"), ("sampler", "sample"), ("output", "_append")]


def _label(obj: object, attr: str, name: str) -> None:
    """Wraps ``obj.attr`` in a profiler range called ``name``."""
    fn = getattr(obj, attr)

    def wrapped(*args: object, **kwargs: object) -> object:
        with record_function(name):
            return fn(*args, **kwargs)

    setattr(obj, attr, wrapped)


def _busy_us(spans: list[tuple[float, float]]) -> float:
    """The union of the kernels' intervals: time the GPU ran anything."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def profile_decode(name: str, batch: int, prompt_len: int, steps: int, bw: float,
                   async_scheduling: bool = True, gemv_rows: int | None = None) -> dict:
    from engine import LLM, SamplingParams, cuda_linear

    default_rows = cuda_linear.GEMV_ROWS  # read as the model loads: set for this load only
    cuda_linear.GEMV_ROWS = default_rows if gemv_rows is None else gemv_rows
    try:
        llm = LLM(str(model_path(name)), dtype="bfloat16", device="cuda",
                  max_num_seqs=max(batch, 8), async_scheduling=async_scheduling)
    finally:
        cuda_linear.GEMV_ROWS = default_rows
    engine = llm.engine
    runner = engine.model_runner
    for owner, attr in PHASES:
        obj = getattr(engine, owner) if owner else engine
        _label(obj, attr, f"phase:{owner or 'engine'}.{attr}")
    _label(runner, "_forward", "phase:model_runner._forward")
    if runner.graphs is not None:
        _label(runner.graphs, "run", "phase:graphs.run")
    _label(runner.model, "compute_logits", "phase:compute_logits")
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=8 * steps + 64, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{i}", torch.randint(3, engine.vocab_size, (prompt_len,),
                                                  generator=gen).tolist(), params)
    seqs = [s for r in engine.requests.values() for s in r.seqs]
    while min(s.num_output_tokens for s in seqs) < 1:  # every prompt prefilled
        engine.step()
    for _ in range(5):
        engine.step()
    wall = []  # a step's time, from runs of ``steps`` steps (a step per call overlaps the
    for _ in range(5):  # next under async scheduling: no synchronizing between them)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3 / steps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        prof_wall_us = (time.perf_counter() - t0) * 1e6
    kernels: dict[str, list[float]] = defaultdict(list)
    spans, phases = [], defaultdict(float)
    for e in prof.events():
        if e.name.startswith("phase:"):  # the ranges have a GPU-side twin: not a kernel
            if e.device_type != DeviceType.CUDA:
                phases[e.name.removeprefix("phase:")] += e.time_range.elapsed_us()
        elif e.device_type == DeviceType.CUDA:
            kernels[e.name].append(e.time_range.elapsed_us())
            spans.append((e.time_range.start, e.time_range.end))
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))
    # the floor: every weight and every sequence's KV read once, at the copy bandwidth
    weight_bytes = sum({p.data_ptr(): p.nbytes for p in runner.model.parameters()}.values())
    kv_bytes = runner.kv_cache[:, :, 0, 0].nbytes * sum(
        len(s) for r in engine.requests.values() for s in r.seqs)
    floor_ms = (weight_bytes + kv_bytes) / bw * 1e3
    result = {
        "model": name, "batch": batch, "context": prompt_len, "floor_ms": floor_ms,
        "async_scheduling": async_scheduling, "gemv_rows": gemv_rows,
        "step_ms_median": statistics.median(wall),
        "x_floor": statistics.median(wall) / floor_ms,
        "profiled_step_ms": prof_wall_us / steps / 1e3,
        "kernels_per_step": sum(len(v) for v in kernels.values()) / steps,
        "kernel_ms_per_step": sum(sum(v) for v in kernels.values()) / steps / 1e3,
        "gpu_busy_ms_per_step": _busy_us(spans) / steps / 1e3,
        "phases_ms_per_step": {k: v / steps / 1e3 for k, v in sorted(phases.items())},
        "top_kernels": [{"kernel": k[:90], "per_step": len(v) / steps,
                         "us_per_step": sum(v) / steps, "us_each": statistics.mean(v)}
                        for k, v in top[:30]]}
    log(json.dumps({k: v for k, v in result.items() if k != "top_kernels"}, indent=1))
    if not top:
        log("no CUDA kernels recorded")
    else:
        print(format_table(list(result["top_kernels"][0]),
                           [list(r.values()) for r in result["top_kernels"]]), flush=True)
    del llm, engine, runner
    torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decode", nargs="*", default=[], help="models to profile")
    p.add_argument("--batches", default="1")
    p.add_argument("--async-scheduling", default="on", choices=["on", "off", "both"],
                   help="the engine's, for --decode (both: off then on, per batch)")
    p.add_argument("--gemv-rows", default="",
                   help="rows the few-row GEMV takes, comma-separated, each a run (0: cuBLAS)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="sweep the prefill launch shapes")
    p.add_argument("--attention-peers", action="store_true",
                   help="torch's fused attention on the prefill case, for comparison")
    p.add_argument("--fresh", action="store_true",
                   help="the engine's routes for fresh prefills (paged Triton, cuDNN)")
    p.add_argument("--prefill", nargs="*", default=[],
                   help="models whose whole prefill steps to time by each attention route")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    bw, rate = ceilings()
    result: dict = {"info": {"device": torch.cuda.get_device_name(0),
                             "copy_GB/s": bw * 1e-9, "bf16_TFLOP/s": rate * 1e-12}}
    print(json.dumps(result["info"]), flush=True)
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.async_scheduling]
    gemv = [int(r) for r in args.gemv_rows.split(",")] if args.gemv_rows else [None]
    result["decode"] = [profile_decode(name, int(b), args.prompt_len, args.steps, bw, mode, g)
                        for name in args.decode for b in args.batches.split(",")
                        for mode in modes for g in gemv]
    if args.sweep:
        result["sweep"] = sweep_prefill(rate)
    result["prefill"] = [row for name in args.prefill
                         for row in engine_prefill(str(model_path(name)), rate)]
    if args.fresh:
        result["fresh_prefill"] = fresh_prefill(rate)
    if args.attention_peers:
        result["attention_peers"] = attention_peers(rate)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
