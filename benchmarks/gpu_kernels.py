"""On a CUDA GPU: each Triton kernel against its torch reference and its bandwidth floor, and
the engine's decode step against its floor (weights + KV bytes over the copy bandwidth).

The floor is the fewest bytes an op must move (each input read once, each output written
once) over the device-to-device copy bandwidth measured here (bytes read + written), or, for
prefill, its FLOPs over the measured bf16 matmul rate when that is larger. Kernel times are
``triton.testing.do_bench`` medians (L2 flushed before each run); inputs are random.

    python benchmarks/gpu_kernels.py --kernels --decode random-1b smollm2 --out out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]
from common import format_table, log, model_path  # noqa: E402

# isort: split
import torch  # noqa: E402
import triton  # noqa: E402

from kernels import reference, triton_ops  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
# Llama-3-8B's attention: 32 query heads, 8 KV heads of 128; blocks of 16 tokens.
H_Q, H_KV, D, BS = 32, 8, 128, 16


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds."""
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def ceilings() -> tuple[float, float]:
    """Copy bandwidth (bytes read + written per second) and the bf16 matmul rate (FLOP/s)."""
    src = torch.randn(2**28, device=DEV)  # 1 GiB
    dst = torch.empty_like(src)
    bw = 2 * src.nbytes / (bench(lambda: dst.copy_(src)) * 1e-3)
    a, b = (torch.randn(8192, 8192, device=DEV, dtype=BF16) for _ in range(2))
    rate = 2 * 8192**3 / (bench(lambda: a @ b) * 1e-3)
    return bw, rate


