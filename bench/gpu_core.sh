#!/usr/bin/env bash
# Issue 12 on one GPU (H200), every step under `timeout`, the steps named in STEPS in that order
# (default all; a call of at most 300 s takes two or three of them):
#   tests    the GPU tests (-m gpu) of tests/kernels tests/moe (or of $TESTS): the regression run
#   profile  ncu --set full of GEMM1 and GEMM2 at the seed share (balanced), per variant:
#            the details page as text (not the raw report), $LOG/ncu_details.txt
#   core     bench/core.py at the seed share (dense matmul, GEMM1/GEMM2, serial and fused layers,
#            the anchor), per variant
#   service  the same at the service's weight-bound step (T=512, I=3072 on one GPU), balanced
#   tune     bench/tune_gemm.py --quick --dry-run at the seed share (prints, writes nothing)
#   pair     issue 12 third pass, the A/B of GemmConfig.pair (GEMM1 pair tiles): the pair GPU tests
#            (tests/kernels/test_pair_gpu.py, <= 60 s), then bench/core.py at the seed share, balanced
#            and skewed, pair off / GEMM1 only / both GEMMs (split + the configs' queue), 3 interleaved
#            rounds of 50 replays, no anchor rows (<= 90 s): GEMM1, GEMM2, serial and fused layers
#   cudatile issue 12c, the Hopper CUDA GEMM1 tile (csrc/gemm_sm90, GemmConfig.cuda_tile; bench/gpu_cuda_tile.sh
#            runs this step alone): csrc/build.py --arch 9.0 (the tile's ptxas line) and the tile's SASS
#            counts, tests/kernels/test_cuda_tile_gpu.py (<= 150 s), compute-sanitizer memcheck and
#            synccheck of one small case only if those failed (not on a hang), then bench/core.py at
#            the seed share, balanced and skewed, GEMM1 Triton vs CUDA tile (" cuda1") with split +
#            queue, 3 interleaved rounds of 50 replays, no anchor rows (<= 120 s; skipped after a hang)
#   cudatile2 issue 12t, the CUDA tile's mainloop variants (service.kernels.cuda_tile.VARIANTS; bench/gpu_cuda_tile2.sh
#            runs this step alone): csrc/build.py --arch 9.0 and the SASS counts per variant, the tile's GPU
#            tests in three pytest runs, each under its own timeout (base + n256 + the unparametrized
#            tests <= 90 s, noinc <= 45 s, mcast <= 45 s: a hang costs its own group's results only;
#            compute-sanitizer memcheck of the few-CTA case of the first variant whose own tile tests
#            failed, not hung), then $PACK (a checkpoint of what exists) if set,
#            bench/core.py at the seed share, balanced and skewed, GEMM1 Triton vs every variant that
#            passed (split + queue, 3 interleaved rounds of 50 replays, the dense matmul and the anchor
#            beside unless NO_ANCHOR=1), then bench/gpu_ncu_gemm1.sh (one ncu launch each, the table) when
#            > 80 s are left
# and a short table.
# Usage: ANCHORS=path/bench_anchors.py COMMIT=$(git rev-parse HEAD) [STEPS="profile core"] bash bench/gpu_core.sh
#        (PYTHON=...; OUT=dir; BUDGET=seconds for all steps; VARIANTS="--split on,off --queue off": the
#        GemmConfig switches bench/core.py times and profiles, LAUNCHES: kernels ncu profiles)
# The anchor script is not part of the project: pass its path (the GPU call copies it beside the tree).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${OUT:-build/gpu_core}
ANCHORS=${ANCHORS:?set ANCHORS to the path of bench_anchors.py}
BUDGET=${BUDGET:-280}
STEPS=${STEPS:-tests profile core service tune}
VARIANTS=${VARIANTS:---split on,off}
LAUNCHES=${LAUNCHES:-4}
mkdir -p "$LOG"
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }  # seconds left of the budget
cap() { local want=$1 l; l=$(left); (( l < want )) && want=$l; (( want < 1 )) && want=1; echo "$want"; }
declare -A RC

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | tee "$LOG/device.txt"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" | tee -a "$LOG/device.txt"
echo "commit ${COMMIT:-unknown: set COMMIT (the copy that travels has no .git)}; steps: $STEPS" | tee -a "$LOG/device.txt"

