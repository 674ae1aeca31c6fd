#!/usr/bin/env bash
# Builds .venv-quant (git-ignored): llm-compressor and its transformers, for the tests that make
# quantized checkpoints. torch is held at the project's 2.13.0 CPU wheel by a constraints file,
# so pip never fetches another. AutoAWQ (archived) goes in without its declared dependencies:
# it imports and quantizes on the CPU with what llm-compressor brings (its triton and zstandard
# serve only its GPU kernels and dataset download). Rebuilt when this script or the pins change.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-quant
req=tests/quant_tools/requirements.txt
stamp=$venv/.requirements
if [[ -f $stamp ]] && cat "$req" "$0" | cmp -s - "$stamp"; then exit 0; fi
rm -rf "$venv"
python3 -m venv "$venv"
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0" > "$constraints"
"$venv/bin/pip" install -q -c "$constraints" torch==2.13.0 -r "$req"
"$venv/bin/pip" install -q --no-deps autoawq==0.2.9
cat "$req" "$0" > "$stamp"
