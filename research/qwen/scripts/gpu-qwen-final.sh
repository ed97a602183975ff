#!/usr/bin/env bash
# Final check of the qwen example on the GPU machine (see scripts/gpu-qwen.sh for the stages):
#   source .deps/tools/env.sh && BIN_DIR=dir bash scripts/gpu-qwen-final.sh [main] [sanitize]
# main:     tests (every decode-kernel variant), parity, demo, bench, long context, split-KV A/B;
# sanitize: memcheck of the GPU test (ring, rowpipe, per-row and persistent kernels) and the demo;
#           racecheck of the CLI (default and persistent kernels) and of the GPU test's first case
#           with the default kernels (shared memory).
# Both parts by default (one part fits one 10-minute device call). Everything lands in
# $OUT/final-<part>.tgz plus short summaries on stdout.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"
bin=${BIN_DIR:-build-gpu-qwen/examples/qwen}
parts=${*:-main sanitize}
for part in $parts; do
  case $part in
    main)
      OUT="$out/main" bash scripts/gpu-qwen.sh test parity demo bench longctx splitkv >/dev/null 2>&1
      grep -hE "doctest\] (test cases|assertions)|PARITY|PASS|FAIL|\(exit [^0]" "$out/main/qwen.log" | sort | uniq -c
      grep -hE "^\\$ .*(--bench|QWEN)|^## Batch-1|^\| (eager|graph) |read-only|^\| (1|8|32|64) |memory:" \
        "$out/main/qwen.log" | head -150
      tar czf "$out/final-main.tgz" -C "$out" main && rm -rf "$out/main" ;;
    sanitize)
      OUT="$out/mem" QWEN_TEST_KERNELS=ring,rowpipe,legacy,mega bash scripts/gpu-qwen.sh memcheck >/dev/null 2>&1
      # The ring GEMV (buckets 2-4 by default) and attention under racecheck: the CLI (tiny shape, 3 rows, eager and
      # graph), then a GPU test case (its prefill GEMMs run through cuBLAS, which racecheck reports
      # on inside its own kernels; the split-KV case outlasted 200 s under racecheck in every run).
      timeout 120 compute-sanitizer --tool racecheck --racecheck-report analysis "$bin/qwen" --preset tiny \
        --random-prompt 12 --gen 6 --batch 3 --mode both >>"$out/racecheck.log" 2>&1
      echo "racecheck (CLI) exit $?" >>"$out/racecheck.log"
      # (the persistent kernel's producer lanes one at a time: see examples/qwen/README.md, racecheck)
      QWEN_MEGA_SERIAL_ISSUE=1 timeout 120 compute-sanitizer --tool racecheck --racecheck-report analysis "$bin/qwen" --preset tiny \
        --random-prompt 12 --gen 6 --batch 1 --mode both --kernels mega >>"$out/racecheck.log" 2>&1
      echo "racecheck (CLI, persistent kernel) exit $?" >>"$out/racecheck.log"
      for tc in "eager and graph*"; do
        QWEN_TEST_KERNELS=ring timeout 300 compute-sanitizer --tool racecheck --racecheck-report analysis \
          "$bin/qwen_gpu" -tc="$tc" >>"$out/racecheck.log" 2>&1
        echo "racecheck ($tc) exit $?" >>"$out/racecheck.log"
      done
      grep -hE "doctest\] (test cases|assertions)|ERROR SUMMARY|RACECHECK SUMMARY|racecheck .*exit|\(exit [^0]" \
        "$out/mem/qwen.log" "$out/racecheck.log" | sort | uniq -c | head -40
      tar czf "$out/final-sanitize.tgz" -C "$out" mem racecheck.log && rm -rf "$out/mem" "$out/racecheck.log" ;;
    *) echo "unknown part $part (main, sanitize)"; exit 2 ;;
  esac
done
