#!/usr/bin/env bash
# Builds llama.cpp's llama-server as the single-stream peer (issue 16), in .llamacpp/ at the
# repository root (git-ignored; never needed by the README's commands or CI):
#   - the source vendored in the PyPI sdist of llama-cpp-python 0.3.16, built with cmake
#     (-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON; ~4 minutes on 2 cores);
#   - its convert_hf_to_gguf.py in a venv of its own (torch from the local 2.13.0 CPU wheel,
#     transformers 4.x as its requirements pin: with transformers 5.x, rope_theta sits inside
#     rope_parameters and the converter silently leaves llama.rope.freq_base out);
#   - SmolLM2's folder converted to F32 and F16 GGUF files, the rope base checked in each.
# Usage: bash benchmarks/llamacpp_peer.sh   (idempotent)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="$ROOT/.llamacpp"
VERSION=0.3.16
PY="${PYTHON:-python3}"
MODEL="${MODEL:-$("$ROOT/.venv/bin/python" -c 'from engine.default_model import default_model_path as p; print(p())')}"
mkdir -p "$DIR"
SRC="$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [[ ! -x "$SRC/build/bin/llama-server" ]]; then
    [[ -d "$SRC" ]] || {
        "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR"
        tar xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
    }
    cmake -S "$SRC" -B "$SRC/build" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON \
        -DBUILD_SHARED_LIBS=OFF \
        -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build "$SRC/build" --target llama-server -j"$(nproc)" >/dev/null
fi
VENV="$DIR/venv"
if ! "$VENV/bin/python" -c "import gguf, transformers, mistral_common" 2>/dev/null; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0 \
        'transformers>=4.45.1,<5' 'numpy<2.3' sentencepiece 'protobuf<5' 'mistral-common>=1.8.3' \
        "$SRC/gguf-py"
fi
# The folder as transformers 4.x reads it: rope_theta at the top of config.json (5.x nests it
# in rope_parameters, and 4.x would fall back to 10,000), the fast tokenizer by its 4.x name.
STAGE="$DIR/smollm2-hf4"
mkdir -p "$STAGE"
for f in "$MODEL"/*; do ln -sf "$f" "$STAGE/"; done
"$VENV/bin/python" - "$MODEL" "$STAGE" <<'PYEOF'
import json, sys
from pathlib import Path
src, stage = Path(sys.argv[1]), Path(sys.argv[2])
config = json.loads((src / "config.json").read_text())
config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
tok = json.loads((src / "tokenizer_config.json").read_text())
tok["tokenizer_class"] = "PreTrainedTokenizerFast"
for name, data in (("config.json", config), ("tokenizer_config.json", tok)):
    (stage / name).unlink(missing_ok=True)
    (stage / name).write_text(json.dumps(data, indent=2))
PYEOF
for kind in f32 f16; do
    out="$DIR/smollm2-$kind.gguf"
    [[ -f "$out" ]] || "$VENV/bin/python" "$SRC/convert_hf_to_gguf.py" "$STAGE" --outtype "$kind" \
        --outfile "$out" >"$DIR/convert-$kind.log" 2>&1
    "$VENV/bin/python" - "$out" "$MODEL/config.json" <<'PYEOF'
import json, sys
from gguf import GGUFReader
fields = GGUFReader(sys.argv[1]).fields
config = json.loads(open(sys.argv[2]).read())
want = (config.get("rope_parameters") or {}).get("rope_theta") or config.get("rope_theta")
key = next((k for k in fields if k.endswith(".rope.freq_base")), None)
got = None if key is None else float(fields[key].parts[-1][0])
if got != want:
    sys.exit(f"{sys.argv[1]}: rope.freq_base {got} != the checkpoint's rope_theta {want}")
print(f"{sys.argv[1]}: {key} = {got}")
PYEOF
done
echo "llama.cpp peer: $SRC/build/bin/llama-server"