run_gpu_tests() {  # run_gpu_tests NAME SECONDS FILES...: the gpu-marked tests of FILES -> $LOG/NAME.txt, RC[NAME]
  local name=$1 want=$2
  shift 2
  timeout -k 5 "$(cap "$want")" "$PY" -m pytest -q -m gpu "$@" -p no:cacheprovider -rfE --durations=8 \
    > "$LOG/$name.txt" 2>&1
  RC[$name]=$?
  grep -E "^(FAILED|ERROR)" "$LOG/$name.txt" | head -n 20
  tail -n 3 "$LOG/$name.txt"
}

step_tests() {
  echo "== tests: GPU tests"
  # shellcheck disable=SC2086
  run_gpu_tests tests 200 ${TESTS:-tests/kernels tests/moe}
}

step_profile() {
  echo "== profile: ncu, GEMM1 and GEMM2 of each variant ($VARIANTS), balanced"
  timeout "$(cap 120)" ncu --set full --clock-control none -k regex:grouped_gemm --launch-count "$LAUNCHES" \
    -f -o /tmp/core_gemms "$PY" bench/core.py --anchors "$ANCHORS" --profile --routing balanced $VARIANTS \
    > "$LOG/ncu_run.txt" 2>&1
  RC[profile]=$?
  tail -n 8 "$LOG/ncu_run.txt"
  [[ -f /tmp/core_gemms.ncu-rep ]] && ncu --import /tmp/core_gemms.ncu-rep --page details > "$LOG/ncu_details.txt" 2>&1
  grep -E "grouped_gemm|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Hit Rate|Achieved Occupancy|DRAM Throughput" \
    "$LOG/ncu_details.txt" 2>/dev/null | head -n 40
}

step_core() {
  echo "== core: bench/core.py, seed share"
  timeout "$(cap ${CORE_S:-150})" "$PY" bench/core.py --anchors "$ANCHORS" --iters 100 $VARIANTS --json "$LOG/core.json" \
    > "$LOG/core.txt" 2>&1
  RC[core]=$?
  cat "$LOG/core.txt"
}

step_service() {
  (( $(left) > 45 )) || return 0
  echo "== service: T=512, I=3072, R=1 (weight-bound)"
  timeout "$(cap 60)" "$PY" bench/core.py --anchors "$ANCHORS" --tokens 512 --Ir 3072 --routing balanced --iters 30 $VARIANTS \
    --json "$LOG/service_step.json" > "$LOG/service_step.txt" 2>&1
  RC[service]=$?
  tail -n 12 "$LOG/service_step.txt"
}

step_pair() {
  echo "== pair: GPU tests of the pair tiles, then pair off / on at the seed share"
  run_gpu_tests tests_pair 60 tests/kernels/test_pair_gpu.py
  timeout "$(cap ${PAIR_S:-90})" "$PY" bench/core.py --anchors "$ANCHORS" --iters 50 --repeats 3 --split on \
    --pair ${PAIRS:-off,gemm1,on} --order queue --no-anchor --json "$LOG/core_pair.json" > "$LOG/core_pair.txt" 2>&1
  RC[pair_core]=$?
  cat "$LOG/core_pair.txt"
}

# The sm_90 build with the CUDA tile (RC[build]; its kernel's registers and spills printed), and its
# SASS in $LOG/gemm1_sm90.sass (false when cuobjdump or the object is missing).
build_tile() {
  timeout "$(cap 150)" "$PY" csrc/build.py --arch 9.0 > "$LOG/build.txt" 2>&1
  RC[build]=$?
  grep -E "gemm1_kernel|registers|spill|Potential|skipping|built|rror" "$LOG/build.txt" | head -n 12
}
tile_sass() {
  command -v cuobjdump > /dev/null && [[ -f build/moe_csrc/gemm1_sm90.o ]] || return 1
  cuobjdump --dump-sass build/moe_csrc/gemm1_sm90.o > "$LOG/gemm1_sm90.sass" 2>&1
  return 0
}