def paged_pool(ctx_lens: list[int]) -> tuple[torch.Tensor, ...]:
    """Random k/v pools holding each context in shuffled blocks, the tables and lengths."""
    counts = [-(-c // BS) for c in ctx_lens]
    num_blocks = sum(counts) + 1
    k, v = (torch.randn(num_blocks, BS, H_KV, D, device=DEV, dtype=BF16) for _ in range(2))
    perm = torch.randperm(num_blocks - 1) + 1
    tables = torch.zeros(len(ctx_lens), max(counts), dtype=torch.int32)
    at = 0
    for i, n in enumerate(counts):
        tables[i, :n] = perm[at:at + n]
        at += n
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
    return k, v, tables.to(DEV), lens


def kernel_cases() -> list[tuple[str, Callable, Callable, int, float, Callable]]:
    """(name, triton call, reference call, floor bytes, FLOPs, check) per case."""
    cases = []
    item = 2  # bf16
    scales = {"k_scale": torch.tensor(0.02, device=DEV), "v_scale": torch.tensor(0.01, device=DEV)}
    for batch, ctx in [(1, 4096), (32, 1024), (32, 4096), (256, 1024)]:
        k, v, tables, lens = paged_pool([ctx] * batch)
        q = torch.randn(batch, H_Q, D, device=DEV, dtype=BF16)
        args = (q, k, v, tables, lens, D**-0.5)
        nbytes = batch * ctx * H_KV * D * 2 * item + 2 * q.nbytes
        cases.append((f"decode B={batch} ctx={ctx}",
                      lambda a=args: triton_ops.paged_attention_decode(*a),
                      lambda a=args: reference.paged_attention_decode(*a), nbytes,
                      4.0 * batch * ctx * H_Q * D, _close(5e-2)))
        # fp8 (e4m3) KV: half the KV bytes, so half the floor's KV term
        k8, v8 = (reference.quantize(c, torch.float8_e4m3fn, scales[f"{n}_scale"])
                  for c, n in ((k, "k"), (v, "v")))
        args8 = (q, k8, v8, tables, lens, D**-0.5)
        cases.append((f"decode fp8 B={batch} ctx={ctx}",
                      lambda a=args8: triton_ops.paged_attention_decode(*a, **scales),
                      lambda a=args8: reference.paged_attention_decode(*a, **scales),
                      nbytes - batch * ctx * H_KV * D * 2, 4.0 * batch * ctx * H_Q * D,
                      _close(5e-2)))
    for seqs in [[(2048, 2048)] * 4, [(512, 2048)] * 4]:  # (new, context): fresh, chunked
        k, v, tables, lens = paged_pool([c for _, c in seqs])
        cu = torch.tensor([0] + [n for n, _ in seqs]).cumsum(0).to(DEV, torch.int32)
        q = torch.randn(int(cu[-1]), H_Q, D, device=DEV, dtype=BF16)
        args = (q, k, v, cu, tables, lens, D**-0.5)
        nbytes = sum(c for _, c in seqs) * H_KV * D * 2 * item + 2 * q.nbytes
        flops = sum(4.0 * n * (c - n / 2) * H_Q * D for n, c in seqs)  # causal half
        cases.append((f"prefill {len(seqs)}x{seqs[0][0]} new of {seqs[0][1]}",
                      lambda a=args: triton_ops.paged_attention_prefill(*a),
                      lambda a=args: reference.paged_attention_prefill(*a), nbytes, flops,
                      _close(5e-2)))
    for tokens in [256, 2048]:
        key, value = (torch.randn(tokens, H_KV, D, device=DEV, dtype=BF16) for _ in range(2))
        k, v = (torch.empty(tokens // BS * 4, BS, H_KV, D, device=DEV, dtype=BF16) for _ in "kv")
        slots = torch.randperm(k.shape[0] * BS, device=DEV)[:tokens]
        args = (key, value, k, v, slots)
        cases.append((f"store_kvcache T={tokens}", lambda a=args: triton_ops.store_kvcache(*a),
                      lambda a=args: reference.store_kvcache(*a), 4 * key.nbytes, 0.0, None))
    pool = torch.randn(2, 32, 2048, BS, H_KV, D, device=DEV, dtype=BF16)
    caches = list(pool.flatten(0, 1))
    mapping = torch.randperm(2048, device=DEV)[:64].view(2, 32).t().contiguous()
    cases.append(("copy_blocks 32 pairs x 64 caches",
                  lambda: triton_ops.copy_blocks(caches, mapping),
                  lambda: reference.copy_blocks(caches, mapping),
                  2 * 32 * 64 * caches[0][0].nbytes, 0.0, None))
    for rows in [256, 2048]:
        x, res = (torch.randn(rows, 4096, device=DEV, dtype=BF16) for _ in range(2))
        w = torch.randn(4096, device=DEV, dtype=BF16)
        args = (x, w, 1e-6, res)
        cases.append((f"rms_norm+residual {rows}x4096", lambda a=args: triton_ops.rms_norm(*a),
                      lambda a=args: reference.rms_norm(*a), 4 * x.nbytes, 0.0, _close(2e-2)))
    tokens = 2048
    qkv = torch.randn(tokens, H_Q + 2 * H_KV, D, device=DEV, dtype=BF16)
    q, k = qkv[:, :H_Q], qkv[:, H_Q:H_Q + H_KV]
    inv = 1.0 / 500000.0 ** (torch.arange(0, D, 2, device=DEV).float() / D)
    emb = torch.outer(torch.arange(8192, device=DEV).float(), inv).repeat(1, 2)
    cos, sin = emb.cos(), emb.sin()
    pos = torch.randint(0, 8192, (tokens,), device=DEV)
    args = (q, k, cos, sin, pos)
    cases.append((f"rotary T={tokens}", lambda a=args: triton_ops.rotary(*a),
                  lambda a=args: reference.rotary(*a),
                  2 * (q.numel() + k.numel()) * item + 2 * tokens * D * 4, 0.0, _close(1e-2)))
    return cases


def _close(tol: float) -> Callable[[object, object], None]:
    def check(got: object, want: object) -> None:
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        for g, w in zip(got, want, strict=True):
            assert g.isfinite().all(), "non-finite output"
            torch.testing.assert_close(g.float(), w.float(), atol=tol, rtol=tol)
    return check


def run_kernels(bw: float, rate: float) -> list[dict]:
    rows = []
    for name, fast, ref, nbytes, flops, check in kernel_cases():
        if check is not None:
            check(fast(), ref())
        t_fast, t_ref = bench(fast), bench(ref)
        floor = max(nbytes / bw, flops / rate) * 1e3
        rows.append({"kernel": name, "triton_ms": t_fast, "torch_ms": t_ref,
                     "speedup": t_ref / t_fast, "floor_ms": floor, "x_floor": t_fast / floor,
                     "GB/s": nbytes / t_fast * 1e-6, "TFLOP/s": flops / t_fast * 1e-9})
        log(f"{name}: triton {t_fast:.4f} ms, torch {t_ref:.4f} ms, floor {floor:.4f} ms")
    return rows


def run_decode(name: str, batches: list[int], prompt_len: int, steps: int, bw: float,
               cuda_graphs: bool = False) -> list[dict]:
    """Median ``engine.step()`` (and model forward) time with every sequence decoding."""
    from engine import LLM, SamplingParams

    path = model_path(name)
    llm = LLM(str(path), dtype="bfloat16", device="cuda", max_num_seqs=max(batches),
              enforce_eager=not cuda_graphs)
    engine = llm.engine
    runner = engine.model_runner
    weights = {p.data_ptr(): p.nbytes for p in runner.model.parameters()}
    weight_bytes = sum(weights.values())
    token_kv_bytes = runner.kv_cache[:, :, 0, 0].nbytes  # K and V of one token, all layers
    forward_ms: list[float] = []
    run = runner.run

    def timed_run(batch: object) -> object:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = run(batch)
        torch.cuda.synchronize()
        forward_ms.append((time.perf_counter() - t0) * 1e3)
        return result

    runner.run = timed_run
    rows = []
    gen = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size
    for batch in batches:
        ids = [f"d{batch}-{i}" for i in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True)
        for rid in ids:
            engine.add_request(rid, torch.randint(3, vocab, (prompt_len,), generator=gen).tolist(),
                               params)
        seqs = [s for rid in ids for s in engine.requests[rid].seqs]
        while min(s.num_output_tokens for s in seqs) < 1:  # prefill every prompt
            engine.step()
        for _ in range(3):
            engine.step()
        step_ms = []
        forward_ms.clear()
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.step()
            step_ms.append((time.perf_counter() - t0) * 1e3)
        ctx = sum(len(s) for s in seqs)
        floor = (weight_bytes + ctx * token_kv_bytes) / bw * 1e3
        step, fwd = statistics.median(step_ms), statistics.median(forward_ms)
        rows.append({"model": name, "batch": batch, "context": prompt_len, "step_ms": step,
                     "forward_ms": fwd, "floor_ms": floor, "x_floor": step / floor,
                     "tok_s": batch / step * 1e3, "cuda_graphs": cuda_graphs})
        log(f"decode {name} B={batch}: step {step:.3f} ms, forward {fwd:.3f} ms, "
            f"floor {floor:.3f} ms")
        for rid in ids:
            engine.abort(rid)
    del llm, engine, runner
    torch.cuda.empty_cache()
    return rows


def _table(rows: list[dict]) -> None:
    print(format_table(list(rows[0]), [list(r.values()) for r in rows]), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", action="store_true")
    p.add_argument("--decode", nargs="*", default=[], help="models for the decode-step timing")
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--cuda-graphs", action="store_true", help="also time with CUDA graphs")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    props = torch.cuda.get_device_properties(0)
    bw, rate = ceilings()
    info = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "copy_GB/s": bw * 1e-9, "bf16_TFLOP/s": rate * 1e-12}
    print(json.dumps(info))
    result: dict = {"info": info}
    if args.kernels:
        result["kernels"] = run_kernels(bw, rate)
        _table(result["kernels"])
    batches = [int(b) for b in args.batches.split(",")]
    result["decode"] = []
    for name in args.decode:
        for graphs in [False, True] if args.cuda_graphs else [False]:
            result["decode"] += run_decode(name, batches, args.prompt_len, args.steps, bw, graphs)
    if result["decode"]:
        _table(result["decode"])
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
