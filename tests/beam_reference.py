"""transformers' beam search as the reference for pagedq's, and checkpoints on which an eos is
reachable (a random model's own eos, id 2, practically never wins a step)."""

import json
import shutil
from pathlib import Path

import torch
from transformers import GenerationConfig

from engine import BeamSearchOutput
from tests.conftest import hf_greedy, hf_model

Beams = list[tuple[list[int], float | None]]  # (output tokens, cum_logprob), best first


def with_eos(model: Path, folder: Path, prompt: list[int], step: int) -> Path:
    """A copy of ``model`` whose generation_config adds, as a second eos, the token that greedy
    search takes at ``step`` after ``prompt``: an eos that beams reach."""
    token = hf_greedy(model, prompt, step + 1)[step]
    if not folder.exists():
        shutil.copytree(model, folder)
        (folder / "generation_config.json").write_text(
            json.dumps({"eos_token_id": [2, token], "pad_token_id": 3}))
    return folder


def hf_beams(model: Path, prompt: list[int], eos: list[int], width: int, max_tokens: int,
             length_penalty: float, early_stopping: bool | str) -> Beams:
    """``generate(num_beams=width, num_return_sequences=width, do_sample=False)``: each
    hypothesis' output tokens (cut at its own length) and cum_logprob (its score times
    length ** length_penalty). ``eos`` [] is ignore_eos. num_beams=1 is greedy search there,
    which reports no cum_logprob."""
    config = GenerationConfig(num_beams=width, num_return_sequences=width, do_sample=False,
                              length_penalty=length_penalty, early_stopping=early_stopping,
                              max_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=3)
    with torch.inference_mode():
        out = hf_model(model).generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=config, return_dict_in_generate=True, output_scores=True)
    if width == 1:
        ids = out.sequences[0, len(prompt):].tolist()
        cut = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))
        return [(ids[:cut], None)]
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    return [(out.sequences[i, len(prompt):len(prompt) + n].tolist(), score * n ** length_penalty)
            for i, (n, score) in enumerate(zip(lengths, out.sequences_scores.tolist(),
                                               strict=True))]


def ours(output: BeamSearchOutput, prompt: list[int]) -> Beams:
    return [(s.tokens[len(prompt):], s.cum_logprob) for s in output.sequences]


def assert_same_beams(got: Beams, expected: Beams, case: object) -> None:
    """The same hypotheses in the same order, cum_logprob within 1e-4."""
    assert [t for t, _ in got] == [t for t, _ in expected], case
    for (_, a), (_, b) in zip(got, expected, strict=True):
        assert b is None or abs(a - b) < 1e-4, (case, a, b)