step_cudatile() {
  echo "== cudatile: build, the CUDA tile's GPU tests, GEMM1 Triton vs CUDA tile at the seed share"
  build_tile
  if tile_sass; then
    for op in HGMMA UTMALDG LDGSTS USETMAXREG WARPGROUP.DEPBAR STL LDL; do
      printf "%s=%s " "$op" "$(grep -c "$op" "$LOG/gemm1_sm90.sass")"
    done | tee -a "$LOG/build.txt"
    echo
  fi
  (( RC[build] == 0 )) || return 0
  run_gpu_tests tests_cudatile 150 tests/kernels/test_cuda_tile_gpu.py
  if (( RC[tests_cudatile] == 124 )); then
    echo "the tile's tests timed out (a hang?): no timing"
    return 0
  fi
  if (( RC[tests_cudatile] != 0 )) && command -v compute-sanitizer > /dev/null && (( $(left) > 100 )); then
    for tool in memcheck synccheck; do
      timeout "$(cap 40)" compute-sanitizer --tool "$tool" --print-limit 20 "$PY" -m pytest -q -x -m gpu \
        tests/kernels/test_cuda_tile_gpu.py -k few_ctas -p no:cacheprovider > "$LOG/sanitizer_$tool.txt" 2>&1
      RC[sanitizer_$tool]=$?
      grep -E "=========" "$LOG/sanitizer_$tool.txt" | head -n 12
    done
  fi
  # The vLLM anchor and the dense matmul beside our variants, in the same run (kernels changed).
  timeout "$(cap 160)" "$PY" bench/core.py --anchors "$ANCHORS" --iters 50 --repeats 3 --split on --order queue \
    --cuda-tile off,on --json "$LOG/core_cudatile.json" > "$LOG/core_cudatile.txt" 2>&1
  RC[cudatile_core]=$?
  cat "$LOG/core_cudatile.txt"
}

step_cudatile2() {
  echo "== cudatile2: build, each mainloop variant's GPU tests, GEMM1 Triton vs every variant, ncu"
  build_tile
  (( RC[build] == 0 )) || return 0
  local variants v passed=off
  variants=$("$PY" -c "from service.kernels.cuda_tile import VARIANTS; print(' '.join(VARIANTS))")
  if tile_sass; then
    # Per kernel instance (gemm1_kernel<0>, <1>, ...: the variants in VARIANTS order).
    awk '/Function :/ {f = $3} {for (i = 1; i <= NF; i++) if ($i ~ /^(HGMMA|UTMALDG|LDGSTS|ARRIVES|DEPBAR|WARPGROUP|STL|LDL)/) {
           split($i, b, "."); n[f " " b[1] "." b[2]]++; break}} END {for (k in n) print k, n[k]}' "$LOG/gemm1_sm90.sass" \
      | sed -E 's/^\S*gemm1_kernelILi([0-9])E\S*/variant \1/' | sort | tee -a "$LOG/build.txt"
  fi
  # Three pytest runs, each under its own timeout: base and n256 (the unparametrized tests with
  # them, counted as base's), then noinc and mcast alone (the two new arrival protocols), so that
  # a hang (rc 124) costs its own group's results only. A variant passed when its group passed, or
  # failed only in tests of other variants (ids end "-<variant>]" or are "[<variant>]").
  local group name got own tile sanitized=""
  for group in main noinc mcast; do
    name=tests_$group
    case $group in
      main) run_gpu_tests "$name" 90 tests/kernels/test_cuda_tile_gpu.py -k "not (noinc or mcast)" ;;
      *) run_gpu_tests "$name" 45 tests/kernels/test_cuda_tile_gpu.py -k "$group" ;;
    esac
    got=${RC[$name]}
    (( got == 124 || got == 137 )) && echo "$name timed out (a hang?): its variants are not timed"
    for v in $variants; do
      [[ $group == main && ( $v == noinc || $v == mcast ) || $group != main && $v != "$group" ]] && continue
      tile="[-[]$v\]"  # the variant's own tile tests
      own=$tile
      [[ $v == base ]] && own+="|serial_layer|refusals"
      if (( got == 0 )) || { (( got == 1 )) && ! grep -E "^(FAILED|ERROR)" "$LOG/$name.txt" | grep -qE "$own"; }; then
        passed+=",$([[ $v == base ]] && echo on || echo "$v")"
      elif [[ -z $sanitized ]] && (( got == 1 )) && grep -E "^(FAILED|ERROR)" "$LOG/$name.txt" | grep -qE "$tile" \
           && command -v compute-sanitizer > /dev/null && (( $(left) > 150 )); then
        # memcheck of the small few-CTA case of the first variant whose own tile tests failed (not hung).
        sanitized=$v
        timeout -k 5 "$(cap 40)" compute-sanitizer --tool memcheck --print-limit 20 "$PY" -m pytest -q -x -m gpu \
          tests/kernels/test_cuda_tile_gpu.py -k "few_ctas and $v" -p no:cacheprovider > "$LOG/sanitizer_${v}_memcheck.txt" 2>&1
        RC[sanitizer_$v]=$?
        grep -E "=========" "$LOG/sanitizer_${v}_memcheck.txt" | head -n 12
      fi
    done
  done
  echo "timed: $passed (off = the Triton tile, on = the CUDA tile's base mainloop)" | tee "$LOG/timed.txt"
  [[ -n ${PACK:-} ]] && $PACK  # what exists so far comes back even if a later step runs past the call
  timeout -k 5 "$(cap 100)" "$PY" bench/core.py --anchors "$ANCHORS" --iters 50 --repeats 3 --split on --order queue \
    --cuda-tile "$passed" ${NO_ANCHOR:+--no-anchor} --json "$LOG/core_cudatile2.json" > "$LOG/core_cudatile2.txt" 2>&1
  RC[cudatile2_core]=$?
  cat "$LOG/core_cudatile2.txt"
  (( $(left) > 80 )) || { echo "no time left for ncu"; return 0; }
  # ncu's own limit 25 s inside the outer one: the imports and the table after the profile still run.
  local outer
  outer=$(cap 130)
  LOG=$LOG/ncu TAR=none VARIANTS=$passed NCU_S=$(( outer - 25 )) timeout -k 5 "$outer" bash bench/gpu_ncu_gemm1.sh
  RC[ncu]=$?
}

