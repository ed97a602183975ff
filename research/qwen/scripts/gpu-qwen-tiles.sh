#!/usr/bin/env bash
# The persistent kernel's tile slot sizes against a base build (docs/perf-notes.md).
# On the GPU machine, after `source .deps/tools/env.sh`, with build-carry/qx/{qwen,qwen_gpu,qwen_base}.xz
# carried (scripts/gpu-qwen-carried.sh says how to make them):
#   ROUNDS=2 bash scripts/gpu-qwen-tiles.sh [tests]
# Runs the GPU test first with `tests`, then an A/B (scripts/gpu-qwen-variants.sh, alternating
# processes) of: base; new with the slot size it picks; new with 2048- and 5120-weight tile slots
# forced (QWEN_MEGA_TILE_PIECE); new with rows one at a time (--mega-rows). VARIANTS picks some of
# them (default: "base new t2048 t5120 rows").
set -uo pipefail
src=${CARRY_DIR:-build-carry/qx}
d=${UNPACK:-/tmp/qtiles}
mkdir -p "$d"
for n in qwen qwen_gpu qwen_base; do xz -dc "$src/$n.xz" > "$d/$n" && chmod +x "$d/$n"; done
ln -sf "$d/qwen" "$d/qwen_new"
for pc in 2048 5120; do
  printf '#!/bin/sh\nQWEN_MEGA_TILE_PIECE=%s exec %s "$@"\n' "$pc" "$d/qwen" > "$d/qwen_t$pc"
done
printf '#!/bin/sh\nexec %s "$@" --mega-rows\n' "$d/qwen" > "$d/qwen_rows"
chmod +x "$d/qwen_t2048" "$d/qwen_t5120" "$d/qwen_rows"
if [[ " $* " == *" tests "* ]]; then
  mkdir -p "$d/bin" && ln -sf "$d/qwen" "$d/bin/qwen" && ln -sf "$d/qwen_gpu" "$d/bin/qwen_gpu"
  BIN_DIR="$d/bin" bash scripts/gpu-qwen-mega.sh tests
fi
"$d/qwen" --preset qwen3-4b --bench --random-prompt 16 --gen 4 --bench-batches 1 --kv-mem-mb 2048 --kernels mega 2>&1 |
  grep -E "^decode kernels" | head -1
bins=""
for v in ${VARIANTS:-base new t2048 t5120 rows}; do bins="$bins $d/qwen_$v"; done
BINS="$bins" KERNELS=mega ROUNDS=${ROUNDS:-2} \
  bash scripts/gpu-qwen-variants.sh
