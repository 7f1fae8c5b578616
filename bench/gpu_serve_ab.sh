#!/usr/bin/env bash
# The default server of two (or more) checkouts on one GPU host, alternated in one call: is a change
# in served throughput the code's or the machine's? (bench/NOTES.md, "Issue 11h".)
# Each round starts `python -m service` (defaults: seed preset, R=1 on one GPU, C=512, fused, the
# default front ends) from each root of TREES in turn (its own `service`, its csrc built once) and
# loads it with this checkout's bench/serve_load.py (bf16 on the wire, --no-direct, --spread: each cell's
# connections per front-end process, read from /proc, a column of its own); the root named
# by PYSPY_TREE is also profiled once: py-spy of every process and `top` under a load of PYSPY_CONC
# (default 16) clients (PYSPY_PROTOCOL, default v2_binary; e.g. 4 and grpc: is the owner's GIL the limit?).
# Read the profile with `python bench/pyspy_summary.py pyspy_<tree>.txt`.
# The root named by PA_TREE is also loaded, after serve_load in every round, by NVIDIA's perf_analyzer (a C++
# client: how much of a cell is the Python client's?): PA_PROTOCOLS (grpc,http) x PA_SIZES (512, its -b) x
# PA_CONC (1,4), 3 windows of 2 s each, rows from bench/pa_rows.py (distinct tokens, in the layer's dtype); PA_BIN is the binary
# (default .whl/pa/perf_analyzer, carried with libb64.so.0d and libcudart.so.12 beside it; .ci/install-tools
# says where they come from). Its lines: `| pa_<protocol> | T | c | tokens/s | p50 ms | p99 ms |`.
# Usage (device machine, repository root, web wheels installed under /tmp/site):
#   TREES=". .base" ROUNDS=2 CELL_S=3 CONCURRENCY=4,16 [PYSPY_TREE=.] OUT=$OUT bash bench/gpu_serve_ab.sh
# Knobs: BUDGET (s, default 400), PROTOCOLS (v2_binary,grpc; the shm ones need MOE_SHARED_MEMORY=system
# in the environment, which every server inherits, as any MOE_ setting), SIZES (512), CONCURRENCY (4,16), CELL_S (3), ROUNDS (1),
# CHECK (0; 1: bench/served_check.py against each tree's server in round 1, before its load: every answer against
# the fp32 reference, the NaN row, the arena's share of the rows; its last two lines printed),
# RAW (0; 1: after each load, v2_binary at concurrency 1 with serve_load's --client raw), SPLIT (0; 1: bench/latency_split.py around each server's load, its receive/send lines printed), DIRECT (0;
# 1: the layer alone at the served step before the rounds, this checkout's code: the ratio's denominator), SITE (the
# wheels' target, /tmp/site), PYTHON, OUT (else build/gpu_serve_ab). Everything it writes is packed
# into ONE file, $OUT/serve_ab.tgz (also when a step fails); the summary is printed.
# A root other than "." is a copy of another commit's tree inside this checkout (carried), e.g.
#   git archive <commit> | (mkdir -p .base && tar -x -C .base)
# An entry ROOT:VAR=VALUE serves ROOT with that environment variable set (e.g. ".:MOE_RANK_LOOKAHEAD=1").
# ".:BENCH_KEEPERS=N" serves ROOT as it is, beside N busy loops at SCHED_IDLE (-1: one per CPU;
# bench/wake_probe.py --keep-only) from before the server starts until it stops: does keeping every vCPU
# running (no halted vCPU to wake through the hypervisor) shorten the served path on a slow-waking host?
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
PY=${PYTHON:-python3}
DEST=${OUT:-build/gpu_serve_ab}  # one file comes back: $DEST/serve_ab.tgz (a device call returns at most 8)
LOG=$(mktemp -d)
BUDGET=${BUDGET:-400}
CELL_S=${CELL_S:-3}
# -d "": the whole value, newlines included (a TREES pasted across lines keeps its every entry)
read -d "" -ra TREE_LIST <<< "${TREES:-.}" || true
mkdir -p "$DEST"  # LOG is absolute: the servers run in their trees
START=$(date +%s)
source bench/serve_lib.sh  # left, cap, wait_ready, stop_server
PYSPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
SITE=${SITE:-/tmp/site}

declare -A BUILT=()
for entry in "${TREE_LIST[@]}"; do
  tree=${entry%%:*}
  [[ -n "${BUILT[$tree]:-}" ]] && continue
  BUILT[$tree]=1
  (cd "$tree" && PYTHONPATH="$ROOT/$tree:$SITE" "$PY" csrc/build.py > "$LOG/build_${tree//[.\/]/_}.txt" 2>&1)
  echo "built $tree: rc=$?"
