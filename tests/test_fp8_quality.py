"""fp8 KV cache quality on SmolLM2 with text, against the full-precision (fp32) cache: greedy
agreement of 8 prompts over 32 tokens, the mean absolute difference of the chosen tokens'
logprobs, and perplexity over four English texts that installed packages ship (the Apache
License 2.0 in transformers, the Mozilla Public License in hypothesis, the READMEs of pydantic
and tqdm), their first 1,100 tokens each. Both fp8 formats.

The scales (vLLM's constants) and the centred keys come from the first prefill, and here, as
in a deployment, that is a short chat request, before any text. Measured: e4m3 +0.46 %
perplexity over the four texts, e5m2 +2.38 % (AMD EPYC with AVX-512, session 11); without the
centring +1.71 % and +4.63 % on that machine, +2.21 % on an Intel Xeon (session 10), +1.59 %
on an AVX2 EPYC (session 8). Other first requests move e4m3 between +0.46 and +1.03 % (plain:
+0.28 to +1.71 %; see kv_cache.py). The bound is the issue's 2 % for e4m3; a broken cache
misses it (scales of 1.0 cost 3.5 %, saturation 5 %).
"""

from importlib.metadata import distribution
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.context import Context, set_context

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain how a refrigerator keeps food cold.",
    "List three uses of copper:",
    "Once upon a time, in a small village,",
    "The main difference between a virus and a bacterium is",
    "def fibonacci(n):",
    "Give me a recipe for pancakes.",
]


TEXT_TOKENS = 1100


def _texts() -> list[str]:
    def licence(package: str, name: str) -> str:
        return next(f for f in distribution(package).files or [] if f.name == name).read_text()

    return [licence("transformers", "LICENSE"), licence("hypothesis", "LICENSE.txt"),
            distribution("pydantic").read_text("METADATA") or "",
            distribution("tqdm").read_text("METADATA") or ""]


def _token_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """log p(ids[t + 1] | ids[:t + 1]) for every t, from one prefill of ``ids`` through the
    engine's model and KV pool (blocks 0.. of a pool nothing else uses yet): the attention
    reads every key and value back from the pool, quantized as the engine stores them."""
    runner = llm.engine.model_runner
    n, block_size = len(ids), runner.block_size
    tables = torch.arange(-(-n // block_size), dtype=torch.int32)[None]
    ctx = Context(slot_mapping=torch.arange(n), num_decode_tokens=0,
                  prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                  prefill_block_tables=tables,
                  prefill_context_lens=torch.tensor([n], dtype=torch.int32))
    set_context(ctx)
    try:
        with torch.inference_mode():
            hidden = runner.model(torch.tensor(ids), torch.arange(n))
            logits = runner.model.compute_logits(hidden[:-1]).float()
    finally:
        set_context(None)
    return logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def runs(smollm2: Path) -> dict[str, tuple[list[list[int]], list[list[float]], float]]:
    """Per kv_cache_dtype: the greedy tokens and their logprobs for each prompt, and the
    perplexity of the texts, after a short chat request whose prefill sets the fp8 scales."""
    results = {}
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    for kv_dtype in ("auto", "fp8_e4m3", "fp8_e5m2"):
        llm = LLM(str(smollm2), dtype="float32", device="cpu", kv_cache_dtype=kv_dtype,
                  num_kv_blocks=256)
        chat = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi, how are you?"}], tokenize=False,
            add_generation_prompt=True)
        llm.generate([chat], SamplingParams(max_tokens=1), use_tqdm=False)
        nll = torch.cat([_token_logprobs(llm, llm.tokenizer.encode(text)[:TEXT_TOKENS]).neg()
                         for text in _texts()])
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        results[kv_dtype] = ([o.token_ids for o in outs],
                             [[lp[t] for lp, t in zip(o.logprobs, o.token_ids, strict=True)]
                              for o in outs], nll.mean().exp().item())
    return results


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_quality_against_full_precision_cache(runs: dict, kv_dtype: str) -> None:
    full_tokens, full_lps, full_ppl = runs["auto"]
    tokens, lps, ppl = runs[kv_dtype]
    same = sum(a == b for a, b in zip(full_tokens, tokens, strict=True))
    diffs = []
    for a, b, la, lb in zip(full_tokens, tokens, full_lps, lps, strict=True):
        agree = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        diffs += [abs(x - y) for x, y in zip(la[:agree + 1], lb[:agree + 1], strict=True)]
    mean_diff = sum(diffs) / len(diffs)
    print(f"\n{kv_dtype}: greedy identical {same}/8 prompts over 32 tokens; mean |logprob "
          f"diff| {mean_diff:.4f} over {len(diffs)} tokens; perplexity {ppl:.3f} vs "
          f"{full_ppl:.3f} ({(ppl / full_ppl - 1) * 100:+.2f} %)")
    e4m3 = kv_dtype == "fp8_e4m3"
    assert abs(ppl / full_ppl - 1) < (0.02 if e4m3 else 0.06)
    assert mean_diff < (0.07 if e4m3 else 0.14)
    first_same = sum(a[0] == b[0] for a, b in zip(full_tokens, tokens, strict=True))
    # e5m2 (2 mantissa bits) keeps no prompt identical over 32 tokens on this model: 0-1 of
    # 8, moved by the last bits of RMSNorm's summation order; e4m3 keeps some.
    assert first_same >= 7 and (same >= 1 or not e4m3)
