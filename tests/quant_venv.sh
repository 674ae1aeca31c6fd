#!/usr/bin/env bash
# Builds .venv-quant (git-ignored): llm-compressor and its transformers, for the tests that make
# quantized checkpoints. torch is held at the project's 2.13.0 CPU wheel by a constraints file,
# so pip never fetches another. Rebuilt only when tests/quant_tools/requirements.txt changes.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-quant
req=tests/quant_tools/requirements.txt
stamp=$venv/.requirements
if [[ -f $stamp ]] && cmp -s "$req" "$stamp"; then exit 0; fi
rm -rf "$venv"
python3 -m venv "$venv"
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0" > "$constraints"
"$venv/bin/pip" install -q -c "$constraints" torch==2.13.0 -r "$req"
cp "$req" "$stamp"