done

PA_BIN=${PA_BIN:-$ROOT/.whl/pa/perf_analyzer} PA_PROTOCOLS=${PA_PROTOCOLS:-grpc,http} PA_CONC=${PA_CONC:-1,4}
PA_ROWS=$(mktemp -d)/rows.json  # not in LOG: tens of MB that need not come back
if [[ -n "${PA_TREE:-}" ]]; then
  IFS=, read -ra pa_sizes <<< "${PA_SIZES:-512}"
  PYTHONPATH="$ROOT:$SITE" "$PY" bench/pa_rows.py --rows "$(printf "%s\n" "${pa_sizes[@]}" | sort -n | tail -n 1)" \
    --out "$PA_ROWS" 2>&1 | tail -n 1
fi
# perf_analyzer PROTOCOL T C: one cell against the server on 18000/18001, its table line printed
perf_analyzer_cell() {
  local url=127.0.0.1:18000 out="$LOG/paraw_${name}_${round}_$1_$2_$3.txt"
  [[ $1 == grpc ]] && url=127.0.0.1:18001
  LD_LIBRARY_PATH="$(dirname "$PA_BIN"):${LD_LIBRARY_PATH:-}" timeout -k 5 "$(cap 40)" "$PA_BIN" -m moe -u "$url" \
    -i "$1" -b "$2" --input-data "$PA_ROWS" --concurrency-range "$3:$3" --measurement-interval 2000 \
    --stability-percentage 1000 --max-trials 3 > "$out" 2>&1
  awk -v p="$1" -v t="$2" -v c="$3" '/Throughput:/ && !tp {tp=$2} /p50 latency:/ && !p50 {p50=$3} /p99 latency:/ && !p99 {p99=$3}
    END {printf "| pa_%s | %s | %s | %.0f | %.1f | %.1f |\n", p, t, c, tp, p50/1e3, p99/1e3}' "$out"
}

SERVER=
KEEPERS=
stop_keepers() { [[ -n "$KEEPERS" ]] && kill -9 -- -"$KEEPERS" 2>/dev/null; KEEPERS=; }
pack() { tar -czf "$DEST/serve_ab.tgz.tmp" -C "$LOG" . && mv "$DEST/serve_ab.tgz.tmp" "$DEST/serve_ab.tgz"; }
trap 'stop_server; stop_keepers; pack' EXIT

if (( ${DIRECT:-0} )) && (( $(left) > 40 )); then  # the layer alone at the served step (no server holds the GPU yet);
  # first, so that a budget spent by the rounds cannot skip the ratio's denominator (twenty-fourth session)
  PYTHONPATH="$ROOT:$SITE" timeout -k 5 "$(cap 90)" "$PY" -c '
import sys; sys.path.insert(0, "bench")
from serve_load import direct_tokens_per_s
from service.cli import parse_settings
s = parse_settings([]); device, _ = s.resolve_device(); cfg = s.layer_config(device)
assert cfg.R == 1, "the layer alone is R=1 here (bench/multigpu.py layer for R > 1)"
for n, d in direct_tokens_per_s(cfg, s.backend, s.seed, device, [cfg.tokens_per_step], 200).items():
    name, us, rate = d["backend"], d["s"] * 1e6, d["tok_s"]
    print(f"layer alone ({name}, {n} tokens a step): {us:,.0f} us = {rate:,.0f} tokens/s")
' 2>&1 | tee "$LOG/direct.txt" | tail -n 3
fi

