"""Prompt sharing: one request with n samples vs the same samples as separate requests.

One prompt of --prompt-len random token ids; --n samples at temperature 0.8 (seeded), each
exactly --max-tokens long (ignore_eos). Three rows, each on a fresh pagedq engine:

- ``n=8 shared``: one request with ``n=8``; the samples share the prompt's KV blocks (prefix
  caching off, so only the sharing of a request's samples is measured);
- ``8 separate, no prefix cache``: eight n=1 requests, prefix caching disabled: the baseline
  without any sharing, where every request computes and holds its own copy of the prompt;
- ``8 separate, prefix cache``: the same eight requests with prefix caching on; a request
  admitted after the prompt's blocks are computed reuses them.

Prints each run's peak KV blocks (``stats()["kv_blocks_peak"]``) and its ratio to the shared
run's, output tokens/s and the shared run's tokens/s over each (its speed-up), and writes
benchmarks/out/sharing-<model>.json.

With ``--peers vllm`` the shared request (one prompt, n samples) also runs on vLLM's CPU
build: each system in a process of its own, alternating with pagedq over ``--rounds``
(benchmarks/peers.py), prefix caching on in both (vLLM runs a request's n samples as n
requests and shares the prompt through its prefix cache), ``--calls`` times a process on a
fresh prompt of the same length (its first call, then the steady state); writes
benchmarks/out/sharing-peers-<model>.json. The transformers peers take greedy n=1 requests
only, so they have no part here.

    .venv/bin/python benchmarks/sharing.py
"""

from __future__ import annotations

import argparse
import gc
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
# Python put this folder first on sys.path, where benchmarks/queue.py would shadow the standard
# library's queue (torch imports it): move the folder to the end.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]
from common import (  # noqa: E402  (first: it sets the environment torch reads at import)
    MODELS,
    OUT_DIR,
    format_table,
    load_average,
    log,
    model_path,
    random_prompt,
    set_threads,
    timed,
    usable_token_ids,
    write_json,
)

# isort: split
import numpy as np  # noqa: E402


@dataclass
class Row:
    system: str
    seconds: float
    cpu_seconds: float
    output_tokens: int
    kv_blocks_peak: int
    prefix_cache_hits: int
    preemptions: int
    load: float = field(default_factory=load_average)  # at the end of the run

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="random")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--peers", choices=["vllm"], default=None,
                   help="run the shared request on vLLM too, alternating (benchmarks/peers.py)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the --peers alternation")
    p.add_argument("--calls", type=int, default=2,
                   help="--peers: generate calls per process, each on a fresh prompt of the same "
                        "length (the first call, then the steady state)")
    p.add_argument("--vllm-block-size", type=int, default=128,
                   help="vLLM's KV block size (its CPU build takes multiples of 32)")
    return p.parse_args(argv)


def _params(args: argparse.Namespace, n: int, seed: int) -> Any:
    from engine import SamplingParams

    return SamplingParams(n=n, temperature=args.temperature, seed=seed,
                          max_tokens=args.max_tokens, ignore_eos=True)


def run(system: str, path: Path, prompt: list[int], params: list[Any],
        prefix_caching: bool) -> Row:
    """Runs the requests ``(prompt, params[i])`` together on a fresh engine."""
    from engine import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", device="cpu", enable_prefix_caching=prefix_caching)
    llm.generate([prompt[:8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warm-up, on a prefix too short to fill a block
    outs, seconds, cpu = timed(lambda: llm.generate([prompt] * len(params), params, use_tqdm=False))
    tokens = sum(len(o.token_ids) for out in outs for o in out.outputs)
    expected = sum(p.n * p.max_tokens for p in params)
    if tokens != expected:
        raise RuntimeError(f"{system}: generated {tokens} tokens, expected {expected}")
    stats = llm.stats()
    return Row(system, seconds, cpu, tokens, int(stats["kv_blocks_peak"]),
               int(stats["prefix_cache_hits"]), int(stats["preemptions"]))


def report(name: str, rows: list[Row], args: argparse.Namespace, threads: int) -> None:
    shared = rows[0]
    table = [[r.system, r.kv_blocks_peak, r.kv_blocks_peak / shared.kv_blocks_peak, r.seconds,
              r.tok_s, shared.tok_s / r.tok_s, r.cpu_seconds, r.cpu_seconds / shared.cpu_seconds,
              r.prefix_cache_hits, r.load] for r in rows]
    print(f"\n== sharing: model={name}, {args.n} samples of a {args.prompt_len}-token prompt, "
          f"{args.max_tokens} tokens each, temperature {args.temperature}, {threads} threads ==")
    print(format_table(["run", "peak KV blocks", "blocks / shared", "seconds", "output tok/s",
                        "shared x", "cpu s", "shared x (cpu)", "prefix hit tokens", "load"],
                       table))
    print(f"blocks / shared: the row's peak over the shared run's; shared x: the shared run's "
          f"tok/s over the row's; (cpu): the same in CPU seconds; load: 1-min load average "
          f"after the run (> {threads}: shared cores)")
    write_json(OUT_DIR / f"sharing-{name}.json", {
        "model": name, "args": vars(args), "threads": threads,
        "rows": [asdict(r) | {"tok_s": r.tok_s} for r in rows],
    })


def bench_peers(path: Path, prompt: list[int], args: argparse.Namespace, threads: int) -> None:
    import peers

    rng, ids = np.random.default_rng(args.seed + 1), usable_token_ids(path)
    prompts = [prompt] + [random_prompt(rng, ids, len(prompt)) for _ in range(args.calls - 1)]
    calls = [[{"prompt": p, "n": args.n, "temperature": args.temperature, "seed": args.seed,
               "max_tokens": args.max_tokens}] for p in prompts]
    spec = peers.make_spec(path, calls, threads=threads, block_size=16,
                           vllm_block_size=args.vllm_block_size, prefix_caching=True)
    peers.compare(f"sharing: model={args.model}, n={args.n} on a {args.prompt_len}-token "
                  f"prompt, {args.max_tokens} tokens each, temperature {args.temperature}",
                  ["pagedq", "vllm"], spec, args.rounds, f"sharing-peers-{args.model}",
                  vars(args))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    path = model_path(args.model)
    prompt = random_prompt(np.random.default_rng(args.seed), usable_token_ids(path),
                           args.prompt_len)
    if args.peers:
        bench_peers(path, prompt, args, threads)
        return
    separate = [_params(args, 1, args.seed + i) for i in range(args.n)]
    plans = [(f"n={args.n} shared", [_params(args, args.n, args.seed)], False),
             (f"{args.n} separate, no prefix cache", separate, False),
             (f"{args.n} separate, prefix cache", separate, True)]
    rows = []
    for system, params, caching in plans:
        rows.append(run(system, path, prompt, params, caching))
        gc.collect()  # drop the engine and its KV pool before the next one
        log(f"{system}: {rows[-1].seconds:.1f}s, peak {rows[-1].kv_blocks_peak} blocks")
    report(args.model, rows, args, threads)


if __name__ == "__main__":
    main()
