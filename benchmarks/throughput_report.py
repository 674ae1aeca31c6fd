"""benchmarks/throughput.py's report of one model's standalone runs: a row per system with
pagedq's ratio to it (wall and CPU), the best transformers run of each kind, pagedq's KV
figures, greedy agreement on the first requests, and benchmarks/out/throughput-<model>.json."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from common import OUT_DIR, Result, Workload, format_table, shared_prefix, write_json


def agreement(reference: list[list[int]], other: list[list[int]]) -> list[int | None]:
    """Per request: None where the tokens agree, else the index of the first difference."""
    return [None if a == b else shared_prefix(a, b)
            for a, b in zip(reference, other, strict=True)]


def report(name: str, wl: Workload, results: list[Result], checks: dict[str, Any],
           args: argparse.Namespace, threads: int) -> None:
    ours = results[0]
    rows = [[r.system, r.seconds, r.tok_s, ours.tok_s / r.tok_s, r.cpu_seconds, r.tok_cpu_s,
             ours.tok_cpu_s / r.tok_cpu_s, r.load] for r in results]
    print(f"\n== throughput: model={name}, {len(wl.prompts)} requests, {wl.prompt_tokens} prompt "
          f"+ {wl.output_tokens} output tokens, {args.device} {args.dtype}, {threads} threads ==")
    print(format_table(["system", "seconds", "output tok/s", "pagedq x", "cpu s", "tok/cpu-s",
                        "pagedq x (cpu)", "load"], rows))
    print(f"pagedq x: pagedq's tok/s over the row's; (cpu): the same per CPU-second, steadier "
          f"when others share the cores; load: 1-min load average after the run (> {threads}: "
          f"shared)")
    for peer in ("hf-static", "hf-cb"):
        runs = [r for r in results if r.system.startswith(peer)]
        if runs:
            best = max(runs, key=lambda r: r.tok_s)
            print(f"best {peer}: {best.system} -> pagedq x{ours.tok_s / best.tok_s:.2f}")
    print(f"pagedq: block_size={ours.extra['block_size']}, "
          f"kv_blocks_peak={ours.extra['kv_blocks_peak']} of "
          f"{ours.extra['kv_blocks_total']}, kv_utilization_at_peak="
          f"{ours.extra['kv_utilization_at_peak']:.3f}, preemptions={ours.extra['preemptions']}")
    for system, firsts in checks.items():
        verdict = "agree" if all(f is None for f in firsts) else f"DIFFER (first diff {firsts})"
        print(f"greedy tokens, first {len(firsts)} requests, pagedq vs {system}: {verdict}")
    write_json(OUT_DIR / f"throughput-{name}.json", {
        "model": name, "args": {k: v for k, v in vars(args).items()}, "threads": threads,
        "num_requests": len(wl.prompts), "prompt_tokens": wl.prompt_tokens,
        "output_tokens": wl.output_tokens,
        "results": [asdict(r) | {"tok_s": r.tok_s, "pagedq_ratio": ours.tok_s / r.tok_s,
                                 "tok_cpu_s": r.tok_cpu_s,
                                 "pagedq_cpu_ratio": ours.tok_cpu_s / r.tok_cpu_s}
                    for r in results],
        "greedy_agreement_first_diff": checks,
    })
