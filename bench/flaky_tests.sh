#!/usr/bin/env bash
# Run some tests again and again on a loaded CPU, the way a busy 2-core CI machine runs them:
# pinned to one core (the tests, their servers, ranks and clients all share it: half of what CI
# has) beside a `nice -n 5` CPU hog on that core (stress-ng: apt-get install stress-ng). Trees run
# interleaved, one pytest at a time, so that each sees the same load; a table at the end.
#
#   bench/flaky_tests.sh RUNS TREE [TREE...] -- PYTEST_ARGS...
#   e.g. git archive c2a7896 | tar -x -C /tmp/old
#        bench/flaky_tests.sh 5 /tmp/old . -- tests/api/test_overload.py
# Each tree runs its own `service` (PYTHONPATH=TREE). Logs: $LOG (default /tmp/flaky-tests).
set -uo pipefail

runs=$1
shift
trees=()
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
  trees+=("$(cd "$1" && pwd)")
  shift
done
shift  # the --
LOG=${LOG:-/tmp/flaky-tests}
mkdir -p "$LOG"
: > "$LOG/summary"

nice -n 5 taskset -c 0 stress-ng --cpu 1 --timeout 3600 >/dev/null 2>&1 &
hog=$!
trap 'kill "$hog" 2>/dev/null' EXIT

for i in $(seq 1 "$runs"); do
  for t in "${!trees[@]}"; do
    tree=${trees[$t]}
    log="$LOG/tree$t.run$i.log"
    (cd "$tree" && PYTHONPATH=$tree taskset -c 0 timeout 900 python -m pytest -q -p no:cacheprovider -rf "$@") \
      > "$log" 2>&1
    echo "tree$t run$i load=$(cut -d' ' -f1 /proc/loadavg) | $(tail -1 "$log") | $(grep '^FAILED' "$log" |
      cut -d' ' -f2 | tr '\n' ' ')" >> "$LOG/summary"
  done
done

for t in "${!trees[@]}"; do echo "tree$t = ${trees[$t]}"; done
cat "$LOG/summary"
