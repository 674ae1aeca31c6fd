"""Async scheduling against none, in one process on one engine: ``throughput.py``'s workload
(its engine settings, greedy, ignore_eos) on fresh prompts each round, the engine's
``async_scheduling`` switched between calls, the modes alternating; the same prompts for both
modes of a round (the prefix cache off, so neither finds the other's blocks), their tokens
compared.

    python benchmarks/async_ab.py --model random-1b --device cuda --dtype bfloat16 \\
        --num-requests 256 --rounds 2
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]
from common import format_table, log, model_path, timed, usable_token_ids  # noqa: E402

# isort: split
from throughput import (  # noqa: E402
    PAGEDQ_MAX_BATCHED_TOKENS,
    PAGEDQ_MAX_NUM_SEQS,
    fresh_prompts,
    make_workload,
    parse_args,
)


def main() -> None:
    from engine import LLM, SamplingParams

    args = parse_args()  # throughput.py's, --rounds included
    path = model_path(args.model)
    wl = make_workload(path, args)
    llm = LLM(str(path), dtype=args.dtype, device=args.device, enable_prefix_caching=False,
              block_size=args.block_size or 16, max_num_seqs=PAGEDQ_MAX_NUM_SEQS,
              max_num_batched_tokens=PAGEDQ_MAX_BATCHED_TOKENS)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    llm.generate([p[::-1] for p in wl.prompts[:32]], params[:32], use_tqdm=False)  # compiles
    ids = usable_token_ids(path)
    rows, agree = [], []
    for r in range(args.rounds):
        prompts = fresh_prompts(wl, ids, args.seed + 100 + r).prompts
        tokens = {}
        for mode in (False, True):
            llm.engine.async_scheduling = mode
            outs, seconds, cpu = timed(lambda p=prompts: llm.generate(p, params, use_tqdm=False))
            tokens[mode] = [o.outputs[0].token_ids for o in outs]
            n = sum(map(len, tokens[mode]))
            rows.append([r, "on" if mode else "off", seconds, n / seconds, cpu])
            log(f"round {r} async {mode}: {seconds:.3f} s, {n / seconds:,.0f} tok/s")
        agree.append(sum(a == b for a, b in zip(tokens[False], tokens[True], strict=True)))
    print(format_table(["round", "async", "s", "tok/s", "cpu s"], rows), flush=True)
    print(f"identical outputs: {agree} of {len(wl.prompts)} a round", flush=True)


if __name__ == "__main__":
    main()
