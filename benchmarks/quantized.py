"""Quantized weights against float32 on the CPU: weight memory and decode tok/s.

A ~0.4B random Llama (hidden 1536, 16 layers, MLP 4096) quantized by llm-compressor in
.venv-quant (tests/quant_fixtures.py; round-to-nearest W4A16 group 128 and W8A16 channel,
FP8_DYNAMIC), each loaded by pagedq in bfloat16 (where torch's int kernels run; in float32
pagedq dequantizes at load, see engine/quantization/linear.py) beside the float original in
float32 and bfloat16; peers alternate within each round, the best round counts. Greedy
agreement: the share of generated tokens equal to float32's, position by position.

    .venv/bin/python benchmarks/quantized.py [--batch 4] [--new 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# as in throughput.py: this folder last (its queue.py would shadow the standard library's),
# the repository first (tests.quant_fixtures makes the checkpoints)
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path
                                     if Path(p or ".").resolve() != _HERE] + [str(_HERE)]
from common import (  # noqa: E402  (first: it sets the environment torch reads at import)
    OUT_DIR,
    format_table,
    load_average,
    random_prompt,
    set_threads,
    timed,
    usable_token_ids,
)

# isort: split
import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.quantization import Fp8Linear, IntQuantLinear  # noqa: E402
from engine.random_model import build_random_checkpoint  # noqa: E402
from tests.quant_fixtures import quantized  # noqa: E402

SHAPE = {"hidden_size": 1536, "num_layers": 16, "num_heads": 12, "num_kv_heads": 4,
         "intermediate_size": 4096, "init_std": 0.02}
RECIPES = {"W4A16 g128 bf16": "rtn-w4-g128", "W8A16 channel bf16": "rtn-w8-gch",
           "FP8 W8A8 bf16": "fp8-dynamic"}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the model's layers hold (parameters, buffers, and the packed
    layouts they keep as plain attributes), each storage counted once (oneDNN's packed
    weights, opaque, by their own size)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        values = [*module._parameters.values(), *module._buffers.values(),
                  *vars(module).values()]
        for value in values:
            for t in value if isinstance(value, tuple) else (value,):
                if not isinstance(t, torch.Tensor):
                    continue
                if t.is_mkldnn:
                    seen[id(t)] = t.numel() * t.element_size()
                else:
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    threads = set_threads(args.threads)
    source = build_random_checkpoint(OUT_DIR / "random-llama-0.4b", "llama", **SHAPE)
    peers = {"float32": (source, "float32"), "bfloat16": (source, "bfloat16")} | {
        k: (quantized(source, r), "bfloat16") for k, r in RECIPES.items()}
    llms = {name: LLM(str(path), dtype=dtype, device="cpu", num_kv_blocks=64)
            for name, (path, dtype) in peers.items()}
    rng = np.random.default_rng(0)
    ids = usable_token_ids(source)
    prompts = [random_prompt(rng, ids, args.prompt_len) for _ in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
    best: dict[str, float] = {}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            outs, wall, _ = timed(lambda llm=llm: llm.generate(prompts, params, use_tqdm=False))
            tokens[name] = [o.outputs[0].token_ids for o in outs]
            best[name] = max(best.get(name, 0.0), args.batch * args.new / wall)
    ref = np.array(tokens["float32"])
    fp32_bytes = weight_bytes(llms["float32"].engine.model_runner.model)
    rows = []
    for name, llm in llms.items():
        nbytes = weight_bytes(llm.engine.model_runner.model)
        layouts = {m.layout for m in llm.engine.model_runner.model.modules()
                   if isinstance(m, IntQuantLinear | Fp8Linear)} or {"-"}
        rows.append([name, llm.stats()["quantization"], ",".join(sorted(layouts)),
                     f"{nbytes / 2**20:.0f}",
                     f"{nbytes / fp32_bytes:.2f}", f"{best[name]:.1f}",
                     f"{best[name] / best['float32']:.2f}",
                     f"{(np.array(tokens[name]) == ref).mean():.2f}"])
    print(format_table(["weights", "quantization", "layout", "MiB", "x fp32", "tok/s", "x fp32",
                        "greedy = fp32"], rows))
    print(f"batch {args.batch}, prompt {args.prompt_len}, {args.new} new tokens, {threads} "
          f"threads, best of {args.rounds} rounds, load average {load_average():.2f}")


if __name__ == "__main__":
    main()
