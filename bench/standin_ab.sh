#!/usr/bin/env bash
# One checkout's stand-in server (bench/standin_serve.py: the real front ends before a group whose steps
# take STEP_MS) under several settings, the cells alternated between the arms (issue 11).
#   ARMS="off:MOE_WIRE_ARENA_MIB=0 on:MOE_WIRE_ARENA_MIB=256" REPS=2 SIZES=512 CONCURRENCY=1,4 \
#     PROTOCOLS=v2_binary CELL_S=4 bash bench/standin_ab.sh
# An arm is name:VAR=VALUE[,VAR=VALUE...] (MOE_* settings of its server). Per cell: tokens/s, the client's
# p50 and mean (bench/serve_load.py --json), and the server's own books over the cell, per request
# (bench/latency_split.py): arrival->answer, compute_input (rows into the slot), compute_output (out of it).
set -euo pipefail
ARMS=${ARMS:-"off:MOE_WIRE_ARENA_MIB=0 on:MOE_WIRE_ARENA_MIB=256"}
REPS=${REPS:-2}; SIZES=${SIZES:-512}; CONCURRENCY=${CONCURRENCY:-1,4}; PROTOCOLS=${PROTOCOLS:-v2_binary}
CELL_S=${CELL_S:-4}; STEP_MS=${STEP_MS:-1.4}; PY=${PY:-python}; BASE_PORT=${BASE_PORT:-18600}
LAYER=(--preset seed --world-size 1 --device cpu)
here=$(cd "$(dirname "$0")" && pwd); root=$(dirname "$here"); tmp=$(mktemp -d); pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"' EXIT
declare -A port
i=0
for arm in $ARMS; do
  name=${arm%%:*}; port[$name]=$((BASE_PORT + 10 * i)); i=$((i + 1))
  env_args=(); IFS=, read -ra settings <<<"${arm#*:}"
  for kv in "${settings[@]}"; do env_args+=("$kv"); done
  env "${env_args[@]}" PYTHONPATH="$root" "$PY" "$here/standin_serve.py" --step-ms "$STEP_MS" "${LAYER[@]}" \
    --http-port "${port[$name]}" --grpc-port $((port[$name] + 1)) --log-level WARNING >"$tmp/$name.log" 2>&1 &
  pids+=($!)
done
for arm in $ARMS; do
  name=${arm%%:*}
  for _ in $(seq 90); do
    "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:${port[$name]}/v2/health/ready', timeout=2)" \
      2>/dev/null && break
    sleep 1
  done
done
book() {  # the line of bench/latency_split.py whose text starts with $1: its ms
  sed -n "s/^$1[^:]*: \([0-9.na]*\) ms.*/\1/p" "$tmp/split.txt" | head -1
}
echo "| round | arm | protocol | T | c | requests | tokens/s | client p50 ms | client mean ms | server arrival->answer ms | compute_input ms | compute_output ms |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
for rep in $(seq "$REPS"); do
  for T in ${SIZES//,/ }; do
    for c in ${CONCURRENCY//,/ }; do
      for proto in ${PROTOCOLS//,/ }; do
        for arm in $ARMS; do
          name=${arm%%:*}; url=http://127.0.0.1:${port[$name]}
          PYTHONPATH=$root "$PY" "$here/latency_split.py" --url "$url" --save "$tmp/s.json" >/dev/null
          PYTHONPATH=$root "$PY" "$here/serve_load.py" --url "$url" --grpc 127.0.0.1:$((port[$name] + 1)) \
            --protocols "$proto" --sizes "$T" --concurrency "$c" --seconds "$CELL_S" --no-direct "${LAYER[@]}" \
            --json "$tmp/j.json" >/dev/null 2>&1
          PYTHONPATH=$root "$PY" "$here/latency_split.py" --url "$url" --before "$tmp/s.json" >"$tmp/split.txt"
          server=$(book "server arrival->answer"); cin=$(book "statistics compute_input")
          cout=$(book "statistics compute_output")
          "$PY" -c "import json; r=json.load(open('$tmp/j.json'))['results'][0]; print(f\"| $rep | $name | $proto | $T | $c | {r['requests']} | {r['tok_s']:,.0f} | {r['p50_ms']:.2f} | {r['mean_ms']:.2f} | $server | $cin | $cout |\")"
        done
      done
    done
  done
done
