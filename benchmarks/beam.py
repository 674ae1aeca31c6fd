"""Beam search: pagedq's beams in the core against transformers' generate(num_beams) and,
given its venv, vLLM's LLM.beam_search.

The workload is the first 8 requests of throughput.py's SmolLM2 workload (seed 0), width 4,
64 new tokens, eos on, float32. pagedq runs every request at once in one engine; transformers
runs one request at a time (batching beam requests pads them, which changes their numerics);
vLLM runs in its own venv (``--vllm-venv``, e.g. the PERF helper's .venv-vllm) through
benchmarks/beam_vllm.py. Each system runs in turn, ``--rounds`` times. Printed: seconds, pagedq
x (the row's seconds over pagedq's), peak KV blocks against ``width`` separate sequences per
request, and per request whether its ranked beams equal transformers' (tokens, and
cum_logprob within 1e-4).

    python benchmarks/beam.py --threads 2 [--vllm-venv /work/wt/perf/.venv-vllm]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
# Python put this folder first on sys.path, where benchmarks/queue.py would shadow the standard
# library's queue (torch imports it): move the folder to the end.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]
import common  # noqa: E402  (first: it sets the environment torch reads at import)
import torch  # noqa: E402

Beams = list[tuple[list[int], float | None]]  # (output tokens, cum_logprob), best first


def hf_beam_search(model: Any, prompt: list[int], eos: list[int], width: int, max_tokens: int,
                   length_penalty: float = 1.0, early_stopping: bool | str = False) -> Beams:
    """transformers' ``generate(num_beams=width, num_return_sequences=width, do_sample=False)``:
    each hypothesis' output tokens (cut at its own length) and cum_logprob (its score times
    length ** length_penalty). ``eos`` [] is ignore_eos. num_beams=1 is greedy search there,
    which reports no cum_logprob."""
    from transformers import GenerationConfig

    # Any pad but 0, which transformers' beam search takes for "no pad" (and then needs an eos).
    pad = next(i for i in range(1, 5) if i not in eos)
    config = GenerationConfig(num_beams=width, num_return_sequences=width, do_sample=False,
                              length_penalty=length_penalty, early_stopping=early_stopping,
                              max_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=pad)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=model.device),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long,
                                                       device=model.device),
                             generation_config=config, return_dict_in_generate=True,
                             output_scores=True)
    if width == 1:
        ids = out.sequences[0, len(prompt):].tolist()
        cut = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))
        return [(ids[:cut], None)]
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    return [(out.sequences[i, len(prompt):len(prompt) + n].tolist(), score * n ** length_penalty)
            for i, (n, score) in enumerate(zip(lengths, out.sequences_scores.tolist(),
                                               strict=True))]


def same_beams(got: Beams, expected: Beams) -> bool:
    return [t for t, _ in got] == [t for t, _ in expected] and all(
        b is None or a is None or abs(a - b) < 1e-4
        for (_, a), (_, b) in zip(got, expected, strict=True))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=common.MODELS, default="smollm2")
    for name, default in (("num-requests", 8), ("width", 4), ("max-tokens", 64),
                          ("threads", 2), ("rounds", 1), ("block-size", None)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--vllm-venv", type=Path, default=None,
                   help="a venv with vLLM's CPU build; without it vLLM is not run")
    p.add_argument("--skip-hf", action="store_true")
    args = p.parse_args(argv)
    # As throughput.py: 8-slot blocks on the CPU (the numba decode path), 16 on CUDA.
    args.block_size = args.block_size or (16 if args.device.startswith("cuda") else 8)
    return args


def workload(path: Path, n: int) -> list[list[int]]:
    from throughput import make_workload
    from throughput import parse_args as throughput_args

    return make_workload(path, throughput_args([])).prompts[:n]


def run_pagedq(path: Path, prompts: list[list[int]], args: argparse.Namespace
               ) -> tuple[dict[str, Any], list[Beams], list[int]]:
    from engine import LLM, BeamSearchParams

    llm = LLM(str(path), dtype=args.dtype, device=args.device, block_size=args.block_size)
    llm.beam_search(prompts[:1], BeamSearchParams(beam_width=args.width, max_tokens=4))
    params = BeamSearchParams(beam_width=args.width, max_tokens=args.max_tokens)
    outs, seconds, cpu = common.timed(lambda: llm.beam_search(prompts, params))
    beams = [[(s.tokens[len(p):], s.cum_logprob) for s in o.sequences]
             for p, o in zip(prompts, outs, strict=True)]
    bs = args.block_size
    separate = sum(args.width * -(-(len(p) + args.max_tokens) // bs) for p in prompts)
    stats = llm.stats()
    result = {"system": "pagedq", "seconds": seconds, "cpu_seconds": cpu,
              "kv_blocks_peak": stats["kv_blocks_peak"], "kv_blocks_separate": separate,
              "load": common.load_average()}
    return result, beams, sorted(llm.engine.eos_token_ids)


def run_hf(path: Path, prompts: list[list[int]], eos: list[int],
           args: argparse.Namespace) -> tuple[dict[str, Any], list[Beams]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(
        args.device).eval()
    hf_beam_search(model, prompts[0], eos, args.width, 4)  # warm-up
    beams, seconds, cpu = common.timed(lambda: [hf_beam_search(model, p, eos, args.width,
                                                        args.max_tokens) for p in prompts])
    return {"system": "transformers", "seconds": seconds, "cpu_seconds": cpu,
            "load": common.load_average()}, beams


def run_vllm(path: Path, prompts: list[list[int]],
             args: argparse.Namespace) -> tuple[dict[str, Any], list[Beams]] | None:
    """vLLM in its venv (benchmarks/beam_vllm.py), set up as its CPU build wants; None when it
    failed."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    preload = [str(p) for p in (Path("/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                                args.vllm_venv / "lib" / "libiomp5.so") if p.exists()]
    env.update(LD_PRELOAD=":".join(preload), VLLM_CPU_KVCACHE_SPACE="4", PYTHONPATH="",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", HF_HUB_OFFLINE="1",
               VLLM_LOGGING_LEVEL="WARNING")
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"model": str(path), "prompts": prompts, "width": args.width,
                                    "max_tokens": args.max_tokens, "threads": args.threads}))
        child = Path(__file__).with_name("beam_vllm.py")
        done = subprocess.run([str(args.vllm_venv / "bin" / "python"), str(child), str(spec),
                               str(out)], env=env, cwd=tmp, check=False)  # see peers.VLLM_CWD
        if done.returncode != 0:  # the other systems' figures still count
            common.log(f"vllm failed (exit {done.returncode}); see its log above")
            return None
        result = json.loads(out.read_text())
    beams = [[(tokens[len(p):], cum) for tokens, cum in request]
             for p, request in zip(prompts, result.pop("beams"), strict=True)]
    return result | {"load": common.load_average()}, beams


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    threads = common.set_threads(args.threads)
    path = common.model_path(args.model)
    prompts = workload(path, args.num_requests)
    common.log(f"{len(prompts)} prompts, {sum(map(len, prompts))} tokens, width {args.width}, "
               f"{args.max_tokens} new tokens, {threads} threads")
    rows, beams = [], {}
    for _ in range(args.rounds):
        ours, beams["pagedq"], eos = run_pagedq(path, prompts, args)
        rows.append(ours)
        common.log(f"pagedq: {ours['seconds']:.1f}s")
        runs = [] if args.skip_hf else [("transformers", partial(run_hf, path, prompts, eos, args))]
        runs += [("vllm", partial(run_vllm, path, prompts, args))] if args.vllm_venv else []
        for name, run in runs:
            gc.collect()
            done = run()
            if done is not None:
                rows.append(done[0])
                beams[name] = done[1]
                common.log(f"{name}: {done[0]['seconds']:.1f}s")
    agree = {f"{a} vs {b}": [same_beams(x, y) for x, y in zip(beams[a], beams[b], strict=True)]
             for a, b in (("pagedq", "transformers"), ("vllm", "transformers"),
                          ("pagedq", "vllm")) if a in beams and b in beams}
    best = min(r["seconds"] for r in rows if r["system"] == "pagedq")
    print(f"\n== beam search: {args.model}, {len(prompts)} requests "
          f"({sum(map(len, prompts))} prompt tokens), width {args.width}, {args.max_tokens} new "
          f"tokens, {args.device} {args.dtype}, {threads} threads ==")
    print(common.format_table(["system", "seconds", "pagedq x", "cpu s", "load"],
                              [[r["system"], r["seconds"], r["seconds"] / best,
                                r["cpu_seconds"], r["load"]] for r in rows]))
    print(f"pagedq x: the row's seconds over pagedq's best; load: 1-min load average after the "
          f"run (> {threads}: shared)")
    print(f"pagedq KV blocks at peak: {ours['kv_blocks_peak']}; {args.width} separate sequences "
          f"per request: {ours['kv_blocks_separate']}")
    for pair, same in agree.items():
        x, y = pair.split(" vs ")
        tokens = sum([t for t, _ in a] == [t for t, _ in b] for a, b in zip(beams[x], beams[y],
                                                                          strict=True))
        print(f"{pair}: {sum(same)}/{len(same)} requests with identical beams (cum_logprob "
              f"within 1e-4); {tokens}/{len(same)} with the same hypotheses token for token")
    common.write_json(common.OUT_DIR / f"beam-{args.model}.json",
                      {"args": {k: str(v) for k, v in vars(args).items()}, "results": rows,
                       "identical_beams": agree})


if __name__ == "__main__":
    main()
