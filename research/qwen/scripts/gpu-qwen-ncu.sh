#!/usr/bin/env bash
# Nsight Compute profile of a few decode-step GEMV kernels of the qwen example (GPU machine):
#   source .deps/tools/env.sh && BIN_DIR=dir bash scripts/gpu-qwen-ncu.sh [preset] [kernels...]
# Writes $OUT/ncu_<preset>_<kernels>.txt: duration, DRAM throughput, warp stall reasons per kernel.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
bin=${BIN_DIR:-build-gpu-qwen/examples/qwen}
preset=${1:-qwen3-4b}; shift || true
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"
for k in ${*:-rowpipe legacy}; do
  f="$out/ncu_${preset}_$k.txt"
  timeout 240 /usr/local/cuda/bin/ncu --kernel-name "regex:gemv" --launch-skip ${NCU_SKIP:-150} --launch-count ${NCU_COUNT:-5} \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
    --section Occupancy --section SchedulerStats \
    "$bin/qwen" --preset "$preset" --random-prompt 8 --gen 4 --kv-mem-mb 512 --max-context 64 --kernels "$k" \
    --mode eager --quiet >"$f" 2>&1
  echo "== $k: $(grep -cE 'gemv' "$f") lines mentioning gemv"
  grep -E "gemv.*kernel|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Stall|Registers Per|Block Size|Grid Size|One or More|No Eligible|Dynamic Shared" "$f" | head -${NCU_LINES:-120}
done
