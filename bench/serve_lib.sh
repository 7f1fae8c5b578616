# Shell helpers of the bench scripts that start a server on the device machine (sourced by
# bench/gpu_serve.sh and bench/gpu_serve_ab.sh). Expects START (the script's start, date +%s) and
# BUDGET (its cap in s); the server's pid goes in SERVER.

left() { echo $(( BUDGET - ($(date +%s) - START) )); }  # seconds left of BUDGET
cap() { local want=$1 l; l=$(left); (( l < want )) && want=$l; (( want < 1 )) && want=1; echo "$want"; }

# wait_ready SECONDS: poll the server's readiness once a second, at most SECONDS (and never past
# BUDGET) or until $SERVER exits; sets ready=1 when it answered 200.
wait_ready() {
  ready=0
  for _ in $(seq "$(cap "$1")"); do
    if curl -sf -o /dev/null http://127.0.0.1:18000/v2/health/ready; then ready=1; return; fi
    kill -0 "$SERVER" 2>/dev/null || return
    sleep 1
  done
}

# stop_server: SIGTERM (it drains and stops), up to 30 s, then SIGKILL to its process group.
stop_server() {
  [[ -n "${SERVER:-}" ]] || return
  kill -TERM "$SERVER" 2>/dev/null
  for _ in $(seq 60); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$SERVER" 2>/dev/null
  SERVER=
}
