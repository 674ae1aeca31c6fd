"""Tiny random-weight Hugging Face checkpoints for tests and benchmarks.

`build_random_checkpoint(path, "qwen2")` writes config.json, model.safetensors and a
byte-level BPE tokenizer (~1000 tokens, trained on `_CORPUS`) that round-trips any
UTF-8 text. The tokenizer does not add `<s>` by itself; the chat template does.

Benchmark preset (77.1M parameters; the smaller std keeps its residual stream within
float16 range, ~40 instead of ~6000, while greedy margins stay clear)::

    build_random_checkpoint(path, "llama", hidden_size=768, num_layers=12, num_heads=12,
                            num_kv_heads=4, intermediate_size=2048, init_std=0.05)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

ARCHS: dict[str, type[LlamaConfig] | type[Qwen2Config] | type[MistralConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "mistral": MistralConfig,
}
_ARGS_FILE = "pagedq_random.json"
_FORMAT = 1  # bump when the build changes, so stale caches are rebuilt
_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_CORPUS = """\
The queue worker pulls a job, runs the model, and streams tokens back to the caller.
Each sequence owns a block table; blocks are shared between samples and copied on write.
When memory runs out, the scheduler preempts the youngest request and recomputes it later.
A good cache keeps the hot prefixes and evicts the least recently used blocks first.
The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun.
She sells sea shells by the sea shore; the shells she sells are surely sea shells.
In 1969, people watched the first landing on the Moon on black-and-white televisions.
Numbers like 3.14159, 2.71828 and 42 appear in code, papers, and late-night jokes.
Hello! How are you today? I am fine, thank you. Let's write some Python: print("hi").
def add(a, b):
    return a + b  # simple functions make simple tests

深度学习模型把文本切分成词元，然后一步一步地预测下一个词元。
调度器每一步都有固定的词元预算，先照顾正在运行的序列，再接纳等待中的请求。
当显存不够时，最年轻的请求会被抢占，之后再重新计算。
今天天气很好，我们去公园散步，看见很多人在湖边钓鱼、跑步和聊天。
北京是中国的首都，上海是最大的城市，广州和深圳在南方。
学而时习之，不亦说乎？有朋自远方来，不亦乐乎？
我喜欢喝茶，也喜欢读书。周末的时候，我常常和朋友一起做饭。
这个系统使用分页的键值缓存，相同的前缀可以被多个样本共享。
请把结果按顺序返回给用户，如果任务被取消，就立刻停止生成。
春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。
"""


def _train_tokenizer(vocab_size: int = 1000) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIALS,
        # All 256 byte symbols, so text unseen in the corpus (emoji...) still encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus so that pair counts are high enough to learn ~1000 merges.
    tok.train_from_iterator(_CORPUS.splitlines() * 3, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # keep decode(encode(x)) == x
    )


@torch.no_grad()
def _randomize(model: torch.nn.Module, init_std: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            # Norm gains near 1 but not equal to it, so an ignored gain is caught.
            p.copy_(1.0 + 0.1 * noise)
        else:  # weights and (non-zero) biases alike
            p.copy_(init_std * noise)


def build_random_checkpoint(
    path: str | Path,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    init_std: float = 0.25,
    seed: int = 0,
) -> Path:
    """Build (or reuse) a random-weight float32 checkpoint of `arch` at `path`.

    `init_std` is far above the usual 0.02 so that logits are peaked: on the default tiny
    model the median top-1/top-2 logit gap is ~0.4 (vs ~0.04 at 0.02), so greedy parity
    does not flip on rounding, and greedy text does not collapse into one repeated token.
    Norm gains are 1 + N(0, 0.1). Mistral is built without a sliding window.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHS)}")
    path = Path(path)
    args = {k: v for k, v in locals().items() if k != "path"} | {"format": _FORMAT}
    built = _built_with(path)
    if built == args:
        return path
    if built is None and path.is_dir() and any(path.iterdir()):
        raise FileExistsError(f"{path} is not empty and holds no random checkpoint")

    tokenizer = _train_tokenizer()
    extra: dict[str, Any] = {"sliding_window": None} if arch == "mistral" else {}
    if rope_scaling is not None:
        extra["rope_scaling"] = rope_scaling
    # Qwen2Config declares no head_dim field, but every config's __init__ takes any keyword
    config = ARCHS[arch](  # type: ignore[call-arg]
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **extra,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, init_std, seed)

    # Build beside the target and rename into place: readers never see half a folder.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _ARGS_FILE).write_text(json.dumps(args, indent=2, sort_keys=True))
        if built is not None:
            shutil.rmtree(path, ignore_errors=True)  # our own build, with other arguments
        try:
            os.rename(tmp, path)
        except OSError:  # another process published first: keep theirs if it matches
            if _built_with(path) != args:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a lost race or a failure
    return path


def _built_with(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / _ARGS_FILE).read_text())
    except (OSError, ValueError):
        return None
