#!/usr/bin/env bash
# Everything on the GPU machine in one call, from the repo root:
#   source .deps/tools/env.sh && bash scripts/gpu-final.sh
# 1. scripts/gpu-check.sh over the whole project: build all, ctest (every test), compute-sanitizer
#    memcheck of every gpu-labelled test (two passes), launch_overhead table;
# 2. the demos: nanogpt (default run), qwen (staggered batch demo, tiny and 0.6B shapes);
# 3. the benchmark suite (scripts/gpu-bench.sh), JSON to $OUT.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export BUILD_DIR=build-gpu-all
REPLAY_EXAMPLES="common;launch_overhead;nanogpt;qwen" bash scripts/gpu-check.sh
{
  echo "== nanogpt (default run)"; timeout 60 "$BUILD_DIR/examples/nanogpt/nanogpt"
  echo "== qwen --preset tiny --demo"; timeout 120 "$BUILD_DIR/examples/qwen/qwen" --preset tiny --demo
  echo "== qwen --preset qwen3-0.6b --demo"; timeout 120 "$BUILD_DIR/examples/qwen/qwen" --preset qwen3-0.6b --demo
} 2>&1 | tee "$out/demos.log" | tail -40
[ -n "${SKIP_BENCH:-}" ] || OUT="$out" bash scripts/gpu-bench.sh >/dev/null 2>&1
ls "$out"
