"""transformers' beam search as the reference for pagedq's, and checkpoints on which an eos is
reachable (a random model's own eos, id 2, practically never wins a step)."""

import json
import shutil
from pathlib import Path

from benchmarks.beam import Beams, hf_beam_search, same_beams
from engine import BeamSearchOutput
from tests.conftest import hf_greedy, hf_model


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
    return hf_beam_search(hf_model(model), prompt, eos, width, max_tokens, length_penalty,
                          early_stopping)


def ours(output: BeamSearchOutput, prompt: list[int]) -> Beams:
    return [(s.tokens[len(prompt):], s.cum_logprob) for s in output.sequences]


def assert_same_beams(got: Beams, expected: Beams, case: object) -> None:
    """The same hypotheses in the same order, cum_logprob within 1e-4."""
    assert same_beams(got, expected), (case, got, expected)
