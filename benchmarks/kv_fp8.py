"""fp8 KV cache against the full-precision one: pagedq's offline throughput on throughput.py's
workload, ``auto`` and ``fp8`` alternating in one process, at each KV budget given.

At the default budget both pools hold the whole workload, so the figure is fp8's cost: every
store quantizes and every read widens bytes through a table. At a tight budget the fp32 pool
preempts (recomputing prompts) where the fp8 one holds 4x the blocks: that is where fp8 pays.
Prints tok/s, the fp8/auto ratio per budget, blocks, preemptions and greedy agreement.

    .venv/bin/python benchmarks/kv_fp8.py --model random --num-requests 64 --budgets 4,0.02
"""

from __future__ import annotations

import argparse
import sys

import throughput  # first: it fixes sys.path and the environment torch reads
from common import OUT_DIR, format_table, load_average, log, model_path, set_threads, write_json

DTYPES = ("auto", "fp8")


def main(argv: list[str] | None = None) -> None:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--budgets", default="4,0.02", help="kv_cache_memory_gib values, GiB")
    extra.add_argument("--rounds", type=int, default=1, help="auto/fp8 pairs per budget")
    ours, rest = extra.parse_known_args(argv)
    args = throughput.parse_args(rest)
    threads = set_threads(args.threads)
    name = "random" if args.model == "both" else args.model
    path = model_path(name)
    wl = throughput.make_workload(path, args)
    rows, results = [], []
    for budget in [float(b) for b in ours.budgets.split(",")]:
        runs: dict[str, list] = {d: [] for d in DTYPES}
        for _ in range(ours.rounds):
            for dtype in DTYPES:
                args.kv_cache_dtype, args.kv_cache_memory_gib = dtype, budget
                result, tokens = throughput.run_pagedq(path, wl, args)
                log(f"{budget} GiB {dtype}: {result.tok_s:.1f} tok/s, "
                    f"preemptions {result.extra['preemptions']}")
                runs[dtype].append((result, tokens))
        for dtype in DTYPES:
            best, tokens = max(runs[dtype], key=lambda run: run[0].tok_s)
            ratio = best.tok_s / max(r.tok_s for r, _ in runs["auto"])
            same = sum(a == b for a, b in zip(tokens, runs["auto"][0][1], strict=True))
            rows.append([budget, dtype, best.tok_s, ratio, best.extra["kv_blocks_total"],
                         best.extra["kv_blocks_peak"], best.extra["preemptions"],
                         f"{same}/{len(tokens)}", best.load])
            results.append({"budget_gib": budget, "kv_cache_dtype": dtype, "tok_s": best.tok_s,
                            "fp8_over_auto": ratio, **best.extra, "greedy_same": same})
    print(f"\n== fp8 KV cache: model={name}, {len(wl.prompts)} requests, {wl.prompt_tokens} "
          f"prompt + {wl.output_tokens} output tokens, {args.dtype}, {threads} threads ==")
    print(format_table(["GiB", "kv dtype", "output tok/s", "x auto", "blocks", "peak",
                        "preemptions", "greedy = auto", "load"], rows))
    print(f"best of {ours.rounds} per cell; load: 1-min load average after the run "
          f"(now {load_average():.1f}); greedy = auto: requests whose tokens equal auto's")
    write_json(OUT_DIR / f"kv-fp8-{name}.json", {"model": name, "threads": threads,
                                                  "args": vars(args) | vars(ours),
                                                  "results": results})


if __name__ == "__main__":
    main(sys.argv[1:])
