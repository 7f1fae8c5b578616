#!/usr/bin/env bash
# Issue 11 on one H200 (nvidia-h200) in one call of the device tool: the served path against the
# layer alone. The default server, as a user starts it (`python -m service`: seed preset, R=1 on one
# GPU, C=512, backend auto = fused), then:
#   1. py-spy of the front end and its rank under load (v2 binary + gRPC, T=512, bf16, 4 clients):
#      collapsed stacks in pyspy.txt (py-spy raw format; `python bench/pyspy_summary.py pyspy.txt` reads it)
#   0. when GROUP=1: the rank group alone, no front end (bench/cpu_stages.py --device cuda, T=512 and
#      8): stage and step-phase medians (StepStats.phases) in group.txt
#   1b. bench/latency_split.py around a load per protocol (T=512) at each concurrency of SPLIT_CONC
#      (default "1"; e.g. "1 4") and protocol of SPLIT_PROTOCOLS (default "v2_binary grpc"; the shm ones with
#      SERVE_FLAGS="--shared-memory system"): the server's own books (arrival to answer, the statistics' phases,
#      layer, stages, moe_step_seconds and its phases moe_step_phase_seconds); SPLIT=0 skips
#   2. bench/serve_load.py against it: v2 binary and gRPC, bf16 on the wire, T=512 and 2048,
#      concurrency 1, 4, 16; the layer alone at the same step shapes in the same run (after the load);
#      LOAD=0 skips
#   3. bench/multigpu.py load: the issue's own protocol (fp32, 4 threads of one client process),
#      when MULTIGPU_LOAD=1
#   4. bench/frontend_costs.py: the host-side stages of one request, each alone (T=512, 2048)
#   5. when SLOTS2 is set (e.g. 4): the server again with --slots $SLOTS2, serve_load at T=512
#   6. when HTTP_IMPLS is set (e.g. "h11 httptools"): the same v2 binary load (bf16, T=512 and 2048,
#      concurrency 1, 4, 16) against a server started with each --http-impl in turn, by
#      bench/serve_load.py (it starts and stops each server); the tables side by side in the summary
#   7. when FRONTENDS is set (e.g. "1" or "1 2"): bench/serve_load.py starts a server with each
#      --frontends N in turn (bf16, sizes FE_SIZES, default 512,2048; concurrency FE_CONC, default
#      4,16; no direct figure: step 2 has it) against step 2's default server (--frontends default)
#   8. a summary (summary.txt)
# Every step runs under `timeout`; BUDGET (s, default 500) caps the whole. PROFILE=0 / COSTS=0 skip
# steps 1 / 4; MAIN=0 skips steps 1-3 (and their server), e.g. to run step 6 alone. CLIENT=raw makes
# step 2's HTTP client a raw socket (serve_load --client raw: what the server alone costs) instead of
# http.client (the default, what a user's script runs); CLIENT="stock raw" loads the same server with
# each in turn (the second's files get a _<client> suffix). SIZES (default 512,2048) and CONCURRENCY
# (default 1,4,16) set step 2's cells, PROTOCOLS (default v2_binary,grpc) its protocols: add v2_shm,grpc_shm
# (Triton's system shared memory, issue 11s) with SERVE_FLAGS="--shared-memory system"; PYSPY_PROTOCOLS
# step 1's protocols, PYSPY_CONC its concurrency (default 4), PYSPY_FLAGS py-spy's extra flags (e.g. "--idle
# --native"; top.txt has every thread's CPU share meanwhile). REPEAT=N runs each step-2 cell N times (new
# connections each time); SPREAD=1 adds how each cell's connections spread over the server's processes.
# Files (packed into ONE file, $OUT/serve.tgz, else build/gpu_serve/serve.tgz: a device call returns
# at most 8 files): server.txt pyspy.txt serve_load.txt serve_load.json load.txt
# split_<protocol>_c<concurrency>.txt group.txt costs.txt slots.txt http_<impl>.txt http_<impl>.json
# frontends_<n>.txt frontends_<n>.json summary.txt
#
# The call (repository root; carry [".whl"]: the wheels listed in bench/multigpu.sh plus py-spy):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit; python3 csrc/build.py; \
#     OUT=$OUT bash bench/gpu_serve.sh
# h11 against httptools alone (step 6, both servers in one call; the .whl list includes httptools):
#   the same, ending in `MAIN=0 COSTS=0 HTTP_IMPLS="h11 httptools" OUT=$OUT bash bench/gpu_serve.sh`
# A step's split between the owner of the rank group and rank 0 (issue 11e, ~3 min):
#   the same, ending in `BUDGET=200 PROFILE=0 COSTS=0 LOAD=0 GROUP=1 SPLIT_CONC="1 4" OUT=$OUT bash bench/gpu_serve.sh`
# System shared memory against the wire, with the layer alone in the same run (issue 11s, ~4 min):
#   the same, ending in (one line)
#   `BUDGET=240 CELL_S=3 PROFILE=0 SPLIT=0 COSTS=0 SERVE_FLAGS="--shared-memory system" PROTOCOLS=v2_binary,v2_shm,grpc,grpc_shm OUT=$OUT bash bench/gpu_serve.sh`
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
DEST=${OUT:-build/gpu_serve}
LOG=$(mktemp -d)
BUDGET=${BUDGET:-500}
CELL_S=${CELL_S:-4}
SERVE_FLAGS=(${SERVE_FLAGS:-})
mkdir -p "$DEST"
START=$(date +%s)
source bench/serve_lib.sh  # left, cap, wait_ready, stop_server
pack() { tar -czf "$DEST/serve.tgz.tmp" -C "$LOG" . && mv "$DEST/serve.tgz.tmp" "$DEST/serve.tgz"; }
trap pack EXIT
PYSPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$LOG/summary.txt"
git_commit=$(cat COMMIT 2>/dev/null || echo unknown)
df -h /dev/shm | tail -n 1 | tee -a "$LOG/summary.txt"  # the shm protocols' objects live there (PROTOCOLS)
echo "commit $git_commit; torch $($PY -c 'import torch; print(torch.__version__)'); $(nproc) CPU cores" | tee -a "$LOG/summary.txt"

