#!/usr/bin/env bash
# Nsight Compute stall sampling of the persistent decode kernel (GPU machine):
#   source .deps/tools/env.sh && BIN_DIR=dir bash scripts/gpu-qwen-mega-ncu.sh [preset]
# Profiles one eager decode step's mega_kernel, then prints the warp-state summary and the SASS
# instructions with the most stall samples (research/qwen/scripts/ncu-source-top.py); with a binary built with
# -lineinfo (QWEN_BIN=path), also the CUDA source lines with the most.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
bin=${BIN_DIR:-build-gpu-qwen/examples/qwen}
qwen=${QWEN_BIN:-$bin/qwen}
preset=${1:-qwen3-0.6b}
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"
rep="$out/mega_$preset"
timeout 400 /usr/local/cuda/bin/ncu --kernel-name "regex:mega_kernel" --launch-skip ${NCU_SKIP:-8} --launch-count 1 \
  --section WarpStateStats --section SourceCounters --section SchedulerStats --import-source yes -f -o "$rep" \
  "$qwen" --preset "$preset" --random-prompt 16 --gen 16 --kv-mem-mb 1024 --max-context 256 --kernels mega \
  --mode eager --quiet >"$out/ncu_run_$preset.log" 2>&1
echo "ncu exit $?"
/usr/local/cuda/bin/ncu -i "$rep.ncu-rep" --page details >"$out/ncu_details_$preset.txt" 2>&1
grep -E "Duration|Stall|Issued|Eligible|Active Warps|No Eligible|One or More" "$out/ncu_details_$preset.txt" | head -40
/usr/local/cuda/bin/ncu -i "$rep.ncu-rep" --page source --csv --print-source sass >"$out/ncu_src_$preset.csv" 2>&1
python3 research/qwen/scripts/ncu-source-top.py "$out/ncu_src_$preset.csv" ${NCU_TOP:-45}
/usr/local/cuda/bin/ncu -i "$rep.ncu-rep" --page source --csv --print-source cuda >"$out/ncu_cuda_$preset.csv" 2>&1
python3 research/qwen/scripts/ncu-source-top.py "$out/ncu_cuda_$preset.csv" ${NCU_TOP:-45}
