#!/usr/bin/env bash
# The step's copies before/after on the CPU: a stand-in server per tree, each loaded in turn, with the
# server's own books around every cell (issue 11t).
#
#   bash bench/split_ab.sh ROUNDS "TREE[@COPY_THREADS] ..." PROTOCOLS SIZES CONCURRENCY SECONDS
#   e.g. bash bench/split_ab.sh 2 "/tmp/base /work/wt11t /work/wt11t@2" v2_shm,v2_binary 512,2048 1,4 3
#
# One bench/standin_serve.py per entry (that checkout's `service`, one front end, --shared-memory
# system, 1.4 ms stand-in steps, --copy-threads from @N, default 1; WS sets --world-size, default 1, so
# WS=4 makes 2048-row steps), then ROUNDS rounds of: for each server, protocol, size and concurrency,
# bench/latency_split.py --save, bench/serve_load.py (this checkout's, --wire-dtype $WIRE, default bf16),
# bench/latency_split.py --before: the serve_load row (prefixed "round R tree T") and the server's
# arrival->answer, compute_input, compute_infer and compute_output per request. The load average at the end.
set -uo pipefail
ROUNDS=$1; read -ra TREES <<< "$2"; PROTOS=$3; SIZES=$4; CONC=$5; SEC=$6
HERE=$(cd "$(dirname "$0")/.." && pwd)
LAYER=(--preset seed --world-size "${WS:-1}" --device cpu)
PORT=${PORT:-18600}
LOG=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' EXIT
for i in "${!TREES[@]}"; do
  entry=${TREES[$i]}; tree=${entry%@*}; threads=1
  [[ $entry == *@* ]] && threads=${entry#*@}
  hp=$((PORT + 10 * i))
  (cd "$tree" && PYTHONPATH=$tree OMP_NUM_THREADS=1 exec python bench/standin_serve.py --step-ms 1.4 "${LAYER[@]}" \
     --http-port $hp --grpc-port $((hp + 1)) --shared-memory system --frontends 1 --copy-threads "$threads" \
     --log-level WARNING) > "$LOG/server_$i.log" 2>&1 &
  pids+=($!)
done
for i in "${!TREES[@]}"; do
  hp=$((PORT + 10 * i))
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$hp/v2/health/ready" > /dev/null && break; sleep 0.5; done
  kill -0 "${pids[$i]}" 2> /dev/null || { echo "server $i (${TREES[$i]}) is not running:"; cat "$LOG/server_$i.log"; exit 1; }
done
for r in $(seq "$ROUNDS"); do for i in "${!TREES[@]}"; do
  hp=$((PORT + 10 * i))
  for proto in ${PROTOS//,/ }; do for T in ${SIZES//,/ }; do for c in ${CONC//,/ }; do
    PYTHONPATH=$HERE python "$HERE/bench/latency_split.py" --url "http://127.0.0.1:$hp" --save "$LOG/before.json" > /dev/null
    PYTHONPATH=$HERE timeout 120 python "$HERE/bench/serve_load.py" --url "http://127.0.0.1:$hp" --grpc "127.0.0.1:$((hp + 1))" \
      --protocols "$proto" --sizes "$T" --concurrency "$c" --seconds "$SEC" --wire-dtype "${WIRE:-bf16}" --no-direct \
      "${LAYER[@]}" 2>&1 | grep -E "^\| *$proto" | sed "s|^|round $r tree ${TREES[$i]} |"
    PYTHONPATH=$HERE python "$HERE/bench/latency_split.py" --url "http://127.0.0.1:$hp" --before "$LOG/before.json" \
      | grep -E "arrival->answer|compute_input|compute_infer|compute_output" | sed "s|^|    |"
  done; done; done
done; done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
