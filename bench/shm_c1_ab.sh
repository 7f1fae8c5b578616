#!/usr/bin/env bash
# grpc_shm against v2_shm at c=1 on stand-in servers of two checkouts, cells alternated (issue 11, helper G).
#   BEFORE=/work/main AFTER=$PWD REPS=3 SIZES=512,8 CELL_S=4 bash bench/shm_c1_ab.sh
# Each checkout serves bench/standin_serve.py (--shared-memory system, its own PYTHONPATH); per cell:
# the client's p50 and mean (bench/serve_load.py --json) and the server's own arrival->answer mean
# (bench/latency_split.py, the difference of two snapshots).
set -euo pipefail
BEFORE=${BEFORE:-/work/main}; AFTER=${AFTER:-$PWD}; REPS=${REPS:-3}; SIZES=${SIZES:-512,8}; CELL_S=${CELL_S:-4}
PROTOCOLS=${PROTOCOLS:-grpc_shm,v2_shm}; STEP_MS=${STEP_MS:-1.4}
PY=${PY:-python}; SITE=${SITE:-}  # SITE: more of PYTHONPATH (e.g. /tmp/site on the GPU host)
LAYER=(--preset seed --world-size 1 --device cpu)
here=$(cd "$(dirname "$0")" && pwd); tmp=$(mktemp -d); pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"' EXIT
declare -A port=([before]=18400 [after]=18410) tree=([before]=$BEFORE [after]=$AFTER)
for arm in before after; do
  PYTHONPATH=${tree[$arm]}${SITE:+:$SITE} "$PY" "${tree[$arm]}/bench/standin_serve.py" --step-ms "$STEP_MS" "${LAYER[@]}" \
    --http-port "${port[$arm]}" --grpc-port $((port[$arm] + 1)) --shared-memory system --log-level WARNING \
    >"$tmp/$arm.log" 2>&1 &
  pids+=($!)
done
for arm in before after; do
  for _ in $(seq 60); do
    "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:${port[$arm]}/v2/health/ready', timeout=2)" \
      2>/dev/null && break
    sleep 1
  done
done
echo "| round | arm | protocol | T | requests | client p50 ms | client mean ms | server arrival->answer mean ms |"
echo "|---|---|---|---|---|---|---|---|"
for rep in $(seq "$REPS"); do
  for T in ${SIZES//,/ }; do
    for proto in ${PROTOCOLS//,/ }; do
      for arm in before after; do
        url=http://127.0.0.1:${port[$arm]}
        PYTHONPATH=$AFTER${SITE:+:$SITE} "$PY" "$here/latency_split.py" --url "$url" --save "$tmp/s.json" >/dev/null
        PYTHONPATH=$AFTER${SITE:+:$SITE} "$PY" "$here/serve_load.py" --url "$url" --grpc 127.0.0.1:$((port[$arm] + 1)) \
          --protocols "$proto" --sizes "$T" --concurrency 1 --seconds "$CELL_S" --no-direct "${LAYER[@]}" \
          --json "$tmp/j.json" >/dev/null 2>&1
        server=$(PYTHONPATH=$AFTER${SITE:+:$SITE} "$PY" "$here/latency_split.py" --url "$url" --before "$tmp/s.json" \
          | sed -n 's/^server arrival->answer.*: \([0-9.]*\) ms.*/\1/p' | head -1)
        "$PY" -c "import json,sys; r=json.load(open('$tmp/j.json'))['results'][0]; print(f\"| $rep | $arm | $proto | $T | {r['requests']} | {r['p50_ms']:.3f} | {r['mean_ms']:.3f} | $server |\")"
      done
    done
  done
done
