#!/usr/bin/env bash
# Final check of the qwen example on the GPU machine (see scripts/gpu-qwen.sh for the stages):
#   source .deps/tools/env.sh && BIN_DIR=dir bash scripts/gpu-qwen-final.sh
# 1. tests (every decode-kernel variant), parity, demo, bench, long context;
# 2. memcheck of the GPU test (default and per-row kernels) and the demo;
# 3. racecheck of the GPU test's first case with the default kernels (shared-memory kernels).
# Everything lands in $OUT/final.tgz plus short summaries on stdout.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"
bin=${BIN_DIR:-build-gpu-qwen/examples/qwen}
OUT="$out/main" bash scripts/gpu-qwen.sh test parity demo bench longctx >/dev/null 2>&1
OUT="$out/mem" QWEN_TEST_KERNELS=rowpipe,legacy bash scripts/gpu-qwen.sh memcheck >/dev/null 2>&1
QWEN_TEST_KERNELS=rowpipe timeout 300 compute-sanitizer --tool racecheck --racecheck-report analysis \
  "$bin/qwen_gpu" -tc="eager and graph*" >"$out/racecheck.log" 2>&1
echo "racecheck exit $?" >>"$out/racecheck.log"
grep -hE "doctest\] (test cases|assertions)|ERROR SUMMARY|RACECHECK SUMMARY|PARITY|PASS|FAIL|racecheck exit|\(exit [^0]" \
  "$out/main/qwen.log" "$out/mem/qwen.log" "$out/racecheck.log" | sort | uniq -c | head -40
grep -hE "^## Batch-1|^\| (eager|graph) |read-only|^\| (1|8|32|64) |memory:" "$out/main/qwen.log" | head -60
tar czf "$out/final.tgz" -C "$out" main mem racecheck.log && rm -rf "$out/main" "$out/mem" "$out/racecheck.log"
