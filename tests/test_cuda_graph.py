"""Decode CUDA graphs: the padded sizes (CPU) and greedy tokens equal to eager decode (CUDA)."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graph import DecodeGraphs, graph_batch_sizes, padded_size


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    sizes = graph_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-2:] == [240, 256] and len(sizes) == 20


def test_padded_size() -> None:
    sizes = graph_batch_sizes(40)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33, 40)] == [
        1, 2, 4, 8, 8, 16, 16, 32, 40, 40]
    assert padded_size(41, sizes) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphs_match_eager(tiny_llama: Path, make_llm: Callable[..., LLM],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of 1, 3 and 20 prompts with n=2 (2 and 6 rows, up to 40), a budget that mixes
    prefill chunks into decode steps (those run eagerly), lengths that shrink a batch within
    its padded size (padding rows after rows that held placeholders): the same greedy tokens
    replayed under async scheduling as run eagerly without it."""
    replays = []
    run = DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, step, *prev: replays.append(
        len(step.input_ids)) or run(self, step, *prev))
    prompts = [[(7 * i + j) % 900 + 3 for j in range(5 + 9 * i)] for i in range(20)]
    params = [SamplingParams(n=2, temperature=0, max_tokens=12 - i % 7, ignore_eos=True)
              for i in range(20)]
    outs = {}
    for eager in (True, False):
        llm = make_llm(tiny_llama, device="cuda", max_num_seqs=40, enforce_eager=eager,
                       max_num_batched_tokens=64, async_scheduling=not eager)
        outs[eager] = [[[o.token_ids for o in r.outputs]
                        for r in llm.generate(batch, params[:len(batch)], use_tqdm=False)]
                       for batch in (prompts[:1], prompts[:3], prompts)]
    assert outs[True] == outs[False]
    sizes = graph_batch_sizes(40)
    assert 2 in replays and 6 in replays  # one and three prompts, n=2: decode-only steps
    assert any(padded_size(n, sizes) != n for n in replays)  # padding rows were replayed
