#!/usr/bin/env bash
# Issue 12t on one H200 in one call (<= ~5 device minutes with the start): the CUDA GEMM1 tile's mainloop variants
# (service.kernels.cuda_tile.VARIANTS) built, each one's GPU tests, GEMM1 Triton vs every variant that
# passed with the dense matmul and the vLLM anchor beside, then ncu of one launch each: the
# `cudatile2` step of bench/gpu_core.sh (which says what it runs), alone, BUDGET 300 s; everything
# packed into ONE file, $OUT/cuda_tile2.tgz (the summary table is printed last).
# Usage (repository root of the device machine, web wheels installed; bench/NOTES.md "Issue 12t"):
#   ANCHORS=.anchors/bench_anchors.py COMMIT=<commit> OUT=$OUT [NO_ANCHOR=1] bash bench/gpu_cuda_tile2.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
LOG=${LOG:-build/gpu_cuda_tile2}
mkdir -p "$LOG"
STEPS=cudatile2 BUDGET=${BUDGET:-300} OUT=$LOG bash "$(dirname "$0")/gpu_core.sh" 2>&1 | tee "$LOG.txt"
rc=${PIPESTATUS[0]}
mv "$LOG.txt" "$LOG/console.txt"
if [[ -n "${OUT:-}" ]]; then
  tar -czf "$OUT/cuda_tile2.tgz" -C "$LOG" .
  # One file back may be at most 16 MiB: without the ncu report (the table and CSVs stay) if larger.
  (( $(stat -c %s "$OUT/cuda_tile2.tgz") < 16000000 )) || tar -czf "$OUT/cuda_tile2.tgz" --exclude='*.ncu-rep' -C "$LOG" .
  echo "packed $OUT/cuda_tile2.tgz ($(stat -c %s "$OUT/cuda_tile2.tgz") bytes)"
fi
exit "$rc"
