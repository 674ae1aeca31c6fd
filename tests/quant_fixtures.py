"""Quantized checkpoints for the tests, made by llm-compressor in .venv-quant (a subprocess:
its transformers differs from ours) and cached under $PAGEDQ_CACHE_DIR (else ~/.cache/pagedq)
/quantized, keyed by the tools' pins, the scripts, the recipe and the source checkpoint; and
transformers' greedy tokens on them, computed in that venv and cached beside them."""

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tests" / "quant_tools"
QUANT_PY = ROOT / ".venv-quant" / "bin" / "python"


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH="")
    proc = subprocess.run([str(QUANT_PY), *args], env=env, capture_output=True, text=True,
                          **kwargs)
    if proc.returncode:
        raise RuntimeError(f"{args[0]} failed:\n{proc.stderr[-3000:]}")
    return proc


def _source_key(source: Path) -> str:
    built = source / "pagedq_random.json"  # the random checkpoints' build arguments
    if built.exists():
        return built.read_text()
    return "".join(f"{f.name}:{f.stat().st_size}" for f in sorted(source.glob("*.safetensors")))


def quantized(source: Path, recipe: str) -> Path:
    """``source`` quantized by ``tests/quant_tools/quantize.py`` with ``recipe``, cached."""
    subprocess.run(["bash", str(ROOT / "tests" / "quant_venv.sh")], check=True)
    key = hashlib.sha256("\n".join([
        (TOOLS / "requirements.txt").read_text(), (TOOLS / "quantize.py").read_text(), recipe,
        _source_key(source)]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("PAGEDQ_CACHE_DIR") or "~/.cache/pagedq").expanduser()
    target = cache / "quantized" / f"{source.name}-{recipe}-{key}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _run([str(TOOLS / "quantize.py"), str(source), str(tmp), recipe], timeout=900)
        try:
            os.rename(tmp, target)
        except OSError:  # another run published it first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def hf_quantized_greedy(checkpoint: Path, prompts: list[list[int]],
                        max_new: int) -> list[list[int]]:
    """transformers' greedy continuations on a compressed-tensors checkpoint, cached."""
    key = hashlib.sha256(json.dumps([prompts, max_new,
                                     (TOOLS / "hf_generate.py").read_text()]).encode())
    cached = checkpoint / f"hf_greedy-{key.hexdigest()[:16]}.json"
    if not cached.exists():
        out = _run([str(TOOLS / "hf_generate.py"), str(checkpoint), str(max_new)],
                   input=json.dumps(prompts), timeout=900).stdout
        cached.write_text(out)
    return json.loads(cached.read_text())["tokens"]
