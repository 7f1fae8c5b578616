#!/usr/bin/env bash
# Issue 12c on one H200 in one call (<= ~5 device minutes with the start): the Hopper CUDA GEMM1 tile
# built, its GPU tests, then GEMM1 Triton vs CUDA tile vs the dense matmul at the seed share: the
# `cudatile` step of bench/gpu_core.sh (which says what it runs), alone, with a 360 s budget.
# Usage (repository root of the device machine, web wheels installed; bench/NOTES.md "Issue 12c"):
#   ANCHORS=.anchors/bench_anchors.py COMMIT=<commit> [OUT=dir] bash bench/gpu_cuda_tile.sh
STEPS=cudatile BUDGET=${BUDGET:-360} OUT=${OUT:-build/gpu_cuda_tile} exec bash "$(dirname "$0")/gpu_core.sh"
