#!/usr/bin/env bash
# Issue 11p on one GPU (H200), ~5-6 minutes (BUDGET caps it), every step under `timeout`, ALL output
# in ONE file ($OUT/gpu_lookahead.tgz; the summary is also printed):
#   1. csrc/build.py (the tables op the layers use)
#   2. tests/worker/test_lookahead_gpu.py: the group's answers with rank lookahead 2 equal those
#      with 1 and the fp32 reference (fused and serial, 3 callers, mixed T incl. 1 and odd,
#      poisoned answer rows), and at the seed shape lookahead 1 / 2 / 2 with copy streams, which
#      must overlap steps on the device and give the same answers bit for bit
#   2b. (last, with what is left of BUDGET) the layers' own GPU tests that read check_seq and
#      exposed_comm_s (tests/moe/test_serial_gpu.py, test_fused_gpu.py)
#   3. bench/cpu_stages.py --device cuda --preset seed --callers $CALLERS: the rank group under
#      $CALLERS concurrent callers on their own slots, lookahead 1, 2, and 2 with --copy-streams
#      ("2cs") in turn ($ROUNDS rounds),
#      T=512 and 8: steps/s, tokens/s, the share of steps enqueued behind another, phase medians
#   4. a short table (summary.txt)
# The call (carry [".whl"]):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site && OUT=$OUT bash bench/gpu_lookahead.sh   (timeout_s 500)
# Knobs: BUDGET (s, default 420: a cap; ~5-6 min expected: the seed-shape test starts 3 groups of 4.8 GB), CALLERS (3), ROUNDS (1), STEPS (per caller, 200),
# PYTHON, OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
DEST=${OUT:-build}
LOG=$(mktemp -d)
BUDGET=${BUDGET:-420}
CALLERS=${CALLERS:-3}
ROUNDS=${ROUNDS:-1}
STEPS=${STEPS:-200}
mkdir -p "$DEST"
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
cap() { local want=$1 l; l=$(left); (( l < want )) && want=$l; (( want < 1 )) && want=1; echo "$want"; }
S="$LOG/summary.txt"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  echo "commit $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown);" \
       "torch $($PY -c 'import torch; print(torch.__version__)'); $(nproc) cores; $(date -u '+%F %H:%M') UTC"; } | tee "$S"

echo "== 1. csrc/build.py" | tee -a "$S"
timeout -k 5 "$(cap 90)" "$PY" csrc/build.py > "$LOG/build.txt" 2>&1
echo "build rc=$?" | tee -a "$S"

echo "== 2. GPU tests" | tee -a "$S"
timeout -k 5 "$(cap 300)" "$PY" -m pytest -q -s tests/worker/test_lookahead_gpu.py > "$LOG/tests_lookahead.txt" 2>&1
echo "test_lookahead_gpu rc=$?" | tee -a "$S"
grep -E "enqueued behind|on the device|passed|failed|Error" "$LOG/tests_lookahead.txt" | tail -6 | tee -a "$S"

echo "== 3. the rank group under $CALLERS callers, lookahead 1 and 2 (bench/cpu_stages.py)" | tee -a "$S"
for round in $(seq 1 "$ROUNDS"); do
  for la in 1 2 2cs; do  # 2cs: lookahead 2 with the copies on copy streams (--rank-copy-streams)
    f="$LOG/group_r${round}_la${la}.txt"
    extra=(); [[ "$la" == 2cs ]] && extra=(--copy-streams)
    timeout -k 5 "$(cap 60)" "$PY" bench/cpu_stages.py --preset seed --device cuda --backend auto --sizes 512,8 \
      --steps "$STEPS" --callers "$CALLERS" --lookahead "${la%cs}" "${extra[@]}" > "$f" 2>&1
    echo "round $round lookahead $la rc=$?" >> "$S"
  done
done
{ echo; grep -h -m1 "^# " "$LOG"/group_r1_la1.txt
  grep -h -m2 "^| T\|^|---" "$LOG"/group_r1_la1.txt
  for f in "$LOG"/group_r*_la*.txt; do grep -h "^| [0-9]" "$f"; done | sort -t'|' -k2,2n -k3,3n -s; } | tee -a "$S"

echo "== 2b. the layers' GPU tests (check_seq / exposed_comm_s from a snapshot)" | tee -a "$S"
if (( $(left) > 20 )); then
  timeout -k 5 "$(cap 120)" "$PY" -m pytest -q -x -m gpu tests/moe/test_serial_gpu.py tests/moe/test_fused_gpu.py \
    > "$LOG/tests_layers.txt" 2>&1
  echo "layer tests rc=$?" | tee -a "$S"
  tail -3 "$LOG/tests_layers.txt" | tee -a "$S"
else
  echo "skipped: $(left) s left of BUDGET=$BUDGET" | tee -a "$S"
fi
echo "total $(( $(date +%s) - START )) s" | tee -a "$S"
tar -czf "$DEST/gpu_lookahead.tgz" -C "$LOG" .
