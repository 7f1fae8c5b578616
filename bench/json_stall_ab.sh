#!/usr/bin/env bash
# Issue 11 item 3 (helper 14l): one JSON client's cost to the other clients of a front end, two
# or more trees, interleaved, on this CPU VM (no GPU). For each round and tree: start `python -m service`
# (the CPU default: cpu preset, R=4, one front end) with that tree first on PYTHONPATH, then
#   bench/user_trial.py --sizes 1 --routes v2_binary,grpc --beside moe_json:512   (the stalled clients)
#   bench/json_route.py --sizes 8,512       (the JSON routes alone, prebuilt bodies, answers read)
# and stop it. Usage: ROUNDS=2 CALLS=40 bench/json_stall_ab.sh TREE_A TREE_B [TREE...] > log
set -u
ROUNDS=${ROUNDS:-2} CALLS=${CALLS:-40}
HERE=$(cd "$(dirname "$0")/.." && pwd)
START=$(date +%s) BUDGET=${BUDGET:-1500}
source "$HERE/bench/serve_lib.sh"
trap stop_server EXIT
for round in $(seq "$ROUNDS"); do
  for tree in "$@"; do
    echo "== round $round tree $tree ($(git -C "$tree" rev-parse --short HEAD)) $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
    # from the tree itself: `python -m` puts the working directory before PYTHONPATH
    env -C "$tree" PYTHONPATH="$tree" setsid python -m service --http-port 18000 --grpc-port 18001 \
      --log-level WARNING &
    SERVER=$!
    wait_ready 120
    (( ready )) || { echo "server not ready"; stop_server; continue; }
    PYTHONPATH=$tree timeout 300 python "$HERE/bench/user_trial.py" --http 127.0.0.1:18000 --grpc 127.0.0.1:18001 \
      --sizes 1 --routes v2_binary,grpc --calls "$CALLS" --beside moe_json:512
    PYTHONPATH=$tree timeout 300 python "$HERE/bench/json_route.py" --http 127.0.0.1:18000 --sizes 8,512 \
      --calls "$CALLS"
    stop_server
  done
done
echo "== done $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
