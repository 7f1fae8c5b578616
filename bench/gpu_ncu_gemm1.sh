#!/usr/bin/env bash
# Issue 12t: ncu of ONE launch each of the Triton GEMM1 tile and every CUDA tile mainloop variant at
# the seed share (balanced; bench/core.py --profile --gemm1-only, split + queue as the CUDA tile runs),
# <= ~2 device minutes, and a side-by-side table (bench/ncu_gemm1.py): duration, tensor pipe %, SM and
# L2 throughput, DRAM GB/s, L2 hit %, occupancy, the top stall reasons, then the SASS lines with the
# most stall samples per kernel (which separates the consumer warps' waits from the producer's).
# Sections: SpeedOfLight ComputeWorkloadAnalysis MemoryWorkloadAnalysis WarpStateStats SchedulerStats
# Occupancy SourceCounters, plus the tensor-pipe / L2 / DRAM metrics below that this ncu knows.
# Usage (repository root of the device machine, web wheels installed, csrc/build.py run or not):
#   ANCHORS=.anchors/bench_anchors.py [LOG=dir] [TAR=$OUT/ncu_gemm1.tgz] bash bench/gpu_ncu_gemm1.sh
# Standalone it builds the library when the tile's op is missing, and packs $LOG into $TAR (default
# $OUT/ncu_gemm1.tgz when OUT is set); bench/gpu_cuda_tile2.sh runs it as a step with TAR=none.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
ANCHORS=${ANCHORS:?set ANCHORS to the path of bench_anchors.py}
LOG=${LOG:-build/ncu_gemm1}
TAR=${TAR:-${OUT:+$OUT/ncu_gemm1.tgz}}
NCU_S=${NCU_S:-100}
VARIANTS=${VARIANTS:-off,on,n256,noinc,mcast}  # bench/core.py --cuda-tile: Triton, then each mainloop
mkdir -p "$LOG"
rc=0
if ! "$PY" -c "import torch; from service.kernels.schedule import load; load(); assert hasattr(torch.ops.moe, 'gemm1_swiglu_sm90')" 2>/dev/null; then
  timeout 150 "$PY" csrc/build.py --arch 9.0 > "$LOG/build.txt" 2>&1 || rc=$?
  grep -E "registers|spill|built|rror" "$LOG/build.txt" | head -n 8
fi
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
if [[ -z "$NCU" ]]; then
  echo "no ncu on this machine" | tee "$LOG/ncu_run.txt"
  rc=1
else
  "$NCU" --version | tail -n 1 | tee "$LOG/ncu_version.txt"
  # Only the metrics this ncu knows for this chip (an unknown name would abort the whole profile).
  "$NCU" --query-metrics --chip gh100 > "$LOG/ncu_metrics_gh100.txt" 2>&1
  METRICS=""
  for m in sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active \
           sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
           sm__inst_executed_pipe_tensor_op_gmma.sum sm__inst_executed_pipe_tensor_op_hmma.sum \
           lts__throughput.avg.pct_of_peak_sustained_elapsed lts__t_sector_hit_rate.pct \
           dram__bytes_read.sum dram__bytes_read.sum.per_second l1tex__m_xbar2l1tex_read_bytes.sum; do
    grep -q "^${m%%.*} " "$LOG/ncu_metrics_gh100.txt" && METRICS+="${METRICS:+,}$m"
  done
  echo "extra metrics: ${METRICS:-none found}" | tee -a "$LOG/ncu_version.txt"
  SECTIONS=()
  for s in SpeedOfLight ComputeWorkloadAnalysis MemoryWorkloadAnalysis WarpStateStats SchedulerStats Occupancy \
           SourceCounters LaunchStats; do SECTIONS+=(--section "$s"); done
  N=$(( $(tr ',' '\n' <<< "$VARIANTS" | wc -l) ))
  timeout -k 5 "$NCU_S" "$NCU" --target-processes all --clock-control none -k 'regex:gemm1_kernel|_grouped_gemm_kernel' \
    -c "$N" "${SECTIONS[@]}" ${METRICS:+--metrics "$METRICS"} -f -o /tmp/ncu_gemm1 \
    "$PY" bench/core.py --anchors "$ANCHORS" --profile --gemm1-only --routing balanced --split on --order queue \
    --cuda-tile "$VARIANTS" > "$LOG/ncu_run.txt" 2>&1 || rc=$?
  tail -n 6 "$LOG/ncu_run.txt"
  if [[ -f /tmp/ncu_gemm1.ncu-rep ]]; then
    # The report itself only when small: one file of the call's tar may be at most 16 MiB.
    if (( $(stat -c %s /tmp/ncu_gemm1.ncu-rep) < 8000000 )); then cp /tmp/ncu_gemm1.ncu-rep "$LOG/"
    else echo "ncu_gemm1.ncu-rep is $(stat -c %s /tmp/ncu_gemm1.ncu-rep) bytes: left out of the tar"; fi
    "$NCU" --import /tmp/ncu_gemm1.ncu-rep --page raw --csv > "$LOG/ncu_raw.csv" 2>&1
    "$NCU" --import /tmp/ncu_gemm1.ncu-rep --page details > "$LOG/ncu_details.txt" 2>&1
    "$NCU" --import /tmp/ncu_gemm1.ncu-rep --page source --csv --print-source sass > "$LOG/ncu_source.csv" 2>&1
    "$PY" bench/ncu_gemm1.py "$LOG/ncu_raw.csv" "$LOG/ncu_source.csv" 2>&1 | tee "$LOG/ncu_table.txt"
  fi
fi
if [[ -n "$TAR" && "$TAR" != none ]]; then tar -czf "$TAR" -C "$LOG" . && echo "packed $TAR"; fi
exit "$rc"
