"""Helpers shared by the benchmarks: models, random prompts, threads, tables, JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a hub from a benchmark
# pagedq runs with OpenMP's default wait policy, as the worker is deployed (GNU OpenMP spins
# briefly at a barrier, then sleeps). OMP_WAIT_POLICY=PASSIVE, which these benchmarks set until
# session 5 for shared machines, cost pagedq 7-8 % at 128 requests on random-26m (494-500
# against 532-542 tok/s) and 20 % of a batch-1 decode step on SmolLM2 (48 against 36-40 ms);
# vLLM always ran with its own choice (spinning, pinned). Set it in the environment to compare.

import numpy as np  # noqa: E402
import torch  # noqa: E402

# Where models, logs and JSON go; the benchmarks' smoke tests point it at a temporary folder.
OUT_DIR = Path(os.environ.get("PAGEDQ_BENCH_OUT") or Path(__file__).resolve().parent / "out")
T = TypeVar("T")


def log(*parts: Any) -> None:
    """Progress notes go to stderr; stdout holds the results."""
    print(*parts, file=sys.stderr, flush=True)


# Random Llamas by name: their folder under OUT_DIR (built once) and build_random_checkpoint's
# keywords. "tiny" (its defaults) and "mid" serve the queue benchmark and the smoke tests.
RANDOM_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": ("random-llama-tiny", {}),
    "mid": ("random-llama-256x4", {"hidden_size": 256, "num_layers": 4, "num_heads": 4,
                                   "num_kv_heads": 2, "intermediate_size": 768, "init_std": 0.1}),
    # hidden 512, 8 layers, 8 heads / 4 KV heads of 64, MLP 1536: the smallest size,
    # for a 128-request CPU run that fits beside the SmolLM2 one.
    "random-26m": ("random-llama-26m", {"hidden_size": 512, "num_layers": 8, "num_heads": 8,
                                        "num_kv_heads": 4, "intermediate_size": 1536,
                                        "init_std": 0.05}),
    "random": ("random-llama-77m", {"hidden_size": 768, "num_layers": 12, "num_heads": 12,
                                    "num_kv_heads": 4, "intermediate_size": 2048,
                                    "init_std": 0.05}),
    # Llama-3.2-1B's shapes with the random tokenizer's ~1000-token vocabulary: 0.97B
    # parameters, for GPU runs.
    "random-1b": ("random-llama-1b", {"hidden_size": 2048, "num_layers": 16, "num_heads": 32,
                                      "num_kv_heads": 8, "intermediate_size": 8192,
                                      "init_std": 0.02}),
}
MODELS = (*RANDOM_MODELS, "smollm2")


def model_path(name: str) -> Path:
    """The folder of a random llama of RANDOM_MODELS (built once under OUT_DIR), of SmolLM2,
    or ``name`` itself when it is a checkpoint folder (a quantized one, say)."""
    if Path(name).is_dir():
        return Path(name)
    if name == "smollm2":
        from engine.default_model import default_model_path

        return default_model_path()
    if name not in RANDOM_MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")
    from engine.random_model import build_random_checkpoint

    folder, shape = RANDOM_MODELS[name]
    return build_random_checkpoint(OUT_DIR / folder, "llama", **shape)


def set_threads(threads: int | None) -> int:
    """Uses `threads` intra-op threads (default: every core) and returns the number."""
    torch.set_num_threads(threads or os.cpu_count() or 1)
    return torch.get_num_threads()


def usable_token_ids(path: Path) -> np.ndarray:
    """Every vocabulary id except the tokenizer's special ones."""
    from transformers import AutoConfig, AutoTokenizer

    vocab = AutoConfig.from_pretrained(path).vocab_size
    special = set(AutoTokenizer.from_pretrained(path).all_special_ids)
    return np.array([i for i in range(vocab) if i not in special], dtype=np.int64)


def random_prompt(rng: np.random.Generator, ids: np.ndarray, length: int) -> list[int]:
    return rng.choice(ids, size=length).tolist()


def timed(fn: Callable[[], T]) -> tuple[T, float, float]:
    """Calls `fn`; returns its result, the wall-clock seconds and the CPU seconds (every thread
    of this process) it took. CPU time barely moves when other processes share the cores."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def percentile_ms(seconds: Sequence[float], q: float) -> float:
    """The q-th percentile of durations in seconds, in ms; NaN for none."""
    return float(np.percentile(seconds, q)) * 1000 if len(seconds) else float("nan")


def load_average() -> float:
    """The 1-minute load average: above the thread count, others shared the cores."""
    return round(os.getloadavg()[0], 2)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain left-aligned text table (first column) with right-aligned figures."""
    cells = [list(map(str, headers))] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return "-" if value is None else str(value)


def git_revision() -> str:
    """HEAD's short hash, with "+dirty" when engine/ or kernels/ differ from it."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                              check=False).stdout.strip()

    dirty = git("status", "--porcelain", "--", "engine", "kernels")
    return (git("rev-parse", "--short", "HEAD") or "unknown") + ("+dirty" if dirty else "")


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Writes `data`, with the git revision under test, as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"git": git_revision()} | data, indent=2) + "\n")
    log(f"wrote {path}")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))


@dataclass
class Result:
    system: str
    seconds: float
    cpu_seconds: float
    output_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)
    load: float = field(default_factory=load_average)  # at the end of the run

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def tok_cpu_s(self) -> float:
        """NaN for a run under the CPU clock's 10 ms tick (a tiny model's can take none)."""
        return self.output_tokens / self.cpu_seconds if self.cpu_seconds > 0 else float("nan")


def check_lengths(system: str, tokens: list[list[int]], expected: list[int]) -> None:
    bad = [(i, len(t), n) for i, (t, n) in enumerate(zip(tokens, expected, strict=True))
           if len(t) != n]
    if bad:
        raise RuntimeError(f"{system}: requests (index, generated, expected) {bad[:5]} did not "
                           f"generate their output length")


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))
