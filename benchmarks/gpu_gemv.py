"""On a CUDA GPU: the few-row Triton GEMV (``kernels.triton_gemv``) against cuBLAS
(``F.linear``) on a model's layer shapes, with its launch shapes swept.

Each product runs on cold weights, as in a decode step that walks every layer: a CUDA graph
replays it over enough copies of the weight to overflow L2 (256 MB), and a product's time is
the replay's over the copies. Reported: microseconds a product and the weight bytes' rate
against the copy bandwidth (bytes read + written, as ``gpu_kernels.ceilings``) over two, i.e.
what one direction of the memory moves. The sweep (launch shapes of tiles up to 16 KB) runs at
one row. The down projection is timed as the engine runs it
with few rows: fused with SwiGLU's activation, against ``silu_and_mul`` then cuBLAS.

    python benchmarks/gpu_gemv.py --model random-1b --rows 1,2,4,8 --out gemv.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]
from common import RANDOM_MODELS, format_table, log  # noqa: E402

# isort: split
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels import triton_gemv, triton_rows  # noqa: E402

DEV = torch.device("cuda")
COLD_BYTES = 256 << 20


def _cold_us(make: Callable[[torch.Tensor], object], weights: list[torch.Tensor]) -> float:
    """Microseconds a call of ``make(weight)``, each weight in turn, under a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:3]:
            make(w)  # compiles and warms up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            make(w)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(weights))
    return sorted(times)[len(times) // 2]


def layer_shapes(model: str) -> list[tuple[str, int, int]]:
    c = RANDOM_MODELS[model][1]
    h, heads, kv, inter = c["hidden_size"], c["num_heads"], c["num_kv_heads"], c[
        "intermediate_size"]
    d = h // heads
    return [("qkv", (heads + 2 * kv) * d, h), ("o", h, heads * d), ("gate_up", 2 * inter, h),
            ("down", h, inter)]


def measure(name: str, n: int, k: int, rows: int, bw: float, sweep: bool) -> dict:
    swiglu = name == "down"
    copies = max(4, -(-COLD_BYTES // (n * k * 2)))
    gen = torch.Generator(device=DEV).manual_seed(n + k)
    weights = [(torch.randn(n, k, device=DEV, generator=gen) / k**0.5).bfloat16()
               for _ in range(copies)]
    x = torch.randn(rows, 2 * k if swiglu else k, device=DEV, generator=gen).bfloat16()
    ref = F.linear(triton_rows.silu_and_mul(x) if swiglu else x, weights[0]).float()
    err = (triton_gemv.gemv(x, weights[0], swiglu_input=swiglu).float() - ref).abs().max().item()
    if swiglu:
        cublas = _cold_us(lambda w: F.linear(triton_rows.silu_and_mul(x), w), weights)
    else:
        cublas = _cold_us(lambda w: F.linear(x, w), weights)
    default = _cold_us(lambda w: triton_gemv.gemv(x, w, swiglu_input=swiglu), weights)
    best_us, best = default, triton_gemv.launch_shape(n, k)
    if sweep:
        for bn, bk, warps in itertools.product((2, 4, 8, 16), (256, 512, 1024), (4, 8)):
            if bn * bk > 8192 or bk > k:
                continue
            us = _cold_us(lambda w, s=(bn, bk, warps): triton_gemv.gemv(
                x, w, swiglu_input=swiglu, shape=s), weights)
            if us < best_us:
                best_us, best = us, (bn, bk, warps)
    rate = n * k * 2 / (bw / 2)  # microseconds at one direction's share of the copy rate
    row = {"layer": name, "rows": rows, "n": n, "k": k, "cublas_us": cublas,
           "gemv_us": default, "best_us": best_us, "best_shape": list(best),
           "floor_us": rate * 1e6, "cublas_x_floor": cublas / (rate * 1e6),
           "gemv_x_floor": default / (rate * 1e6), "best_x_floor": best_us / (rate * 1e6),
           "max_abs_err": err}
    del weights
    torch.cuda.empty_cache()
    return row


def main() -> None:
    from gpu_kernels import ceilings

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random-1b", choices=list(RANDOM_MODELS))
    p.add_argument("--rows", default="1,2,4")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    bw, _ = ceilings()
    log(f"{torch.cuda.get_device_name(0)}: copy {bw * 1e-9:,.0f} GB/s (read + written)")
    results = [measure(name, n, k, int(r), bw, not args.no_sweep and r == "1")
               for r in args.rows.split(",") for name, n, k in layer_shapes(args.model)]
    cols = ["layer", "rows", "cublas_us", "gemv_us", "best_us", "best_shape", "floor_us",
            "cublas_x_floor", "gemv_x_floor", "best_x_floor", "max_abs_err"]
    print(format_table(cols, [[r[c] for c in cols] for r in results]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"copy_GB/s": bw * 1e-9, "rows": results}, indent=2))


if __name__ == "__main__":
    main()