SL_RC=skipped LOAD_RC=skipped
# ---- 0. the rank group alone ----------------------------------------------------------------------
if [[ "${GROUP:-0}" == 1 ]]; then
  echo "== 0. the rank group alone: bench/cpu_stages.py on the GPU (T=512 and 8, 200 steps, one at a time)"
  timeout -k 5 "$(cap 90)" "$PY" bench/cpu_stages.py --preset seed --device cuda --backend auto --sizes 512,8 \
    --steps 200 > "$LOG/group.txt" 2>&1
  echo "rc=$?"; grep -E "^#|^\||^A step|Error" "$LOG/group.txt"
fi
if [[ "${MAIN:-1}" == 1 ]]; then
# ---- the server ---------------------------------------------------------------------------------
setsid "$PY" -m service --host 127.0.0.1 --http-port 18000 --grpc-port 18001 "${SERVE_FLAGS[@]}" > "$LOG/server.txt" 2>&1 &
SERVER=$!
trap 'stop_server; pack' EXIT
wait_ready 240
echo "server ready=$ready after $(( $(date +%s) - START )) s" | tee -a "$LOG/summary.txt"
grep -E "fused unavailable|fused layer ready|rank group ready|warm-up|weights ready|front-end process|front end . listening|Traceback|ERROR" "$LOG/server.txt" | head -n 12 | tee -a "$LOG/summary.txt"
if (( ready == 0 )); then tail -n 40 "$LOG/server.txt"; exit 1; fi

# ---- 1. profile under load ----------------------------------------------------------------------
echo "== 1. py-spy under load"
if [[ "${PROFILE:-1}" == 1 ]]; then
timeout -k 5 "$(cap 60)" "$PY" bench/serve_load.py --url http://127.0.0.1:18000 --grpc 127.0.0.1:18001 \
  --protocols "${PYSPY_PROTOCOLS:-grpc,v2_binary}" --sizes 512 --concurrency "${PYSPY_CONC:-4}" --seconds 12 --no-direct \
  "${SERVE_FLAGS[@]}" > "$LOG/pyspy_load.txt" 2>&1 &
