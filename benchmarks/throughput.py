"""Offline throughput: pagedq vs Hugging Face transformers on the same model and requests.

Workload (as vLLM's benchmark_throughput with random inputs): N requests whose prompts are
random token ids (uniform length in [--min-prompt, --max-prompt], special ids avoided) and
whose output lengths are uniform in [--min-output, --max-output]; greedy, ignore_eos, so every
request generates exactly its own length. Systems, in one process, one after the other:

- pagedq: ``LLM.generate`` on every request at once (continuous batching, paged KV);
- hf-static B=b: ``model.generate`` on the requests chunked in arrival order into batches of b,
  left-padded with an attention mask, ``max_new_tokens = min_new_tokens`` = the batch's longest
  output. Only each request's own output length counts as output (as vLLM's HF backend does);
- hf-cb T:R: transformers' continuous batching (``continuous_batching_context_manager``), each
  request added with its own ``max_new_tokens``, under ``max_batch_tokens=T`` and
  ``max_requests_per_batch=R`` (``--cb-limits``, best of those given). Its CPU attention
  (``sdpa_paged``) attends each step's tokens to the keys of every request in the step under a
  dense mask, so its step cost grows with the square of R: at 128 requests 256:16 ran twice as
  fast as pagedq's own limits 2048:256 (benchmarks/RESULTS.md).

HF's eos is disabled (``eos_token_id`` None / -1) rather than masked, so that no HF run stops
early and greedy tokens stay comparable with pagedq's ``ignore_eos`` (masking eos with
``min_new_tokens`` alone would change the argmax wherever eos wins). Prints a table to stdout
and writes benchmarks/out/throughput-<model>.json (throughput_report.py).

With ``--peers vllm,hf-static,hf-cb`` each system runs the same requests in its own process,
alternating with pagedq over ``--rounds`` (benchmarks/peers.py), with peak RSS and greedy
agreement on every request: benchmarks/out/throughput-peers-<model>.json. A process runs
``--calls`` generates, each on fresh prompts of the same lengths: its first call and its steady
state, reported apart.

    .venv/bin/python benchmarks/throughput.py --model random --num-requests 16
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# Python put this folder first on sys.path, where benchmarks/queue.py would shadow the standard
# library's queue (torch imports it): move the folder to the end.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]
from common import (  # noqa: E402  (first: it sets the environment torch reads at import)
    MODELS,
    Result,
    Workload,
    check_lengths,
    log,
    model_path,
    random_prompt,
    set_threads,
    timed,
    usable_token_ids,
)

# isort: split
import numpy as np  # noqa: E402
import torch  # noqa: E402
from hf_runs import DTYPES, load_hf, run_hf_cb, run_hf_static, static_batch  # noqa: E402
from throughput_report import agreement, report  # noqa: E402

PAGEDQ_MAX_BATCHED_TOKENS = 2048
PAGEDQ_MAX_NUM_SEQS = 256
NUM_CHECKED = 4  # requests whose greedy tokens are compared across systems


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="both",
                   help=f"one of {', '.join(MODELS)}, both, or a checkpoint folder")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--skip-hf-static", action="store_true")
    p.add_argument("--skip-hf-cb", action="store_true")
    p.add_argument("--cb-limits", default="256:16",
                   help="transformers' continuous batching runs, comma-separated "
                        "max_batch_tokens:max_requests_per_batch pairs (pagedq's: 2048:256)")
    p.add_argument("--batch-sizes", default="8,16,32",
                   help="HF static batch sizes, comma-separated")
    p.add_argument("--peers", default="", help="comma-separated: vllm, hf-static, hf-cb")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the --peers alternation")
    p.add_argument("--calls", type=int, default=2,
                   help="--peers: generate calls per process, each on fresh prompts of the same "
                        "lengths (the first call, then the steady state)")
    p.add_argument("--vllm-block-size", type=int, default=128, help="multiple of 32")
    p.add_argument("--device", default="cpu", help="cpu or cuda, for every system")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--kv-cache-dtype", default="auto", help="pagedq's: auto, fp8, fp8_e5m2")
    p.add_argument("--kv-cache-memory-gib", type=float, default=4.0, help="pagedq's CPU KV pool")
    p.add_argument("--block-size", type=int, default=None,
                   help="pagedq's KV block size (default: 8 on the CPU, where the partly filled "
                        "last block of each sequence is the only KV waste; 16 on CUDA and "
                        "in the --peers runs)")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    args.peers = [peer for peer in args.peers.split(",") if peer]
    if set(args.peers) - {"vllm", "hf-static", "hf-cb"}:
        p.error("--peers takes vllm, hf-static and hf-cb")
    try:
        args.cb_limits = [tuple(map(int, pair.split(":"))) for pair in args.cb_limits.split(",")]
    except ValueError:
        p.error("--cb-limits takes pairs like 256:16,2048:256")
    if not (0 < args.min_prompt <= args.max_prompt and 0 < args.min_output <= args.max_output):
        p.error("need 0 < min <= max for prompt and output lengths")
    return args


def make_workload(path: Path, args: argparse.Namespace) -> Workload:
    rng = np.random.default_rng(args.seed)
    ids = usable_token_ids(path)
    n = args.num_requests
    prompt_lens = rng.integers(args.min_prompt, args.max_prompt + 1, n)
    output_lens = rng.integers(args.min_output, args.max_output + 1, n)
    return Workload([random_prompt(rng, ids, int(k)) for k in prompt_lens],
                    [int(k) for k in output_lens])


def fresh_prompts(wl: Workload, ids: np.ndarray, seed: int) -> Workload:
    """``wl``'s lengths with other random token ids (of ``ids``): a call the prefix cache holds
    nothing of."""
    rng = np.random.default_rng(seed)
    return Workload([random_prompt(rng, ids, len(p)) for p in wl.prompts], wl.output_lens)


# ----------------------------------------------------------------------------- pagedq


def run_pagedq(path: Path, wl: Workload,
               args: argparse.Namespace) -> tuple[Result, list[list[int]]]:
    from engine import LLM, SamplingParams

    block_size = args.block_size or (16 if args.device.startswith("cuda") else 8)
    llm = LLM(str(path), dtype=args.dtype, device=args.device, enable_prefix_caching=True,
              block_size=block_size, max_num_seqs=PAGEDQ_MAX_NUM_SEQS,
              max_num_batched_tokens=PAGEDQ_MAX_BATCHED_TOKENS,
              kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory_gib=args.kv_cache_memory_gib)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    if args.device.startswith("cuda"):
        # Triton compiles a variant per new specialisation (split or not, strides divisible by
        # 16...): warm up on a full-length slice, reversed so that no prefix is cached.
        llm.generate([p[::-1] for p in wl.prompts[:32]], params[:32], use_tqdm=False)
    else:
        llm.generate(wl.prompts[:2], SamplingParams(temperature=0, max_tokens=4,
                                                    ignore_eos=True), use_tqdm=False)
    outs, seconds, cpu = timed(lambda: llm.generate(wl.prompts, params))
    tokens = [o.outputs[0].token_ids for o in outs]
    check_lengths("pagedq", tokens, wl.output_lens)
    stats = llm.stats()
    extra = {k: stats[k] for k in ("kv_blocks_peak", "kv_blocks_total", "kv_utilization_at_peak",
                                   "preemptions", "prefix_cache_hits")} | {"block_size": block_size}
    return Result("pagedq", seconds, cpu, sum(map(len, tokens)), extra), tokens


def bench_peers(name: str, path: Path, wl: Workload, args: argparse.Namespace,
                threads: int) -> None:
    """pagedq and each of --peers in processes of their own, alternating over --rounds."""
    import peers

    runs = {"vllm": ["vllm"], "hf-static": [f"hf-static B={b}" for b in args.batch_sizes],
            "hf-cb": [f"hf-cb {t}:{r}" for t, r in args.cb_limits]}
    systems = ["pagedq"] + [system for peer in args.peers for system in runs[peer]]
    # pagedq's default block (16; the standalone run takes 8 for issue 2's KV utilisation
    # figure): against vLLM, 8 cost random-26m 4 % (12.93 against 12.37 s, AMD EPYC Zen 5)
    ids = usable_token_ids(path)
    calls = [wl] + [fresh_prompts(wl, ids, args.seed + 1 + i) for i in range(args.calls - 1)]
    spec = peers.make_spec(path, [peers.greedy_requests(c.prompts, c.output_lens) for c in calls],
                           threads=threads, block_size=args.block_size or 16,
                           vllm_block_size=args.vllm_block_size, prefix_caching=True,
                           max_num_seqs=PAGEDQ_MAX_NUM_SEQS,
                           max_num_batched_tokens=PAGEDQ_MAX_BATCHED_TOKENS, dtype=args.dtype)
    peers.compare(f"throughput: model={name}, {len(wl.prompts)} requests, {wl.prompt_tokens} "
                  f"prompt + {wl.output_tokens} output tokens, cpu {args.dtype}", systems, spec,
                  args.rounds, f"throughput-peers-{name}", vars(args))


def bench_model(name: str, args: argparse.Namespace, threads: int) -> None:
    path = model_path(name)
    name = path.name if Path(name).is_dir() else name  # a folder: its name in the output
    wl = make_workload(path, args)
    log(f"{name}: {len(wl.prompts)} requests, {wl.prompt_tokens} prompt tokens, "
        f"{wl.output_tokens} output tokens")
    if args.peers:
        bench_peers(name, path, wl, args, threads)
        return
    ours, our_tokens = run_pagedq(path, wl, args)
    gc.collect()  # the engine and its KV pool are garbage now
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # hand the KV pool back for transformers' caches
    log(f"pagedq: {ours.seconds:.1f}s, {ours.tok_s:.1f} tok/s")
    results, checks = [ours], {}
    if args.skip_hf_static and args.skip_hf_cb:
        report(name, wl, results, checks, args, threads)
        return
    model = load_hf(path, args)
    static_batch(model, wl.prompts[:2], 4)  # warm-up
    k = min(NUM_CHECKED, len(wl.prompts))
    for b in [] if args.skip_hf_static else args.batch_sizes:
        result, tokens = run_hf_static(model, wl, b)
        log(f"{result.system}: {result.seconds:.1f}s, {result.tok_s:.1f} tok/s")
        results.append(result)
        checks.setdefault("hf-static", agreement(our_tokens[:k], tokens[:k]))
    for limits in [] if args.skip_hf_cb else args.cb_limits:
        result, tokens = run_hf_cb(model, wl, limits)
        log(f"{result.system}: {result.seconds:.1f}s, {result.tok_s:.1f} tok/s")
        results.append(result)
        checks.setdefault("hf-cb", agreement(our_tokens[:k], tokens[:k]))
    report(name, wl, results, checks, args, threads)
    del model
    gc.collect()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    for name in ("random", "smollm2") if args.model == "both" else [args.model]:
        bench_model(name, args, threads)


if __name__ == "__main__":
    main()
