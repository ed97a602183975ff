#!/usr/bin/env bash
# Everything on the GPU machine in one call, from the repo root:
#   source .deps/tools/env.sh && bash scripts/gpu-final.sh
# 1. scripts/gpu-check.sh over the whole project: build all, ctest (every test), compute-sanitizer
#    memcheck of every gpu-labelled test (two passes), launch_overhead table;
# 2. the demos: nanogpt (default run), qwen (staggered batch demo, tiny and 0.6B shapes);
# 3. the benchmark suite (scripts/gpu-bench.sh; SKIP_BENCH=1 skips it).
# Logs go to $OUT/logs.tar.gz (everything) plus a few summaries beside it.
set -uo pipefail
top=${OUT:-out}; mkdir -p "$top"
work=$(mktemp -d)
export BUILD_DIR=build-gpu-all
OUT="$work/check" REPLAY_EXAMPLES="common;launch_overhead;nanogpt;qwen" bash scripts/gpu-check.sh
{
  echo "== nanogpt (default run)"; timeout 60 "$BUILD_DIR/examples/nanogpt/nanogpt"
  echo "== qwen --preset tiny --demo"; timeout 120 "$BUILD_DIR/examples/qwen/qwen" --preset tiny --demo
  echo "== qwen --preset qwen3-0.6b --demo"; timeout 120 "$BUILD_DIR/examples/qwen/qwen" --preset qwen3-0.6b --demo
} >"$work/demos.log" 2>&1
tail -40 "$work/demos.log"
if [ -z "${SKIP_BENCH:-}" ]; then
  OUT="$work/bench" bash scripts/gpu-bench.sh >"$work/bench-run.log" 2>&1
  tail -3 "$work/bench-run.log"
fi
cp "$work/check/memcheck.log" "$work/check/ctest.log" "$work/demos.log" "$top/" 2>/dev/null
tar czf "$top/logs.tar.gz" -C "$work" .
ls -la "$top"
