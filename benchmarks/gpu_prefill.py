"""On a CUDA GPU: prefill attention. The paged Triton kernel's launch shapes on fresh and
chunked prompts (``sweep_prefill``), torch's fused attention on the same fresh prompts
(``attention_peers``), and the engine's two routes for fresh prompts (``fresh_prefill``); each
checked against the torch reference, TFLOP/s against the matmul rate. Run through
``gpu_profile.py`` (``--sweep``, ``--attention-peers``, ``--fresh``)."""

from __future__ import annotations

import inspect
import itertools
import time

import torch
from common import format_table, log
from gpu_kernels import DEV, H_KV, H_Q, D, bench, paged_pool

from kernels import reference
from kernels.triton_prefill import PrefillTiles, paged_attention_prefill


def sweep_prefill(rate: float) -> list[dict]:
    rows = []
    shapes = [PrefillTiles(m, n, w, s) for m, n, w, s in itertools.product(
        (64, 128), (32, 64, 128), (4, 8), (2, 3)) if not (m == 64 and w == 8)]
    for seqs in [[(2048, 2048)] * 4, [(512, 2048)] * 4]:
        k, v, tables, lens = paged_pool([c for _, c in seqs])
        cu = torch.tensor([0] + [n for n, _ in seqs]).cumsum(0).to(DEV, torch.int32)
        q = torch.randn(int(cu[-1]), H_Q, D, device=DEV, dtype=torch.bfloat16)
        args = (q, k, v, cu, tables, lens, D**-0.5)
        want = reference.paged_attention_prefill(*args).float()
        flops = sum(4.0 * n * (c - n / 2) * H_Q * D for n, c in seqs)
        case = f"{len(seqs)}x{seqs[0][0]} new of {seqs[0][1]}"
        for tiles in shapes:
            try:
                got = paged_attention_prefill(*args, tiles=tiles)
                torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)
                ms = bench(lambda a=args, t=tiles: paged_attention_prefill(*a, tiles=t))
            except Exception as exc:  # out of shared memory, registers: the shape is out
                log(f"{case} {tiles}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            rows.append({"case": case, **tiles._asdict(), "ms": ms,
                         "TFLOP/s": flops / ms * 1e-9, "of_matmul": flops / ms * 1e3 / rate})
        best = max((r for r in rows if r["case"] == case), key=lambda r: r["TFLOP/s"])
        log(f"prefill {case}: best {best}")
    print(format_table(list(rows[0]), [list(r.values()) for r in rows]), flush=True)
    return rows


