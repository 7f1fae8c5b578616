#!/usr/bin/env bash
# A lone request's path through the real default server on the GPU, as a timeline: where the c=1 p50
# goes beyond the layer (issue 11's latency goal; bench/NOTES.md, eighteenth session).
# The server is bench/frontend_timeline.py (`python -m service`'s defaults with one front end, its own
# functions stamped; no stand-in), loaded by bench/serve_load.py at concurrency 1 (bf16 on the wire):
# PROTOCOLS x SIZES with the stock HTTP client, then v2_binary with --client raw (one sendall, one
# recv_into: what the server alone costs). latency_split.py's books (the ranks' step phases) are taken
# around the load. SIGTERM ends the server, which writes the timeline; everything is printed.
# Usage (device machine, repository root, web wheels installed under /tmp/site, PYTHONPATH set):
#   OUT=$OUT bash bench/gpu_timeline.sh
# Knobs: PROTOCOLS (v2_binary,grpc), SIZES (512,8), CELL_S (4), READY_S (200), PYTHON, OUT (build/gpu_timeline).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
DEST=${OUT:-build/gpu_timeline}
CELL_S=${CELL_S:-4}
mkdir -p "$DEST"
URL=http://127.0.0.1:18000
setsid "$PY" bench/frontend_timeline.py --out "$DEST/timeline.txt" --host 127.0.0.1 --http-port 18000 \
  --grpc-port 18001 > "$DEST/server.txt" 2>&1 &
SERVER=$!
trap 'kill -KILL -- "-$SERVER" 2>/dev/null' EXIT
ready=0
for _ in $(seq "${READY_S:-200}"); do
  if curl -sf -o /dev/null "$URL/v2/health/ready"; then ready=1; break; fi
  kill -0 "$SERVER" 2>/dev/null || break
  sleep 1
done
echo "ready=$ready after ${SECONDS} s"
if (( ! ready )); then grep -v "no tile config" "$DEST/server.txt" | tail -n 20; exit 1; fi
timeout 20 "$PY" bench/latency_split.py --url "$URL" --save "$DEST/split_before.json" > /dev/null 2>&1
load() {
  timeout -k 10 120 "$PY" bench/serve_load.py --url "$URL" --grpc 127.0.0.1:18001 --concurrency 1 \
    --seconds "$CELL_S" --wire-dtype bf16 --no-direct "$@" 2>&1 | grep -E "^\| (v2|grpc)"
}
load --protocols "${PROTOCOLS:-v2_binary,grpc}" --sizes "${SIZES:-512,8}" | tee "$DEST/load.txt"
load --protocols v2_binary --sizes "${SIZES:-512,8}" --client raw | sed "s/^| v2_binary/| v2_binary raw/" | tee -a "$DEST/load.txt"
timeout 20 "$PY" bench/latency_split.py --url "$URL" --before "$DEST/split_before.json" > "$DEST/split.txt" 2>&1
grep -E "arrival|receive|send|compute_|step phases|moe_layer" "$DEST/split.txt"
kill -TERM "$SERVER"
for _ in $(seq 60); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.5; done
cat "$DEST/timeline.txt"