step_tune() {
  (( $(left) > 30 )) || return 0
  echo "== tune: bench/tune_gemm.py --quick --dry-run, seed share"
  timeout "$(cap 120)" "$PY" bench/tune_gemm.py --quick --dry-run > "$LOG/tune.txt" 2>&1
  RC[tune]=$?
  grep -E "us .*TFLOP/s|best" "$LOG/tune.txt"
}

for step in $STEPS; do "step_$step"; done

echo
echo "================ summary ($(( $(date +%s) - START )) s) ================"
for step in "${!RC[@]}"; do printf '%-10s rc=%s\n' "$step" "${RC[$step]}"; done
[[ -f "$LOG/tests.txt" ]] && grep -E '(passed|failed|error)' "$LOG/tests.txt" | tail -n 1
[[ -f "$LOG/core.txt" ]] && grep -A8 "^| routing" "$LOG/core.txt"
[[ -f "$LOG/tests_pair.txt" ]] && grep -E '(passed|failed|error)' "$LOG/tests_pair.txt" | tail -n 1
[[ -f "$LOG/core_pair.txt" ]] && grep -A8 "^| routing" "$LOG/core_pair.txt"
[[ -f "$LOG/tests_cudatile.txt" ]] && grep -E '(passed|failed|error)' "$LOG/tests_cudatile.txt" | tail -n 1
[[ -f "$LOG/core_cudatile.txt" ]] && grep -E "^  (dense|gemm1)" "$LOG/core_cudatile.txt" && \
  grep -A8 "^| routing" "$LOG/core_cudatile.txt"
for f in "$LOG/tests_main.txt" "$LOG/tests_noinc.txt" "$LOG/tests_mcast.txt"; do
  [[ -f "$f" ]] && echo "$(basename "$f" .txt): $(grep -E '(passed|failed|error)' "$f" | tail -n 1)"
done
[[ -f "$LOG/timed.txt" ]] && cat "$LOG/timed.txt"
[[ -f "$LOG/core_cudatile2.txt" ]] && grep -E "^  (dense|gemm1|anchor|serial)" "$LOG/core_cudatile2.txt"
[[ -f "$LOG/ncu/ncu_table.txt" ]] && grep "^|" "$LOG/ncu/ncu_table.txt"
for step in "${!RC[@]}"; do [[ "${RC[$step]}" == 0 ]] || exit 1; done
