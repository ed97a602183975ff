#!/usr/bin/env bash
# The exchange probes (docs/perf-notes.md), built straight with nvcc and run on the GPU machine;
# logs to $OUT. Usage: OUT=dir bash scripts/gpu-bytes-probe.sh
set -euo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
B=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/device.txt"
for p in bytes reduce; do
  nvcc -std=c++20 -O3 -arch=sm_90 -o "$B/qwen_${p}_probe" "examples/qwen/probes/${p}probe.cu"
done
for r in 1 2; do
  "$B/qwen_bytes_probe" 400 | tee "$OUT/bytes_$r.txt"
  "$B/qwen_reduce_probe" 400 | tee "$OUT/reduce_$r.txt"
done
if [[ "${SANITIZE:-0}" == 1 ]]; then
  compute-sanitizer --tool memcheck "$B/qwen_bytes_probe" 40 > "$OUT/bytes_memcheck.txt" 2>&1 || true
  tail -3 "$OUT/bytes_memcheck.txt"
fi
