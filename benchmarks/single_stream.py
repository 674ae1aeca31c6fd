"""One user at a time (issue 16): single-stream decode speed and time to first token.

One request at a time, greedy, ``ignore_eos``, --max-tokens new tokens, for each of
--prompt-lens random-token prompts; three ways, alternating over --rounds:

- ``LLM``: the engine's own step loop (``llm.engine``: add_request, then step until done); the
  time of each token is when ``step()`` returns it;
- ``queue``: a ``Client`` (this process) streaming the job from a worker served by
  ``python -m worker`` in a child process on a private redis-server, as deployed (its default
  stream interval: chunks sent each 50 ms where its threads take every core, else each step);
  the time of each token is when ``handle.stream()`` yields its chunk;
- ``queue, each step``: the same from a second worker with ``--stream-interval-ms 0``, which
  sends each step's chunk as it is made (the default before session 60).

TTFT is from the submit to the first token; decode tok/s is (tokens - 1) over the time from the
first token to the last. Beside them, the floor: a decode step reads every weight once (the
tied lm_head once more, packed), so it takes at least weight bytes / memory bandwidth, the
bandwidth measured here as the read rate of a 512 MB sum on the same threads. Greedy tokens
must be equal every way. Prints a table; writes benchmarks/out/single-stream-<model>.json.

    .venv/bin/python benchmarks/single_stream.py --model smollm2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
# benchmarks/queue.py would shadow the standard library's queue (redis-py imports it).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]
import common  # noqa: E402  (first: it sets the environment torch reads at import)

# isort: split
import numpy as np  # noqa: E402
import torch  # noqa: E402

NUM_KV_BLOCKS = 1024  # 16-token blocks: room for the longest prompt and its output


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=common.MODELS, default="smollm2")
    p.add_argument("--prompt-lens", default="128,512,2048")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--skip-queue", action="store_true")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="pagedq's (bfloat16: bf16 weights and KV, float32 activations)")
    p.add_argument("--peers", default="", help="llamacpp: llama-server on F32 weights with an "
                   "f32 KV cache (its arithmetic is pagedq's) and on F16 weights with flash "
                   "attention (its fastest); bash benchmarks/llamacpp_peer.sh builds it")
    args = p.parse_args(argv)
    args.prompt_lens = [int(n) for n in args.prompt_lens.split(",") if n]
    return args


def read_bandwidth_gb_s() -> float:
    """The best of 5 reads of a 512 MB tensor (a sum), in GB/s."""
    data = torch.ones(128 << 20)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def step_bytes(llm: Any) -> int:
    """The bytes a batch-1 decode step reads: every parameter and packed weight once, less the
    embedding table (one row of it is read)."""
    model = llm.engine.model_runner.model
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]
                if t.dim() >= 2)
    packed = sum(m.packed.numel() * m.packed.element_size() for m in model.modules()
                 if hasattr(m, "packed"))
    return total + packed - model.model.embed_tokens.weight.numel() * 4


def figures(prompt_len: int, submitted: float, times: list[float]) -> dict[str, Any]:
    return {"prompt_len": prompt_len, "ttft_ms": (times[0] - submitted) * 1e3,
            "decode_tok_s": (len(times) - 1) / (times[-1] - times[0])}


def via_llm(llm: Any, prompt: list[int], max_tokens: int) -> tuple[dict[str, Any], list[int]]:
    from engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    times: list[float] = []
    tokens: list[int] = []
    submitted = time.perf_counter()
    engine.add_request("single", prompt, params)
    while engine.has_unfinished():
        for delta in engine.step():
            now = time.perf_counter()
            for sample in delta.samples:
                times += [now] * len(sample.token_ids)
                tokens += sample.token_ids
    return figures(len(prompt), submitted, times), tokens


def via_queue(client: Any, prompt: list[int], max_tokens: int
              ) -> tuple[dict[str, Any], list[int]]:
    from producer.protocol import Chunk

    times: list[float] = []
    tokens: list[int] = []
    submitted = time.perf_counter()
    handle = client.submit(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for event in handle.stream(timeout=300):
        if isinstance(event, Chunk):
            times += [time.perf_counter()] * len(event.token_ids)
            tokens += event.token_ids
    return figures(len(prompt), submitted, times), tokens


def via_llamacpp(server: Any, prompt: list[int], max_tokens: int
                 ) -> tuple[dict[str, Any], list[int]]:
    submitted, times, timings = server.complete(prompt, max_tokens)
    return (figures(len(prompt), submitted, times) | {"server_timings": timings},
            server.tokens(prompt, max_tokens))  # again, untimed: the stream's ids fall short


def start_llamacpp(args: argparse.Namespace, threads: int, stack: ExitStack
                   ) -> list[tuple[str, Any]]:
    """The llama.cpp ways, their servers entered on ``stack``; none (with the reason printed)
    where the peer is not built."""
    if "llamacpp" not in args.peers.split(","):
        return []
    import llamacpp

    if args.model != "smollm2" or (why := llamacpp.missing("f32") or llamacpp.missing("f16")):
        print(f"llama.cpp left out: {why if args.model == 'smollm2' else 'SmolLM2 only'}")
        return []
    ways = []
    ctx = max(args.prompt_lens) + args.max_tokens + 16
    for way, kind, kv, flash in (("llama.cpp F32", "f32", "f32", False),
                                 ("llama.cpp F16+FA", "f16", "f16", True)):
        server = stack.enter_context(llamacpp.LlamaServer(
            kind, threads=threads, ctx=ctx, kv=kv, flash=flash,
            log=common.OUT_DIR / f"single-stream-llamacpp-{kind}.log"))
        ways.append((way, lambda p, s=server: via_llamacpp(s, p, args.max_tokens)))
    return ways


def start_worker(url: str, path: Path, threads: int, dtype: str, queue: str,
                 interval: list[str]) -> subprocess.Popen:
    log_file = open(common.OUT_DIR / f"single-stream-worker-{queue}.log", "w")  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", "worker", "--redis-url", url, "--queue", queue,
         "--model", str(path), "--device", "cpu", "--dtype", dtype,
         "--num-kv-blocks", str(NUM_KV_BLOCKS), "--threads", str(threads), *interval],
        stdout=log_file, stderr=subprocess.STDOUT, env=os.environ.copy(),
        cwd=_HERE.parent)  # from benchmarks/, queue.py would stand in for the stdlib's


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    threads = common.set_threads(args.threads)
    path = common.model_path(args.model)
    from engine import LLM
    from producer import Client
    from worker.redis_server import RedisServer

    rng = np.random.default_rng(0)
    ids = common.usable_token_ids(path)
    # fresh prompts each round, the same for every way in it: no prefix-cache hits on repeats
    prompts = [{n: common.random_prompt(rng, ids, n) for n in args.prompt_lens}
               for _ in range(args.rounds)]
    llm = LLM(str(path), dtype=args.dtype, device="cpu", num_kv_blocks=NUM_KV_BLOCKS)
    bandwidth, weights = read_bandwidth_gb_s(), step_bytes(llm)
    floor = bandwidth * 1e9 / weights
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        ways = [("LLM", lambda p: via_llm(llm, p, args.max_tokens))]
        if not args.skip_queue:
            server = RedisServer().start()
            stack.callback(server.stop)
            for way, queue, interval in (("queue", "single", []), ("queue, each step", "steps",
                                         ["--stream-interval-ms", "0"])):
                worker = start_worker(server.url, path, threads, args.dtype, queue, interval)
                stack.callback(lambda w=worker: (w.terminate(), w.wait(60)))
                client = Client(server.url, queue=queue)
                ways.append((way, lambda p, c=client: via_queue(c, p, args.max_tokens)))
        ways += start_llamacpp(args, threads, stack)
        for _way, run in ways:  # warm-up: numba's first calls, the worker's engine start
            run(common.random_prompt(rng, ids, 16))
        for r in range(args.rounds):
            for n, prompt in prompts[r].items():
                tokens = {}
                for way, run in ways:
                    result, tokens[way] = run(prompt)
                    rows.append(result | {"way": way, "round": r, "load": common.load_average(),
                                          "same_tokens": tokens[way] == tokens["LLM"]})
                    common.log(f"{way} {n}: {result['decode_tok_s']:.1f} tok/s")
    report(args, threads, rows, bandwidth, weights, floor)


def report(args: argparse.Namespace, threads: int, rows: list[dict[str, Any]],
           bandwidth: float, weights: int, floor: float) -> None:
    print(f"\n== single stream: model={args.model}, {args.max_tokens} new tokens, greedy, cpu "
          f"{args.dtype}, {threads} threads ==")
    print(f"floor: {weights / 1e9:.3f} GB read per step at {bandwidth:.1f} GB/s -> at most "
          f"{floor:.1f} tok/s")
    print(common.format_table(
        ["way", "round", "prompt", "TTFT ms", "decode tok/s", "of floor", "same tokens", "load"],
        [[r["way"], r["round"], r["prompt_len"], r["ttft_ms"], r["decode_tok_s"],
          r["decode_tok_s"] / floor, r.get("same_tokens"), r["load"]] for r in rows]))
    for n in args.prompt_lens:
        mine: dict[str, list[float]] = {}
        for r in rows:
            if r["prompt_len"] == n:
                mine.setdefault(r["way"], []).append(r["decode_tok_s"])
        print(f"prompt {n}: decode tok/s over LLM's: " + ", ".join(
            f"{way} {sum(v) / sum(mine['LLM']):.2f}" for way, v in mine.items() if way != "LLM"))
    common.write_json(common.OUT_DIR / f"single-stream-{args.model}.json", {
        "model": args.model, "args": vars(args), "threads": threads, "bandwidth_gb_s": bandwidth,
        "step_bytes": weights, "floor_tok_s": floor, "rows": rows})


if __name__ == "__main__":
    main()
