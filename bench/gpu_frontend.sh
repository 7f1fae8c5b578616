#!/usr/bin/env bash
# Issue 11a on one H200 (nvidia-h200) in one call: the front end before and after, on the same machine.
#   1. bench/frontend_load.py on this host (no GPU: the stand-in group, 1.4 ms per step): the floor
#      (a bare asyncio / grpc.aio echo), BASE's front end, this tree's and (when uvloop is
#      installed) this tree's on uvloop, cells interleaved (T=512, concurrency 1 and 4, v2 binary
#      and gRPC), then this tree's per-request timeline (c=1)
#   2. the default server (`python -m service`: seed preset, R=1, C=512, fused) from BASE, loaded by
#      BASE's bench/serve_load.py (T=512 and 2048, concurrency 1 and 4, v2 binary and gRPC, bf16)
#   3. the same from this tree, with the layer alone in the same run (serve_load's direct figure)
#   (between 1 and 2: py-spy of this tree's stand-in front end under load, raw stacks in pyspy.txt)
# BASE (default: the checkout above this tree, i.e. main as the device tool sent it). csrc/ is not
# built (the fused layer then uses the torch schedule builder, logged): the same for both trees.
# Order: 1 (FL=0 skips), 2, 3 (SERVED=0 skips both), the timeline (TIMELINE=0 skips), py-spy (PYSPY=0 skips), each only
# while the budget lasts. Every step under `timeout`; BUDGET (s, default 270) caps the whole;
# CELL_S seconds per cell. Step 1's cells: FL_TREES (frontend_load's --trees, e.g. the gRPC floor's
# variants `floor,floor@sync,floor@server=all@client=all`), FL_PROTOCOLS, FL_SIZES, FL_REPS, and
# FL_S its time limit (s, default 80).
# Logs in $OUT (else build/gpu_frontend): fl.txt timeline.txt pyspy.txt base.txt this.txt summary.txt
#
# The call (carry [".wt11a", ".whl"]; uvloop's cp312 wheel copied into .wt11a/whl/ beforehand):
#   cd .wt11a && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site ../.whl/*.whl whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit; bash bench/gpu_frontend.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
HERE=$PWD
BASE=$(cd "${BASE:-..}" && pwd)
PY=${PYTHON:-python3}
LOG=${OUT:-build/gpu_frontend}
BUDGET=${BUDGET:-270}
CELL_S=${CELL_S:-2}
SITE=${SITE:-/tmp/site}
mkdir -p "$LOG" && LOG=$(cd "$LOG" && pwd)
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
cap() { local want=$1 l; l=$(left); (( l < want )) && want=$l; (( want < 1 )) && want=1; echo "$want"; }

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  echo "this tree $(cat COMMIT 2>/dev/null || git log -1 --format=%h 2>/dev/null || echo unknown)," \
       "base $(cat "$BASE/COMMIT" 2>/dev/null || git -C "$BASE" log -1 --format=%h 2>/dev/null || echo unknown);" \
       "torch $($PY -c 'import torch; print(torch.__version__)'); $(nproc) CPU cores; load $(cut -d' ' -f1 /proc/loadavg)"
} | tee "$LOG/summary.txt"

if [[ "${FL:-1}" == 1 ]]; then
echo "== 1. the stand-in front end: floor, base, this tree"
TREES="floor,$BASE,$HERE"
PYTHONPATH=$SITE "$PY" -c "import uvloop" 2>/dev/null && TREES="$TREES,$HERE@uvloop"
PYTHONPATH=$HERE:$SITE timeout -k 5 "$(cap "${FL_S:-80}")" "$PY" bench/frontend_load.py --trees "${FL_TREES:-$TREES}" \
  --protocols "${FL_PROTOCOLS:-v2_binary,grpc}" --sizes "${FL_SIZES:-512}" --concurrency 1,4 \
  --seconds "$CELL_S" --reps "${FL_REPS:-1}" > "$LOG/fl.txt" 2>&1
echo "rc=$?"; grep -E "^\|" "$LOG/fl.txt"
fi

for which in base this; do
  if [[ $which == base ]]; then dir=$BASE; extra=(--no-direct); else dir=$HERE; extra=(); fi
  [[ "${SERVED:-1}" == 1 ]] || continue
  (( $(left) > 50 )) || { echo "== $which skipped: budget spent"; continue; }
  echo "== the served path from $which ($dir)"
  (cd "$dir" && PYTHONPATH=$dir:$SITE timeout -k 10 "$(cap 110)" "$PY" bench/serve_load.py --sizes 512,2048 \
    --concurrency 1,4 --seconds "$CELL_S" --wire-dtype bf16 "${extra[@]}" > "$LOG/$which.txt" 2>&1)
  echo "rc=$?"; grep -E "^\||busy|started" "$LOG/$which.txt"
done


if [[ "${TIMELINE:-1}" == 1 ]] && (( $(left) > 25 )); then
  echo "== this tree's per-request timeline (stand-in, c=1)"
PYTHONPATH=$HERE:$SITE timeout -k 5 "$(cap 30)" "$PY" bench/frontend_load.py --sizes 512 --timeline \
  --seconds "$CELL_S" > "$LOG/timeline.txt" 2>&1
echo "rc=$?"; grep -E "^\||^timeline" "$LOG/timeline.txt"

fi

if [[ "${PYSPY:-1}" == 1 ]] && (( $(left) > 35 )); then
echo "== py-spy of this tree's stand-in front end under load (T=512, 4 clients, v2 binary then gRPC)"
PYSPY=$(command -v py-spy || echo "$SITE/bin/py-spy")
PYTHONPATH=$HERE:$SITE timeout -k 5 "$(cap 35)" "$PY" bench/frontend_load.py --sizes 512 --concurrency 4 \
  --seconds 4 > "$LOG/pyspy_load.txt" 2>&1 &
LOADPID=$!
for _ in $(seq 40); do SPID=$(pgrep -f "frontend_load.py serve" | head -n 1); [[ -n $SPID ]] && break; sleep 0.5; done
sleep 4
[[ -n ${SPID:-} ]] && timeout -k 5 "$(cap 20)" "$PYSPY" record --pid "$SPID" --rate 100 --duration 10 --threads --idle --format raw \
  --output "$LOG/pyspy.txt" --nonblocking > "$LOG/pyspy_log.txt" 2>&1
echo "py-spy rc=$?"; wait "$LOADPID"; grep -E "^\|" "$LOG/pyspy_load.txt"

fi

{
  echo
  echo "== summary: $(( $(date +%s) - START )) s"
  echo "-- stand-in front end (frontend_load.py)"; grep -E "^\|" "$LOG/fl.txt"
  echo "-- timeline"; grep -E "^\||^timeline" "$LOG/timeline.txt"
  for which in base this; do echo "-- served, $which"; grep -E "^\||busy" "$LOG/$which.txt"; done
} >> "$LOG/summary.txt"
