#!/usr/bin/env bash
# Issue 12 on one GPU (H200), in one go and under 8 minutes, every step under `timeout`:
#   1. the GPU tests (-m gpu) of tests/kernels tests/moe: the regression run of
#      the tree
#   2. bench/core.py at the seed share (dense matmul, GEMM1/GEMM2, serial and fused layers, the
#      anchor), weights through pointers and through TMA descriptors
#   3. the same at the service's weight-bound step (T=512, I=3072 on one GPU), layers only if time
#   4. a short table
# Usage: ANCHORS=path/bench_anchors.py COMMIT=$(git rev-parse HEAD) bash bench/gpu_core.sh   (PYTHON=...; OUT=dir)
# The anchor script is not part of the project: pass its path (the GPU call copies it beside the tree).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${OUT:-build/gpu_core}
ANCHORS=${ANCHORS:?set ANCHORS to the path of bench_anchors.py}
BUDGET=${BUDGET:-440}
mkdir -p "$LOG"
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }  # seconds left of the budget
cap() { local want=$1 l; l=$(left); (( l < want )) && want=$l; (( want < 1 )) && want=1; echo "$want"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | tee "$LOG/device.txt"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" | tee -a "$LOG/device.txt"
echo "commit ${COMMIT:-unknown: set COMMIT (the copy that travels has no .git)}" | tee -a "$LOG/device.txt"

echo "== 1. GPU tests"
timeout "$(cap 230)" "$PY" -m pytest -q -m gpu tests/kernels tests/moe -p no:cacheprovider -rfE \
  > "$LOG/tests.txt" 2>&1
TEST_RC=$?
grep -E "^(FAILED|ERROR)" "$LOG/tests.txt" | head -n 20
tail -n 3 "$LOG/tests.txt"

echo "== 2. bench/core.py, seed share"
timeout "$(cap 170)" "$PY" bench/core.py --anchors "$ANCHORS" --iters 100 --json "$LOG/core.json" > "$LOG/core.txt" 2>&1
CORE_RC=$?
cat "$LOG/core.txt"

echo "== 3. service step (T=512, I=3072, R=1): weight-bound"
SVC_RC=skipped
if (( $(left) > 45 )); then
  timeout "$(cap 60)" "$PY" bench/core.py --anchors "$ANCHORS" --tokens 512 --Ir 3072 --routing balanced --iters 30 \
    --json "$LOG/service_step.json" > "$LOG/service_step.txt" 2>&1
  SVC_RC=$?
  tail -n 12 "$LOG/service_step.txt"
fi

echo
echo "================ summary ($(( $(date +%s) - START )) s) ================"
printf '%-12s %s\n' tests "rc=$TEST_RC: $(grep -E '(passed|failed|error)' "$LOG/tests.txt" | tail -n 1)"
printf '%-12s %s\n' core "rc=$CORE_RC"
printf '%-12s %s\n' service_step "rc=$SVC_RC"
grep -A8 "^| routing" "$LOG/core.txt"
[[ "$CORE_RC" == 0 && "$TEST_RC" == 0 ]]
