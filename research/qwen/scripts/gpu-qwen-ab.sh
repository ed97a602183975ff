#!/usr/bin/env bash
# Batch-1 (and optionally 2/4) bench of decode-kernel variants, alternating processes, on the GPU
# machine (from the repo root, after `source .deps/tools/env.sh`):
#   BIN_DIR=dir KERNELS="ring rowpipe" ROUNDS=2 BATCHES=1 SHAPES="qwen3-0.6b qwen3-4b" bash scripts/gpu-qwen-ab.sh
# Prints one line per run: shape, kernels, eager and graph TPOT, and the floors of the same process.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"
bin=${BIN_DIR:-build-gpu-qwen/examples/qwen}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for shape in ${SHAPES:-qwen3-0.6b qwen3-4b}; do
    kv=4096; [ "$shape" = qwen3-4b ] && kv=8192
    for k in ${KERNELS:-ring rowpipe}; do
      j="$out/ab_${shape}_${k}_${round}.json"
      timeout 150 "$bin/qwen" --preset "$shape" --bench --random-prompt 16 --gen 128 --bench-batches "${BATCHES:-1}" \
        --kv-mem-mb $kv --kernels "$k" --json "$j" >"$out/ab_${shape}_${k}_${round}.log" 2>&1
      echo "round $round $shape $k exit $? $(grep -E '^\| (eager|graph) ' "$out/ab_${shape}_${k}_${round}.log" | tr -s ' ' | tr '\n' ' ')"
    done
  done
done
