#!/usr/bin/env bash
# Issue 6 on one GPU (H200), in one go and under 5 minutes:
#   1. the fused GPU tests, tests/moe/test_fused_gpu.py (R=1 in process; R=2, R=4 processes sharing the GPU; forced timeout)
#   2. bench/fused_layer.py (fused vs serial vs compute-only, R=1)
#   3. compute-sanitizer memcheck and racecheck on a tiny fused layer (if compute-sanitizer exists)
#   4. a short summary table
# Usage: bash bench/gpu_fused.sh     (PYTHON=... to pick the interpreter; OUT=dir for the logs)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
LOG=${OUT:-build/gpu_fused}
mkdir -p "$LOG"
START=$(date +%s)
left() { echo $(( 285 - ($(date +%s) - START) )); }  # seconds left of the budget (with margin)
cap() { local want=$1 l; l=$(left); (( l < want )) && want=$l; (( want < 1 )) && want=1; echo "$want"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | tee "$LOG/device.txt"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" | tee -a "$LOG/device.txt"

echo "== 1. GPU tests (tests/moe/test_fused_gpu.py)"
timeout "$(cap 160)" "$PY" -m pytest -q -s -m gpu tests/moe/test_fused_gpu.py -p no:cacheprovider -rfE > "$LOG/tests.txt" 2>&1
TEST_RC=$?
grep -E "rel err|timeout reported" "$LOG/tests.txt" | tail -n 8
tail -n 15 "$LOG/tests.txt"

echo "== 2. bench/fused_layer.py"
timeout "$(cap 80)" "$PY" bench/fused_layer.py --iters 20 > "$LOG/bench.txt" 2>&1
BENCH_RC=$?

echo "== 3. compute-sanitizer"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
SAN_RC=0
if [[ -n "$SAN" ]]; then
  for tool in memcheck racecheck; do
    timeout "$(cap 30)" "$SAN" --tool "$tool" --error-exitcode 9 "$PY" tests/moe/sanitize_fused.py > "$LOG/sanitize_$tool.txt" 2>&1
    rc=$?; (( rc != 0 )) && SAN_RC=$rc
    echo "$tool rc=$rc: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|sanitize_fused" "$LOG/sanitize_$tool.txt" | tr '\n' ' ')"
  done
else
  echo "compute-sanitizer not found: skipped"
fi

echo
echo "================ summary ($(( $(date +%s) - START )) s) ================"
printf '%-10s %s\n' tests "rc=$TEST_RC: $(grep -E '(passed|failed|error)' "$LOG/tests.txt" | tail -n 1)"
printf '%-10s %s\n' sanitizer "rc=$SAN_RC"
printf '%-10s %s\n' bench "rc=$BENCH_RC"
cat "$LOG/bench.txt" | tail -n 14
exit $(( TEST_RC || SAN_RC || BENCH_RC ))