LOADPID=$!
sleep 5
# every thread's CPU share while loaded (is a neighbour spinning?): three 1 s samples of the server's processes
top -H -b -d 1 -n 3 -w 250 > "$LOG/top.txt" 2>&1 &
TOPPID=$!
read -ra PYSPY_EXTRA <<< "${PYSPY_FLAGS:-}"  # e.g. "--idle --native": idle frames, and where a thread waits for the GIL
[[ " ${PYSPY_EXTRA[*]} " == *" --native "* ]] || PYSPY_EXTRA+=(--nonblocking)  # py-spy pauses for native stacks
timeout -k 5 "$(cap 30)" "$PYSPY" record --pid "$SERVER" --subprocesses --rate 100 --duration 8 --format raw \
  "${PYSPY_EXTRA[@]}" --output "$LOG/pyspy.txt" > "$LOG/pyspy_log.txt" 2>&1
echo "py-spy rc=$?"; tail -n 3 "$LOG/pyspy_log.txt"
wait "$TOPPID"; awk '/^top -/{n++} n==3' "$LOG/top.txt" | head -n 40
wait "$LOADPID"; echo "profile load rc=$?"; grep -E "^\|" "$LOG/pyspy_load.txt" | head -n 6
fi

# ---- 1b. a request's time from the server's own books -------------------------------------------
if [[ "${SPLIT:-1}" == 1 ]]; then
read -ra SPLIT_CONCS <<< "${SPLIT_CONC:-1}"
for conc in "${SPLIT_CONCS[@]}"; do
read -ra SPLIT_PROTOS <<< "${SPLIT_PROTOCOLS:-v2_binary grpc}"
for proto in "${SPLIT_PROTOS[@]}"; do
  echo "== 1b. bench/latency_split.py around a concurrency-$conc load ($proto, T=512, bf16)"
  (( $(left) > 15 )) || { echo "skipped: budget spent"; continue; }
  "$PY" bench/latency_split.py --url http://127.0.0.1:18000 --save "/tmp/split_before_${proto}_c$conc.json" > /dev/null
  timeout -k 5 "$(cap 40)" "$PY" bench/serve_load.py --url http://127.0.0.1:18000 --grpc 127.0.0.1:18001 \
    --protocols "$proto" --sizes 512 --concurrency "$conc" --seconds "$CELL_S" --wire-dtype bf16 --no-direct 2>&1 | grep -E "^\|"
  "$PY" bench/latency_split.py --url http://127.0.0.1:18000 --before "/tmp/split_before_${proto}_c$conc.json" \
    | tee "$LOG/split_${proto}_c$conc.txt"
done
done
fi

# ---- 2. bench/serve_load.py ---------------------------------------------------------------------
if [[ "${LOAD:-1}" == 1 ]]; then
read -ra CLIENT_LIST <<< "${CLIENT:-stock}"
for client in "${CLIENT_LIST[@]}"; do
echo "== 2. bench/serve_load.py (bf16, $client HTTP client)"
suffix=$([[ "$client" == "${CLIENT_LIST[0]}" ]] || echo "_$client")
timeout -k 10 "$(cap 240)" "$PY" bench/serve_load.py --url http://127.0.0.1:18000 --grpc 127.0.0.1:18001 \
  --sizes "${SIZES:-512,2048}" --concurrency "${CONCURRENCY:-1,4,16}" --seconds "$CELL_S" --wire-dtype bf16 \
  --protocols "${PROTOCOLS:-v2_binary,grpc}" --json "$LOG/serve_load$suffix.json" --client "$client" \
  --repeat "${REPEAT:-1}" ${SPREAD:+--spread} "${SERVE_FLAGS[@]}" > "$LOG/serve_load$suffix.txt" 2>&1
SL_RC=$?
tail -n 20 "$LOG/serve_load$suffix.txt"
done
fi

# ---- 3. the issue's protocol --------------------------------------------------------------------
echo "== 3. bench/multigpu.py load (fp32, 4 clients)"
if [[ "${MULTIGPU_LOAD:-0}" == 1 ]] && (( $(left) > 40 )); then
  timeout -k 10 "$(cap 90)" "$PY" bench/multigpu.py load --url http://127.0.0.1:18000 --grpc 127.0.0.1:18001 \
    --preset seed --sizes 512,2048 --concurrency 4 --seconds 5 > "$LOG/load.txt" 2>&1
  LOAD_RC=$?
  grep -E "^\||steps, mean" "$LOG/load.txt"
