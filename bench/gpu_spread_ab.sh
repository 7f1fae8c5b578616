#!/usr/bin/env bash
# One client's c=1 latency on each front end of the default server, for two (or more) trees alternated
# in one call (issue 11; bench/NOTES.md, twenty-first session): with 4 front ends the kernel puts 3 of 4
# connections on a front end i >= 1, whose steps go through the owner. Each arm starts `python -m service`
# (defaults: 4 front ends on a GPU host) from its tree, runs bench/frontend_spread.py (CONNECTIONS
# connections one after another, REQUESTS v2 binary T=512 bf16 requests each, p50 / p90 per front-end
# process) and, with LOAD=1, bench/serve_load.py at c=4 (v2 binary and gRPC, T=512, 3 s a cell).
# Usage (device machine, repository root, web wheels installed under /tmp/site, PYTHONPATH set, each
# tree's csrc built):
#   ARMS=". .base .:MOE_RANK_IDLE_SPIN_MS=0" ROUNDS=2 BUDGET=400 bash bench/gpu_spread_ab.sh
# An arm is TREE[:VAR=VALUE] (a MOE_* setting of its server); a tree other than "." is another commit's
# tree inside this checkout (`git archive <commit> | (mkdir -p .base && tar -x -C .base)`, carried).
# Knobs: ARMS (". .base"), ROUNDS (2), BUDGET (s, 400), CONNECTIONS (16), REQUESTS (40), LOAD (1), SITE, PYTHON.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
SITE=${SITE:-/tmp/site}
PY=${PYTHON:-python3}
START=$(date +%s)
BUDGET=${BUDGET:-400}
source bench/serve_lib.sh  # left, cap, wait_ready, stop_server
read -ra ARM_LIST <<< "${ARMS:-. .base}"

arm() {  # TREE[:VAR=VALUE]
  local tree=${1%%:*} envs=()
  [[ "$1" == *:* ]] && envs=("${1#*:}")
  if (( $(left) < 40 )); then echo "== $1: the budget is spent"; return; fi
  (cd "$tree" && PYTHONPATH="$ROOT/$tree:$SITE" exec env "${envs[@]}" setsid "$PY" -m service --host 127.0.0.1 \
    --http-port 18000 --grpc-port 18001 > "/tmp/spread_server.txt" 2>&1) &
  SERVER=$!
  wait_ready 240
  echo "== $1: ready=$ready after $(( $(date +%s) - START )) s"
  if (( ready )); then
    timeout 90 "$PY" bench/frontend_spread.py --url http://127.0.0.1:18000 --connections "${CONNECTIONS:-16}" \
      --requests "${REQUESTS:-40}" 2>&1 | tail -n 8
    if (( ${LOAD:-1} )); then
      timeout 90 "$PY" bench/serve_load.py --url http://127.0.0.1:18000 --grpc 127.0.0.1:18001 \
        --protocols v2_binary,grpc --sizes 512 --concurrency 4 --seconds 3 --wire-dtype bf16 --no-direct 2>&1 \
        | grep -E "^\| (v2|grpc)"
    fi
  else
    tail -n 5 /tmp/spread_server.txt
  fi
  stop_server
}

for _ in $(seq "${ROUNDS:-2}"); do
  for a in "${ARM_LIST[@]}"; do arm "$a"; done
done
echo "== done in $(( $(date +%s) - START )) s"
