#!/usr/bin/env bash
# Issue 12c on one H200 in one call (<= ~5 device minutes with the start): the Hopper CUDA GEMM1 tile
# (csrc/gemm_sm90, GemmConfig.cuda_tile) built, checked, then timed against the Triton GEMM1 and the
# dense matmul of the same FLOPs. Every step under `timeout`; a short table at the end.
#   build  python3 csrc/build.py --arch 9.0 (the tile's ptxas line: registers, spills) and the SASS
#          counts of the tile (HGMMA, UTMALDG, LDGSTS, USETMAXREG: what it must contain)
#   tests  tests/kernels/test_cuda_tile_gpu.py (the tile against the fp32 reference and the Triton
#          tile, poisoned output, routings, graph, the serial layer with the tile)
#   sanit  only when tests failed (not on a hang): compute-sanitizer memcheck and synccheck of one
#          small case, for the next session's diagnosis
#   core   bench/core.py at the seed share: dense matmul, GEMM1 Triton vs CUDA tile (" cuda1"), GEMM2,
#          the serial layer with each GEMM1 (and the fused layer with the Triton tile), balanced and
#          skewed, split_tail + queue (the tuned configs), 3 interleaved rounds of 50 graph replays,
#          no anchor rows; skipped when the tests hung (a hung tile would eat the call)
# Usage (repository root of the device machine, web wheels installed, see bench/NOTES.md "Issue 12c"):
#   ANCHORS=.anchors/bench_anchors.py COMMIT=<commit> [OUT=dir] [BUDGET=290] bash bench/gpu_cuda_tile.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
LOG=${OUT:-build/gpu_cuda_tile}
ANCHORS=${ANCHORS:?set ANCHORS to the path of bench_anchors.py}
BUDGET=${BUDGET:-290}
mkdir -p "$LOG"
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
cap() { local want=$1 l; l=$(left); (( l < want )) && want=$l; (( want < 1 )) && want=1; echo "$want"; }
declare -A RC

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | tee "$LOG/device.txt"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
  | tee -a "$LOG/device.txt"
echo "commit ${COMMIT:-unknown: set COMMIT (the copy that travels has no .git)}" | tee -a "$LOG/device.txt"

echo "== build: csrc/build.py --arch 9.0"
timeout "$(cap 150)" "$PY" csrc/build.py --arch 9.0 > "$LOG/build.txt" 2>&1
RC[build]=$?
grep -E "gemm1_kernel|registers|spill|Potential|skipping|built|rror" "$LOG/build.txt" | head -n 12
if command -v cuobjdump > /dev/null && [[ -f build/moe_csrc/gemm1_sm90.o ]]; then
  cuobjdump --dump-sass build/moe_csrc/gemm1_sm90.o > /tmp/gemm1_sm90.sass 2>&1
  for op in HGMMA UTMALDG LDGSTS USETMAXREG WARPGROUP.DEPBAR STL LDL; do
    printf "%s=%s " "$op" "$(grep -c "$op" /tmp/gemm1_sm90.sass)"
  done | tee -a "$LOG/build.txt"
  echo
fi

if (( RC[build] == 0 )); then
  echo "== tests: tests/kernels/test_cuda_tile_gpu.py"
  timeout "$(cap 120)" "$PY" -m pytest -q -m gpu tests/kernels/test_cuda_tile_gpu.py -p no:cacheprovider -rfE \
    --durations=6 > "$LOG/tests.txt" 2>&1
  RC[tests]=$?
  grep -E "^(FAILED|ERROR)" "$LOG/tests.txt" | head -n 20
  tail -n 3 "$LOG/tests.txt"
  if (( RC[tests] != 0 && RC[tests] != 124 )) && command -v compute-sanitizer > /dev/null && (( $(left) > 100 )); then
    echo "== sanit: compute-sanitizer on one small case"
    for tool in memcheck synccheck; do
      timeout "$(cap 40)" compute-sanitizer --tool "$tool" --print-limit 20 "$PY" -m pytest -q -x -m gpu \
        tests/kernels/test_cuda_tile_gpu.py -k few_ctas -p no:cacheprovider > "$LOG/sanitizer_$tool.txt" 2>&1
      RC[sanit_$tool]=$?
      grep -E "=========" "$LOG/sanitizer_$tool.txt" | head -n 12
    done
  fi
fi

if (( RC[build] == 0 )) && [[ "${RC[tests]:-1}" != 124 ]]; then
  echo "== core: bench/core.py, seed share, GEMM1 Triton vs CUDA tile"
  timeout "$(cap 120)" "$PY" bench/core.py --anchors "$ANCHORS" --split on --order queue --cuda-tile off,on \
    --routing balanced,skewed --repeats 3 --iters 50 --no-anchor --json "$LOG/core.json" > "$LOG/core.txt" 2>&1
  RC[core]=$?
  grep -E "!!|rel err|^\|" "$LOG/core.txt" | head -n 40
fi

echo "== table (us, TFLOP/s over the real hits; median of rounds [spread])"
if [[ -f "$LOG/core.json" ]]; then
  "$PY" - "$LOG/core.json" <<'EOF'
import json, sys
data = json.load(open(sys.argv[1]))
rows = {(r["name"], r["routing"]): r for r in data["rows"] if r.get("us")}
dense = data["dense_us"]
print(f"dense mm of the same FLOPs: {dense:.1f} us")
print("| routing | GEMM1 Triton | GEMM1 CUDA tile | tile / Triton | serial (Triton GEMM1) | serial (CUDA GEMM1) | GEMM2 |")
print("|---|---|---|---|---|---|---|")
fmt = lambda r: f"{r['us']:.1f} ({r['tflops']:.0f})" if r and r.get("tflops") else (f"{r['us']:.1f}" if r else "-")
for routing in ("balanced", "skewed"):
    t, c = rows.get(("gemm1+swiglu", routing)), rows.get(("gemm1+swiglu cuda1", routing))
    s, sc = rows.get(("serial layer (graph)", routing)), rows.get(("serial layer (graph) cuda1", routing))
    ratio = f"{c['us'] / t['us']:.3f}" if t and c else "-"
    print(f"| {routing} | {fmt(t)} | {fmt(c)} | {ratio} | {fmt(s)} | {fmt(sc)} | {fmt(rows.get(('gemm2', routing)))} |")
for r in data["rows"]:
    if not r.get("us"):
        print("failed row:", r["name"], r["routing"], r.get("error", "")[:200])
EOF
fi
echo "rc: $(for k in "${!RC[@]}"; do printf "%s=%s " "$k" "${RC[$k]}"; done)"
