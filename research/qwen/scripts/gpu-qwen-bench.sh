#!/usr/bin/env bash
# The full --bench of the qwen CLI (batch 1 eager and graph with the D2D and read floors, batched
# tokens/s at 1, 8, 32 and 64, padding waste, memory) for both shapes, with the build carried as
# build-carry/qx/qwen.xz (scripts/gpu-qwen-carried.sh says how). On the GPU machine, after
# `source .deps/tools/env.sh`:  OUT=$OUT bash scripts/gpu-qwen-bench.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"
d=${UNPACK:-/tmp/qbench}; mkdir -p "$d"
xz -dc "${CARRY_DIR:-build-carry/qx}/qwen.xz" > "$d/qwen" && chmod +x "$d/qwen"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for shape in qwen3-0.6b qwen3-4b; do
  kv=4096; [ "$shape" = qwen3-4b ] && kv=8192
  timeout 300 "$d/qwen" --preset "$shape" --bench --random-prompt 16 --gen 128 --kv-mem-mb $kv \
    --json "$out/bench_$shape.json" >"$out/bench_$shape.log" 2>&1
  echo "== $shape exit $?"; grep -vE '^\s*$' "$out/bench_$shape.log" | grep -vE '^(#|decode kernels)' | head -60
done
