"""benchmarks/throughput.py's transformers runs of a workload: static batched ``generate`` and
continuous batching (their rules are in throughput.py's docstring)."""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path
from typing import Any

from common import Result, Workload, check_lengths, log, timed  # first: it sets torch's env

# isort: split
import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CB_PAGE_SIZE = 16  # tokens per page of transformers' paged cache, as pagedq's block_size


def load_hf(path: Path, args: argparse.Namespace) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[args.dtype],
                                                 attn_implementation="sdpa")
    model = model.to(args.device).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: only max_new_tokens stops
    return model


def _pad_id(model: Any) -> int:
    pad = model.config.pad_token_id
    return pad if pad is not None else 0


@torch.inference_mode()
def static_batch(model: Any, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    width = max(map(len, prompts))
    pad = _pad_id(model)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                        device=model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                         max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad)
    if out.shape[1] != width + max_new:
        raise RuntimeError(f"hf-static generated {out.shape[1] - width} tokens, not {max_new}")
    return out[:, width:].tolist()


def run_hf_static(model: Any, wl: Workload, batch_size: int) -> tuple[Result, list[list[int]]]:
    def run() -> list[list[int]]:
        tokens: list[list[int]] = []
        for start in range(0, len(wl.prompts), batch_size):
            lens = wl.output_lens[start:start + batch_size]
            batch = static_batch(model, wl.prompts[start:start + batch_size], max(lens))
            tokens += [row[:n] for row, n in zip(batch, lens, strict=True)]
            log(f"hf-static B={batch_size}: {len(tokens)}/{len(wl.prompts)} requests")
        return tokens

    tokens, seconds, cpu = timed(run)
    check_lengths(f"hf-static B={batch_size}", tokens, wl.output_lens)
    return Result(f"hf-static B={batch_size}", seconds, cpu, wl.output_tokens), tokens


def _cb_config(wl: Workload, cuda_graph: bool | None, limits: tuple[int, int]) -> Any:
    import dataclasses

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # Room for every request at its full length at once (+1 page each), so nothing is evicted.
    pages = sum(-(-(len(p) + n) // CB_PAGE_SIZE) + 1 for p, n in zip(wl.prompts, wl.output_lens,
                                                                       strict=True))
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page = "page_size" if "page_size" in fields else "block_size"  # renamed after 5.17
    wanted = {page: CB_PAGE_SIZE, "num_blocks": pages,
              "max_batch_tokens": limits[0], "max_requests_per_batch": limits[1],
              "auto_switch_to_flash": False,
              "use_cuda_graph": cuda_graph, "use_async_batching": False}
    return ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in fields})


def run_hf_cb(model: Any, wl: Workload, limits: tuple[int, int]
              ) -> tuple[Result, list[list[int]]]:
    """On CUDA with transformers' own CUDA graphs (captured in its warm-up, untimed), as
    pagedq uses its own; on the CPU without. Not under inference_mode: the manager's thread
    updates in place the static tensors that its warm-up creates in this one."""
    from transformers import GenerationConfig

    cuda = model.device.type == "cuda"
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1,
                                  max_new_tokens=max(wl.output_lens))
    accepted = inspect.signature(model.continuous_batching_context_manager).parameters
    kwargs = {"continuous_batching_config": _cb_config(wl, None if cuda else False, limits),
              "warmup": cuda}
    kwargs = {k: v for k, v in kwargs.items() if k in accepted}  # older transformers lack some
    with model.continuous_batching_context_manager(generation_config=gen_config,
                                                   **kwargs) as manager:
        results, seconds, cpu = timed(lambda: _cb_generate(manager, wl))
    tokens = [list(results[f"r{i}"].generated_tokens) for i in range(len(wl.prompts))]
    name = f"hf-cb {limits[0]}:{limits[1]}"
    check_lengths(name, tokens, wl.output_lens)
    return Result(name, seconds, cpu, sum(map(len, tokens))), tokens


def _cb_generate(manager: Any, wl: Workload) -> dict[str, Any]:
    for i, (prompt, n) in enumerate(zip(wl.prompts, wl.output_lens, strict=True)):
        manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
    results: dict[str, Any] = {}
    while len(results) < len(wl.prompts):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(f"hf-cb stopped with {len(results)} of {len(wl.prompts)} done")
            continue
        if result.error is not None:
            raise RuntimeError(f"hf-cb request {result.request_id} failed: {result.error}")
        if result.is_finished():
            results[result.request_id] = result
            if len(results) % 8 == 0:
                log(f"hf-cb: {len(results)}/{len(wl.prompts)} requests")
    return results