def attention_peers(rate: float, seqs: int = 4, length: int = 2048) -> list[dict]:
    """torch's own fused attention on the prefill case's fresh prompts (dense, causal, GQA), by
    backend, and ``varlen_attn`` (FlashAttention on packed sequences) where this torch has it:
    what rate a prefill that reads K and V contiguously, not through block tables, reaches."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(seqs, H_Q, length, D, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(seqs, H_KV, length, D, device=DEV, dtype=torch.bfloat16) for _ in "kv")
    flops = seqs * 4.0 * length * (length / 2) * H_Q * D
    calls = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION):
        def sdpa(b: SDPBackend = backend) -> torch.Tensor:
            with sdpa_kernel(b):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=True)
        calls[f"sdpa {backend.name}"] = sdpa
    try:
        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters  # it changed between releases
        kq, vq = (k, v) if "enable_gqa" in params else (
            t.repeat_interleave(H_Q // H_KV, dim=1) for t in (k, v))
        packed = [t.transpose(1, 2).reshape(seqs * length, -1, D).contiguous()
                  for t in (q, kq, vq)]
        cu = torch.arange(0, seqs + 1, device=DEV, dtype=torch.int32) * length
        kwargs: dict = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        log(f"varlen_attn{inspect.signature(varlen_attn)}")
        calls["varlen_attn"] = lambda: varlen_attn(*packed, cu, cu, length, length, **kwargs)
    except ImportError as exc:
        log(f"varlen_attn: {exc}")
    # ragged sequences as torch's jagged nested tensors (the engine packs prompts so), through
    # the cuDNN backend: whether a varlen prefill can reach the dense rate
    # (their fused kernels want as many K/V heads as query heads: K and V repeated)
    offsets = torch.arange(0, seqs + 1, device=DEV) * length  # one object: one ragged dim
    njt = [torch.nested.nested_tensor_from_jagged(
        t.repeat_interleave(H_Q // t.shape[1], dim=1).transpose(1, 2).reshape(seqs * length, -1, D),
        offsets).transpose(1, 2) for t in (q, k, v)]
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        def nested(b: SDPBackend = backend) -> torch.Tensor:
            with sdpa_kernel(b):
                return torch.nn.functional.scaled_dot_product_attention(
                    *njt, is_causal=True)
        calls[f"sdpa nested {backend.name}"] = nested
    pool_k, pool_v, tables, lens = paged_pool([length] * seqs)
    packed_q = q.transpose(1, 2).reshape(seqs * length, H_Q, D).contiguous()
    cu_q = torch.arange(0, seqs + 1, device=DEV, dtype=torch.int32) * length
    calls["pagedq triton prefill (paged)"] = lambda: paged_attention_prefill(
        packed_q, pool_k, pool_v, cu_q, tables, lens, D**-0.5)
    rows = []
    for name, fn in calls.items():
        try:
            ms = bench(fn)
        except Exception as exc:  # a backend this build or shape lacks
            log(f"{name}: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        rows.append({"attention": name, "ms": ms, "TFLOP/s": flops / ms * 1e-9,
                     "of_matmul": flops / ms * 1e3 / rate})
    if rows:
        print(format_table(list(rows[0]), [list(r.values()) for r in rows]), flush=True)
    return rows


def fresh_prefill(rate: float, cases: tuple[list[int], ...] = (
        [2048] * 4, [2048, 2040, 2032, 2024], [1024] * 4, [1024, 1016, 1008, 1000],
        [512] * 8, [256] * 16, [128] * 32)) -> list[dict]:
    """The engine's two routes for prompts with nothing cached, at the model's layouts (q packed,
    k and v strided views of one projection): the paged Triton kernel over the pool, and
    ``prefill_attention_fresh`` (cuDNN, one call a run of equal lengths) over the new rows; checked
    against the reference. ``ms``: do_bench's median, host launches included where they are
    the slower; ``host_us``: the host's time a call (what sets ``FRESH_PREFILL_MIN_TOKENS``)."""
    import kernels

    rows = []
    for lens in cases:
        seqs = len(lens)
        width = (H_Q + 2 * H_KV) * D
        qkv = torch.randn(sum(lens), width, device=DEV, dtype=torch.bfloat16)
        q, k, v = qkv.split([H_Q * D, H_KV * D, H_KV * D], dim=-1)
        q = q.reshape(-1, H_Q, D)  # the rotary's output is contiguous
        k, v = k.view(-1, H_KV, D), v.view(-1, H_KV, D)
        pool_k, pool_v, tables, ctx = paged_pool(lens)
        cu = torch.tensor([0, *lens]).cumsum(0).to(DEV, torch.int32)
        want = reference.prefill_attention_fresh(q.float(), k.float(), v.float(), lens, D**-0.5)
        got = kernels.prefill_attention_fresh(q, k, v, lens, D**-0.5)
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
        flops = sum(4.0 * n * (n / 2) * H_Q * D for n in lens)
        paged_args = (q, pool_k, pool_v, cu, tables, ctx, D**-0.5)
        fresh_args = (q, k, v, lens, D**-0.5)
        routes = {"paged triton": lambda a=paged_args: paged_attention_prefill(*a),
                  "fresh cudnn": lambda a=fresh_args: kernels.prefill_attention_fresh(*a)}
        for name, fn in routes.items():
            ms = bench(fn)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            host_us = (time.perf_counter() - t0) / 20 * 1e6
            torch.cuda.synchronize()
            case = f"{seqs}x{lens[0]}" if len(set(lens)) == 1 else f"{lens[0]}..{lens[-1]}"
            rows.append({"case": case, "route": name, "ms": ms,
                         "host_us": host_us, "TFLOP/s": flops / ms * 1e-9,
                         "of_matmul": flops / ms * 1e3 / rate})
    print(format_table(list(rows[0]), [list(r.values()) for r in rows]), flush=True)
    return rows


def engine_prefill(path: str, rate: float, seqs: int = 4, length: int = 2032,
                   rounds: int = 3, device: str = "cuda") -> list[dict]:
    """Whole prefill steps of ``seqs`` fresh prompts of ``length`` tokens through ``LLM`` (one
    new token each, so the step is the prefill), the attention by each route in turn: the
    step's FLOPs (every linear layer's at 2 a weight a token, the logits of the last tokens
    only, causal attention) against the matmul rate. Best of ``rounds`` a route."""
    import kernels
    from engine import LLM, SamplingParams

    llm = LLM(path, dtype="bfloat16", device=device, max_num_batched_tokens=seqs * length,
              max_num_seqs=max(seqs, 8), enable_prefix_caching=False)
    from engine.loader import load_config

    cfg = load_config(path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q_size, kv_size = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    linear = cfg.num_hidden_layers * (cfg.hidden_size * (2 * q_size + 2 * kv_size)
                                      + 3 * cfg.hidden_size * cfg.intermediate_size)
    flops = (2.0 * linear * seqs * length + 2.0 * cfg.hidden_size * cfg.vocab_size * seqs
             + cfg.num_hidden_layers * seqs * 4.0 * length * (length / 2) * q_size)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    threshold = kernels.FRESH_PREFILL_MIN_TOKENS
    best: dict[str, float] = {}
    for r in range(rounds + 1):  # round 0 warms both routes up
        for route, min_tokens in (("paged triton", 10**9), ("fresh cudnn", threshold)):
            kernels.FRESH_PREFILL_MIN_TOKENS = min_tokens
            prompts = torch.randint(3, llm.engine.vocab_size, (seqs, length),
                                    generator=gen).tolist()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            if r:
                best[route] = min(best.get(route, 1e9), (time.perf_counter() - t0) * 1e3)
    kernels.FRESH_PREFILL_MIN_TOKENS = threshold
    rows = [{"case": f"{seqs}x{length}", "route": route, "ms": ms,
             "TFLOP/s": flops / ms * 1e-9, "of_matmul": flops / ms * 1e3 / rate}
            for route, ms in best.items()]
    print(format_table(list(rows[0]), [list(r.values()) for r in rows]), flush=True)
    del llm
    torch.cuda.empty_cache()
    return rows