fi
stop_server
fi  # MAIN

if [[ "${COSTS:-1}" == 1 ]]; then
  echo "== 4. bench/frontend_costs.py"
  timeout -k 5 "$(cap 60)" "$PY" bench/frontend_costs.py --sizes 512,2048 --wire-dtype bf16 > "$LOG/costs.txt" 2>&1
  cat "$LOG/costs.txt"
fi

if [[ -n "${SLOTS2:-}" ]] && (( $(left) > 90 )); then
  echo "== 5. the server with --slots $SLOTS2"
  setsid "$PY" -m service --host 127.0.0.1 --http-port 18000 --grpc-port 18001 --slots "$SLOTS2" "${SERVE_FLAGS[@]}" \
    > "$LOG/server2.txt" 2>&1 &
  SERVER=$!
  wait_ready 120
  timeout -k 10 "$(cap 90)" "$PY" bench/serve_load.py --url http://127.0.0.1:18000 --grpc 127.0.0.1:18001 \
    --sizes 512 --concurrency 4,16 --seconds "$CELL_S" --no-direct "${SERVE_FLAGS[@]}" > "$LOG/slots.txt" 2>&1
  grep -E "^\|" "$LOG/slots.txt"
  stop_server
fi
trap pack EXIT

read -ra HTTP_IMPLS <<< "${HTTP_IMPLS:-}"
for impl in "${HTTP_IMPLS[@]}"; do
  (( $(left) > 60 )) || { echo "== 6. --http-impl $impl skipped: budget spent"; continue; }
  echo "== 6. v2 binary against --http-impl $impl"
  timeout -k 10 "$(cap 200)" "$PY" bench/serve_load.py --protocols v2_binary --sizes 512,2048 --concurrency 1,4,16 \
    --seconds "$CELL_S" --wire-dtype bf16 --no-direct --json "$LOG/http_$impl.json" --http-impl "$impl" \
    "${SERVE_FLAGS[@]}" > "$LOG/http_$impl.txt" 2>&1
  echo "rc=$?"; grep -E "^\|" "$LOG/http_$impl.txt"
done

read -ra FRONTENDS_LIST <<< "${FRONTENDS:-}"
for n in "${FRONTENDS_LIST[@]}"; do
  (( $(left) > 60 )) || { echo "== 7. --frontends $n skipped: budget spent"; continue; }
  echo "== 7. bench/serve_load.py against --frontends $n"
  timeout -k 10 "$(cap 200)" "$PY" bench/serve_load.py --sizes "${FE_SIZES:-512,2048}" --concurrency "${FE_CONC:-4,16}" \
    --seconds "$CELL_S" --wire-dtype bf16 --no-direct --json "$LOG/frontends_$n.json" --frontends "$n" \
    "${SERVE_FLAGS[@]}" > "$LOG/frontends_$n.txt" 2>&1
  echo "rc=$?"; grep -E "^\||^#" "$LOG/frontends_$n.txt"
done

{
  echo
  echo "== summary: $(( $(date +%s) - START )) s; serve_load rc=$SL_RC, multigpu load rc=$LOAD_RC"
  for f in "$LOG"/serve_load*.txt; do [[ -e $f ]] && echo "${f##*/}:" && grep -E "^#|^\||busy" "$f"; done
  grep -E "^\||^A step" "$LOG/group.txt" 2>/dev/null
  for f in "$LOG"/split_*.txt; do [[ -e $f ]] && echo "${f##*/}:" && grep -E "arrival|compute_infer|part=|step phases" "$f"; done
  grep -E "^\||steps, mean" "$LOG/load.txt" 2>/dev/null
  grep -E "^\|" "$LOG/costs.txt" 2>/dev/null
  [[ -n "${SLOTS2:-}" ]] && echo "slots $SLOTS2:" && grep -E "^\|" "$LOG/slots.txt" 2>/dev/null
  for impl in "${HTTP_IMPLS[@]}"; do echo "--http-impl $impl:"; grep -E "^\|" "$LOG/http_$impl.txt" 2>/dev/null; done
  for n in "${FRONTENDS_LIST[@]}"; do echo "--frontends $n:"; grep -E "^\|" "$LOG/frontends_$n.txt" 2>/dev/null; done
} | tee -a "$LOG/summary.txt"
