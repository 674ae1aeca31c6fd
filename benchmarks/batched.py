"""Batched throughput against llama.cpp (issue 16): --concurrent requests at once, each a
random-token prompt of --prompt-len tokens and --max-tokens new ones, greedy, ``ignore_eos``.

- ``pagedq``: ``LLM.generate`` on all of them at once, in this process;
- ``llama.cpp F32``: ``llama-server`` on F32 weights with an f32 KV cache and one slot per
  request (``-np``), every request posted at once from its own thread, not streamed, as
  ``generate`` returns (the arithmetic of pagedq's fp32 engine, so greedy tokens should agree);
- ``llama.cpp F16+FA``: F16 weights, f16 KV, flash attention (its fastest here).

Alternating over --rounds; prints output tok/s, the ratio to pagedq and greedy agreement.
Needs ``bash benchmarks/llamacpp_peer.sh``; SmolLM2 only (the GGUF files are of it).

    .venv/bin/python benchmarks/batched.py --concurrent 32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
# benchmarks/queue.py would shadow the standard library's queue (redis-py imports it).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]
import common  # noqa: E402  (first: it sets the environment torch reads at import)

# isort: split
import llamacpp  # noqa: E402
import numpy as np  # noqa: E402


def run_pagedq(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def run_llamacpp(server: llamacpp.LlamaServer, prompts: list[list[int]],
                 max_tokens: int) -> tuple[float, list]:
    from concurrent.futures import ThreadPoolExecutor  # after the path fix (queue.py)

    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(lambda p: server.tokens(p, max_tokens), prompts))
    return time.perf_counter() - start, done


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrent", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="pagedq's (bfloat16: bf16 weights and KV, float32 activations)")
    args = p.parse_args(argv)
    if why := llamacpp.missing("f32") or llamacpp.missing("f16"):
        sys.exit(f"llama.cpp peer missing: {why}")
    threads = common.set_threads(args.threads)
    path = common.model_path("smollm2")
    from engine import LLM

    rng = np.random.default_rng(0)
    ids = common.usable_token_ids(path)
    # fresh prompts each round: a repeat would hit pagedq's prefix cache (llama.cpp's servers
    # start afresh each round), and skip the prefill
    prompts = [[common.random_prompt(rng, ids, args.prompt_len) for _ in range(args.concurrent)]
               for _ in range(args.rounds)]
    # the pool reserved at start-up, as llama-server allocates and clears its KV cache
    llm = LLM(str(path), dtype=args.dtype, device="cpu", reserve_kv_cache=True)
    run_pagedq(llm, [common.random_prompt(rng, ids, 8)], 4)  # warm-up: numba's first calls
    ctx = args.prompt_len + args.max_tokens + 16
    servers = {way: llamacpp.LlamaServer(kind, threads=threads, slots=args.concurrent, ctx=ctx,
                                         kv=kind, flash=kind == "f16")
               for way, kind in (("llama.cpp F32", "f32"), ("llama.cpp F16+FA", "f16"))}
    rows = []
    for r in range(args.rounds):
        seconds, ours = run_pagedq(llm, prompts[r], args.max_tokens)
        rows.append({"way": "pagedq", "round": r, "seconds": seconds, "same": len(ours)})
        for way, server in servers.items():
            with server:
                seconds, theirs = run_llamacpp(server, prompts[r], args.max_tokens)
            same = sum(a == b for a, b in zip(ours, theirs, strict=True))
            rows.append({"way": way, "round": r, "seconds": seconds, "same": same})
        for row in rows[-3:]:
            row["tok_s"] = args.concurrent * args.max_tokens / row["seconds"]
            row["load"] = common.load_average()
    print(f"\n== {args.concurrent} concurrent requests: SmolLM2, {args.prompt_len}-token prompts, "
          f"{args.max_tokens} new tokens, greedy, pagedq {args.dtype}, {threads} threads ==")
    print(common.format_table(
        ["way", "round", "seconds", "output tok/s", "pagedq x", "same tokens", "load"],
        [[r["way"], r["round"], r["seconds"], r["tok_s"],
          next(x["tok_s"] for x in rows if x["way"] == "pagedq" and x["round"] == r["round"])
          / r["tok_s"], f"{r['same']}/{args.concurrent}", r["load"]] for r in rows]))
    common.write_json(common.OUT_DIR / "batched-smollm2.json", {"args": vars(args),
                                                                   "rows": rows})


if __name__ == "__main__":
    main()
