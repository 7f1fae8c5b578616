#!/usr/bin/env bash
# Two (or more) checkouts' front ends at one client, as timelines (bench/frontend_timeline.py on the
# stand-in group), alternated round by round: did a change of the front end's path move a gap?
#   TREES="/tmp/base ." ROUNDS=4 bash bench/timeline_ab.sh
# Per round and tree: the server's timeline (this checkout's bench/frontend_timeline.py, serving the tree's
# `service`) under bench/serve_load.py --concurrency 1 (PROTOCOLS, SIZES, CELL_S s per cell), its client
# lines, then per gap the p50 of every round side by side. A tree is a directory holding a checkout
# (e.g. `git archive <commit> | tar -x -C /tmp/base`). Knobs: STEP_MS (1.4), PY (python), PORT (18730).
set -euo pipefail
read -ra TREE_LIST <<<"${TREES:-.}"
ROUNDS=${ROUNDS:-3}; PROTOCOLS=${PROTOCOLS:-v2_binary,grpc}; SIZES=${SIZES:-512}; CELL_S=${CELL_S:-4}
STEP_MS=${STEP_MS:-1.4}; PY=${PY:-python}; PORT=${PORT:-18730}
LAYER=(--preset seed --world-size 1 --device cpu)
here=$(cd "$(dirname "$0")" && pwd); root=$(dirname "$here"); tmp=$(mktemp -d); server=
trap '[ -n "$server" ] && kill "$server" 2>/dev/null; rm -rf "$tmp"' EXIT
for r in $(seq "$ROUNDS"); do
  for t in "${!TREE_LIST[@]}"; do
    tree=$(cd "${TREE_LIST[$t]}" && pwd)
    (cd "$tree" && exec env PYTHONPATH="$tree:$here" MOE_WIRE_ARENA_MIB="${MOE_WIRE_ARENA_MIB:-256}" "$PY" \
      "$here/frontend_timeline.py" --out "$tmp/tl_${t}_$r.txt" --standin-step-ms "$STEP_MS" "${LAYER[@]}" \
      --http-port "$PORT" --grpc-port $((PORT + 1)) --log-level WARNING >"$tmp/server_${t}_$r.log" 2>&1) &
    server=$!
    for _ in $(seq 120); do
      "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/v2/health/ready', timeout=2)" \
        2>/dev/null && break
      sleep 0.5
    done
    PYTHONPATH="$root" "$PY" "$here/serve_load.py" --url "http://127.0.0.1:$PORT" --grpc "127.0.0.1:$((PORT + 1))" \
      "${LAYER[@]}" --protocols "$PROTOCOLS" --sizes "$SIZES" --concurrency 1 --seconds "$CELL_S" \
      --wire-dtype bf16 --no-direct 2>&1 | grep -E "^\| (v2|grpc)" | sed "s|^|tree $t round $r |"
    kill -TERM "$server"; wait "$server" || true; server=
  done
done
"$PY" - "$tmp" "${#TREE_LIST[@]}" "$ROUNDS" <<'EOF'
import re, sys
tmp, trees, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
p50 = {}  # (protocol, gap) -> {tree: [p50 per round]}
for t in range(trees):
    for r in range(1, rounds + 1):
        protocol = None
        for line in open(f"{tmp}/tl_{t}_{r}.txt"):
            m = re.match(r"## (\S+):", line)
            if m:
                protocol = m.group(1)
            m = re.match(r"\| (.+?) \| ([\d.]+) \| ([\d.]+) \|", line)
            if m and protocol:
                p50.setdefault((protocol, m.group(1)), {}).setdefault(t, []).append(m.group(3))
print("| protocol | gap | " + " | ".join(f"tree {t} p50 ms, rounds 1-{rounds}" for t in range(trees)) + " |")
print("|---|---|" + "---|" * trees)
for (protocol, gap), per in p50.items():
    print(f"| {protocol} | {gap} | " + " | ".join(", ".join(per.get(t, [])) for t in range(trees)) + " |")
EOF
