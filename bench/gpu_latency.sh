#!/usr/bin/env bash
# Issue 11, one short H200 call: the default server's latency split at concurrency 1 (the server's
# own books, bench/latency_split.py, around a concurrency-1 load), then throughput at concurrency
# 4 and 16 with the layer alone in the same run. Wheels as in bench/gpu_serve.sh. BUDGET (s) caps it.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
LOG=${OUT:-build/gpu_latency}
BUDGET=${BUDGET:-200}
mkdir -p "$LOG"
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
U=http://127.0.0.1:18000
setsid "$PY" -m service --host 127.0.0.1 --http-port 18000 --grpc-port 18001 > "$LOG/server.txt" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; sleep 3; kill -KILL -- -$SERVER 2>/dev/null' EXIT
for _ in $(seq 120); do curl -sf -o /dev/null $U/v2/health/ready && break; kill -0 $SERVER || break; sleep 1; done
echo "ready after $(( $(date +%s) - START )) s"
grep -E "fused layer ready|rank group ready|warm-up|front end|Traceback|ERROR" "$LOG/server.txt" | head -n 8
for proto in v2_binary grpc; do
  "$PY" bench/latency_split.py --url $U --save "$LOG/before_$proto.json" > /dev/null
  timeout 40 "$PY" bench/serve_load.py --url $U --grpc 127.0.0.1:18001 --protocols $proto --sizes 512 \
    --concurrency 1 --seconds 4 --no-direct 2>&1 | grep -E "^\|" | tee "$LOG/c1_$proto.txt"
  "$PY" bench/latency_split.py --url $U --before "$LOG/before_$proto.json" | tee "$LOG/split_$proto.txt"
done
timeout "$(left)" "$PY" bench/serve_load.py --url $U --grpc 127.0.0.1:18001 --sizes 512,2048 \
  --concurrency 4,16 --seconds 3 --direct-steps 30 2>&1 | grep -vE "^(INFO|DEBUG)" | tail -n 16 | tee "$LOG/load.txt"
