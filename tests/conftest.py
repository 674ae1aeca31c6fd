"""Shared fixtures: tiny random-weight checkpoints, the default SmolLM2 model, a transformers
reference, and the pool-is-whole check that runs after every test that builds an engine."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a model hub
# Idle OpenMP threads sleep instead of spinning (read when torch loads, inherited by the worker
# subprocesses): pytest, workers and Redis share the cores, and spinning threads starve them.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from engine import LLM, RequestDelta  # noqa: E402
from engine.context import Context, set_context  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.random_model import build_random_checkpoint  # noqa: E402

torch.set_num_threads(int(os.environ.get("PAGEDQ_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen2", "qwen2")


@pytest.fixture(scope="session")
def tiny_llama3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama 3's rope scaling and tied embeddings."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return build_random_checkpoint(tmp_path_factory.mktemp("tiny") / "llama3", "llama",
                                   rope_scaling=rope, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_checkpoint(tmp_path_factory.mktemp("tiny") / "mistral", "mistral",
                                   num_heads=8, num_kv_heads=1)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from engine.default_model import default_model_path

    return default_model_path()


def run_modules(runner: ModelRunner, ids: torch.Tensor, positions: torch.Tensor,
                ctx: Context) -> torch.Tensor:
    """Every row's final hidden state through the model's modules, as a step with ``ctx``."""
    set_context(ctx)
    try:
        return runner.model(ids, positions)
    finally:
        set_context(None)


def drain(engine: LLMEngine) -> dict[str, list[RequestDelta]]:
    """Steps the engine until it has nothing left; each request's deltas in order."""
    events: dict[str, list[RequestDelta]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            events.setdefault(delta.request_id, []).append(delta)
    return events


def assert_pool_whole(engine: LLMEngine) -> None:
    bm = engine.block_manager
    held = [(b.block_id, b.ref_count) for b in bm.blocks if b.ref_count]
    assert not held, f"blocks still referenced: {held[:10]}"
    assert bm.num_free_blocks == len(bm.blocks)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.requests and not bm.chains


@pytest.fixture
def make_llm() -> Iterator[Callable[..., LLM]]:
    """Builds LLMs for a test and checks, after it, that each one's pool is whole."""
    built: list[LLM] = []

    def make(model: Path, **kwargs) -> LLM:
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("device", "cpu")
        built.append(LLM(str(model), **kwargs))
        return built[-1]

    yield make
    for llm in built:
        assert_pool_whole(llm.engine)


_HF_MODELS: dict[Path, torch.nn.Module] = {}


def hf_model(model: Path) -> torch.nn.Module:
    """transformers' float32 model of a checkpoint, loaded once per session."""
    from transformers import AutoModelForCausalLM

    if model not in _HF_MODELS:
        _HF_MODELS[model] = AutoModelForCausalLM.from_pretrained(
            model, dtype=torch.float32).eval()
    return _HF_MODELS[model]


def hf_greedy(model: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, cut after the first end-of-sequence token as the
    engine's is."""
    hf = hf_model(model)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                          dtype=torch.long), do_sample=False, max_new_tokens=max_new_tokens,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()
