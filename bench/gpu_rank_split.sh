#!/usr/bin/env bash
# Issue 11 (helper 11e) on one H200 (nvidia-h200), one call of the device tool, ~3 minutes: where a
# step's time goes between the owner of the rank group and rank 0 (StepStats.phases,
# moe_step_phase_seconds{phase}: to_rank, copy_in, launch, device, copy_out, checks, peers, to_owner, owner).
#   1. the rank group alone (no front end): bench/cpu_stages.py --preset seed --device cuda --backend auto
#      at T=512 and T=8, 200 steps each, one at a time: the stage and phase medians
#   2. the default server as a user starts it (`python -m service`: seed preset, R=1, C=512, fused,
#      --frontends default), bench/latency_split.py around each load cell (T=512, bf16 on the wire):
#      v2 binary and gRPC at concurrency 1, v2 binary at concurrency 4 (bench/serve_load.py)
#   3. a summary (summary.txt): the phase lines of every cell
# Every step runs under `timeout`; BUDGET (s, default 200) caps the whole.
# Logs: $OUT (else build/gpu_rank_split): group.txt server.txt split_<cell>.txt summary.txt (6 files;
# the device tool brings 8 back at most)
#
# The call (carry [".whl"]; the wheels of bench/multigpu.sh):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit; python3 csrc/build.py; bash bench/gpu_rank_split.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
LOG=${OUT:-build/gpu_rank_split}
BUDGET=${BUDGET:-200}
CELL_S=${CELL_S:-4}
mkdir -p "$LOG"
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
cap() { local want=$1 l; l=$(left); (( l < want )) && want=$l; (( want < 1 )) && want=1; echo "$want"; }

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$LOG/summary.txt"
echo "commit $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown); torch $($PY -c 'import torch; print(torch.__version__)'); $(nproc) CPU cores; load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$LOG/summary.txt"

echo "== 1. the rank group alone (bench/cpu_stages.py on the GPU)"
timeout -k 5 "$(cap 80)" "$PY" bench/cpu_stages.py --preset seed --device cuda --backend auto --sizes 512,8 --steps 200 \
  > "$LOG/group.txt" 2>&1
echo "group rc=$?"
grep -E "^#|^\||^A step" "$LOG/group.txt" | tee -a "$LOG/summary.txt"

echo "== 2. the default server"
setsid "$PY" -m service --host 127.0.0.1 --http-port 18000 --grpc-port 18001 > "$LOG/server.txt" 2>&1 &
SERVER=$!
stop_server() {
  kill -TERM "$SERVER" 2>/dev/null
  for _ in $(seq 40); do kill -0 "$SERVER" 2>/dev/null || return; sleep 0.5; done
  kill -KILL -- "-$SERVER" 2>/dev/null
}
trap stop_server EXIT
ready=0
for _ in $(seq "$(cap 120)"); do
  if curl -sf -o /dev/null http://127.0.0.1:18000/v2/health/ready; then ready=1; break; fi
  kill -0 "$SERVER" 2>/dev/null || break
  sleep 1
done
echo "server ready=$ready after $(( $(date +%s) - START )) s" | tee -a "$LOG/summary.txt"
grep -E "fused unavailable|fused layer ready|rank group ready|warm-up|Traceback|ERROR" "$LOG/server.txt" | head -n 6 | tee -a "$LOG/summary.txt"
if (( ready == 0 )); then tail -n 40 "$LOG/server.txt"; exit 1; fi

for cell in v2_binary:1 grpc:1 v2_binary:4; do
  proto=${cell%%:*} conc=${cell##*:} name=${cell/:/_c}
  (( $(left) > 15 )) || { echo "skipped $cell: budget" | tee -a "$LOG/summary.txt"; continue; }
  "$PY" bench/latency_split.py --url http://127.0.0.1:18000 --save "/tmp/rank_split_before_$name.json" > /dev/null
  timeout -k 5 "$(cap 40)" "$PY" bench/serve_load.py --url http://127.0.0.1:18000 --grpc 127.0.0.1:18001 \
    --protocols "$proto" --sizes 512 --concurrency "$conc" --seconds "$CELL_S" --wire-dtype bf16 --no-direct \
    > "/tmp/rank_split_load_$name.txt" 2>&1
  "$PY" bench/latency_split.py --url http://127.0.0.1:18000 --before "/tmp/rank_split_before_$name.json" > "$LOG/split_$name.txt" 2>&1
  { echo "-- $cell (T=512, bf16)"; grep -E "^\| $proto" "/tmp/rank_split_load_$name.txt"; cat "$LOG/split_$name.txt"; } | tee -a "$LOG/summary.txt"
done
stop_server
trap - EXIT
echo "done in $(( $(date +%s) - START )) s" | tee -a "$LOG/summary.txt"
