#!/usr/bin/env bash
# Issue 12t on one H200 in one call (run's timeout_s 360; ~6 device minutes with the cold start): the
# CUDA GEMM1 tile's mainloop variants (service.kernels.cuda_tile.VARIANTS) built, each one's GPU tests,
# GEMM1 Triton vs every variant that passed with the dense matmul and the vLLM anchor beside, then ncu
# of one launch each: the `cudatile2` step of bench/gpu_core.sh (which says what it runs), alone,
# BUDGET 245 s for the steps (the wheels' install, the tar and the start come on top). Everything is
# packed into ONE file, $OUT/cuda_tile2.tgz: once after the tests (so that a call killed in the timing
# or ncu still brings the build, tests and sanitizer logs back), then again at the end, replacing it
# (the summary table is printed last).
# Usage (repository root of the device machine, web wheels installed; bench/NOTES.md "Issue 12t"):
#   ANCHORS=.anchors/bench_anchors.py COMMIT=<commit> OUT=$OUT [NO_ANCHOR=1] bash bench/gpu_cuda_tile2.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

pack() {  # pack LOG TGZ: LOG's files into TGZ, replacing it (one file back may be at most 16 MiB:
          # without the ncu report, the table and CSVs kept, when larger)
  local log=$1 tgz=$2
  tar -czf "$tgz.tmp" --warning=no-file-changed -C "$log" .
  (( $(stat -c %s "$tgz.tmp") < 16000000 )) || tar -czf "$tgz.tmp" --warning=no-file-changed --exclude='*.ncu-rep' -C "$log" .
  mv -f "$tgz.tmp" "$tgz"
  echo "packed $tgz ($(stat -c %s "$tgz") bytes)"
}
if [[ ${1:-} == --pack ]]; then pack "$2" "$3"; exit; fi  # gpu_core.sh's checkpoint ($PACK)

LOG=${LOG:-build/gpu_cuda_tile2}
TGZ=${OUT:+$OUT/cuda_tile2.tgz}
mkdir -p "$LOG"
STEPS=cudatile2 BUDGET=${BUDGET:-245} OUT=$LOG PACK=${TGZ:+bash bench/gpu_cuda_tile2.sh --pack $LOG $TGZ} \
  bash bench/gpu_core.sh 2>&1 | tee "$LOG/console.txt"
rc=${PIPESTATUS[0]}
[[ -n $TGZ ]] && pack "$LOG" "$TGZ"
exit "$rc"