profiled=0
for round in $(seq "${ROUNDS:-1}"); do
  for entry in "${TREE_LIST[@]}"; do
    tree=${entry%%:*}
    envs=()
    [[ "$entry" == *:* ]] && envs=("${entry#*:}")
    name=${entry//[.\/:=]/_}
    (( $(left) > 60 )) || { echo "round $round $tree: skipped, budget spent"; continue; }
    if [[ "${envs[*]}" == BENCH_KEEPERS=* ]]; then
      setsid "$PY" bench/wake_probe.py --keep-only "${envs[0]#BENCH_KEEPERS=}" > /dev/null 2>&1 &
      KEEPERS=$!
    fi
    (cd "$tree" && PYTHONPATH="$ROOT/$tree:$SITE" exec env "${envs[@]}" setsid "$PY" -m service --host 127.0.0.1 --http-port 18000 \
      --grpc-port 18001 > "$LOG/server_${name}_$round.txt" 2>&1) &
    SERVER=$!
    wait_ready 150
    echo "== round $round, tree $tree ($(cat "$tree/COMMIT" 2>/dev/null || echo "?")) ${envs[*]}: ready=$ready after $(( $(date +%s) - START )) s"
    grep -E "front-end process|Traceback|ERROR" "$LOG/server_${name}_$round.txt" | head -n 4
    if (( ready )); then
      sleep 2  # the other front ends confirm the group (older trees bind before they know it)
      if (( ${CHECK:-0} )) && (( round == 1 )); then
        PYTHONPATH="$ROOT:$SITE" timeout -k 5 "$(cap 120)" "$PY" bench/served_check.py --url http://127.0.0.1:18000 \
          --grpc 127.0.0.1:18001 > "$LOG/check_${name}.txt" 2>&1
        echo "served_check rc=$?"; grep -E "^FAIL" "$LOG/check_${name}.txt" | head -n 5; tail -n 2 "$LOG/check_${name}.txt"
      fi
      (( ${SPLIT:-0} )) && timeout 20 "$PY" bench/latency_split.py --url http://127.0.0.1:18000 \
        --save "$LOG/split_before_${name}_$round.json" > /dev/null 2>&1
      timeout -k 10 "$(cap 120)" "$PY" bench/serve_load.py --url http://127.0.0.1:18000 --grpc 127.0.0.1:18001 \
        --protocols "${PROTOCOLS:-v2_binary,grpc}" --sizes "${SIZES:-512}" --concurrency "${CONCURRENCY:-4,16}" \
        --seconds "$CELL_S" --wire-dtype bf16 --no-direct --spread --json "$LOG/load_${name}_$round.json" \
        > "$LOG/load_${name}_$round.txt" 2>&1
      echo "load rc=$?"; grep -E "^\|" "$LOG/load_${name}_$round.txt"
      if (( ${RAW:-0} )); then  # v2 binary at one client from a raw socket (one sendall, one recv_into): the server alone
        timeout -k 10 "$(cap 60)" "$PY" bench/serve_load.py --url http://127.0.0.1:18000 --grpc 127.0.0.1:18001 \
          --protocols v2_binary --client raw --sizes "${SIZES:-512}" --concurrency 1 --seconds "$CELL_S" \
          --wire-dtype bf16 --no-direct > "$LOG/raw_${name}_$round.txt" 2>&1
        grep -E "^\| v2" "$LOG/raw_${name}_$round.txt"
      fi
      if (( ${SPLIT:-0} )); then  # the server's own books over the whole load (every cell together)
        timeout 20 "$PY" bench/latency_split.py --url http://127.0.0.1:18000 \
          --before "$LOG/split_before_${name}_$round.json" > "$LOG/split_${name}_$round.txt" 2>&1
        grep -iE "receive|send|arrival|compute_(input|output)" "$LOG/split_${name}_$round.txt" | head -n 12
      fi
      if [[ "${PA_TREE:-}" == "$entry" ]]; then
        for pa_proto in ${PA_PROTOCOLS//,/ }; do
          for T in "${pa_sizes[@]}"; do
            for c in ${PA_CONC//,/ }; do
              (( $(left) > 45 )) && perf_analyzer_cell "$pa_proto" "$T" "$c" | tee -a "$LOG/pa_${name}_$round.txt"
            done
          done
        done
      fi
      if [[ "${PYSPY_TREE:-}" == "$entry" ]] && (( ! profiled )) && (( $(left) > 30 )); then
        profiled=1
        timeout -k 5 30 "$PY" bench/serve_load.py --url http://127.0.0.1:18000 --grpc 127.0.0.1:18001 \
          --protocols "${PYSPY_PROTOCOL:-v2_binary}" --sizes 512 --concurrency "${PYSPY_CONC:-16}" --seconds 12 \
          --wire-dtype bf16 --no-direct \
          > "$LOG/pyspy_load_$name.txt" 2>&1 &
        loadpid=$!
        sleep 4
        timeout -k 5 20 "$PYSPY" record --pid "$SERVER" --subprocesses --rate 200 --duration 5 --format raw \
          --output "$LOG/pyspy_$name.txt" --nonblocking > "$LOG/pyspy_log_$name.txt" 2>&1
        echo "py-spy rc=$?"
        top -b -n 1 -w 200 | head -n 40 > "$LOG/top_$name.txt"  # still under the load
        wait "$loadpid"; grep -E "^\|" "$LOG/pyspy_load_$name.txt"
      fi
    fi
    stop_server
    stop_keepers
  done
done
trap pack EXIT
echo "== summary: $(( $(date +%s) - START )) s"
for f in "$LOG"/load_*.txt "$LOG"/pa_*.txt; do [[ -f $f ]] && { echo "${f##*/}:"; grep -E "^\| (v2|grpc|pa_)" "$f"; }; done
