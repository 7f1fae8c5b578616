#!/usr/bin/env bash
# Issue 5 on one GPU (H200), in one go and under 8 minutes:
#   1. build csrc/ (moe::build_tables) ahead of time      (cap 150 s)
#   2. the GPU tests of tests/kernels (pytest -m gpu)      (cap 210 s)
#   3. bench/gemm.py (TFLOP/s, schedule build, combine)  (cap 110 s)
#   4. a short summary table
# Usage: bash bench/gpu_kernels.sh     (PYTHON=... to pick the interpreter; OUT=dir for the logs)
# Optional: TUNE=1 also runs `bench/tune_gemm.py --quick` first (adds ~2 minutes; writes configs).
# For a short lease: BUDGET=seconds (default 470), TESTS="test files" (default tests/kernels),
# PARTS=gemm,schedule,combine (what bench/gemm.py measures; default all).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
LOG=${OUT:-build/gpu_kernels}
mkdir -p "$LOG"
START=$(date +%s)
BUDGET=${BUDGET:-470}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }  # seconds left of the 8-minute budget (with margin)
cap() { local want=$1 l; l=$(left); (( l < want )) && want=$l; (( want < 1 )) && want=1; echo "$want"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | tee "$LOG/device.txt"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" | tee -a "$LOG/device.txt"

echo "== 1. build csrc"
timeout "$(cap 150)" "$PY" csrc/build.py > "$LOG/build.txt" 2>&1
BUILD_RC=$?
tail -n 5 "$LOG/build.txt"

if [[ "${TUNE:-0}" == "1" ]]; then
  echo "== tune (quick)"
  timeout "$(cap 150)" "$PY" bench/tune_gemm.py --quick > "$LOG/tune.txt" 2>&1
  grep -E "best|wrote" "$LOG/tune.txt"
fi

echo "== 2. GPU tests"
timeout "$(cap 210)" "$PY" -m pytest -q -m gpu ${TESTS:-tests/kernels} -p no:cacheprovider -rfE > "$LOG/tests.txt" 2>&1
TEST_RC=$?
tail -n 30 "$LOG/tests.txt"

echo "== 3. bench/gemm.py"
timeout "$(cap 110)" "$PY" bench/gemm.py --parts "${PARTS:-gemm,schedule,combine}" --json "$LOG/gemm.json" > "$LOG/bench.txt" 2>&1
BENCH_RC=$?

echo
echo "================ summary ($(( $(date +%s) - START )) s) ================"
printf '%-10s %s\n' build "$( ((BUILD_RC == 0)) && echo ok || echo "FAILED rc=$BUILD_RC (see $LOG/build.txt)")"
printf '%-10s %s\n' tests "rc=$TEST_RC: $(grep -E '(passed|failed|error)' "$LOG/tests.txt" | tail -n 1)"
printf '%-10s %s\n' bench "rc=$BENCH_RC"
sed -n '/^device /,$p' "$LOG/bench.txt"
(( BENCH_RC == 0 )) || tail -n 20 "$LOG/bench.txt"
exit $(( BUILD_RC || TEST_RC || BENCH_RC ))
