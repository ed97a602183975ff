#!/usr/bin/env bash
# The persistent kernel (--kernels mega) on the GPU machine. From the repo root, after
# `source .deps/tools/env.sh`:
#   BIN_DIR=dir bash scripts/gpu-qwen-mega.sh [tests] [sanitize] [bench] [longctx] [parity] [chunks]
#   (default: the first five)
# tests:    the whole GPU test (every decode-kernel variant, mega included), then the persistent
#           kernel's cases with ring slots of 2560 and 3072 weights forced (QWEN_MEGA_PIECE);
# sanitize: memcheck of the GPU test cases that run mega (also with 2560-weight slots), then the
#           racecheck stage;
# racecheck: racecheck of the CLI with mega (tiny shape; every hazard counted and grouped);
# bench:    A/B of mega and ring at batch 1 (alternating processes, ROUNDS rounds), with the trace
#           (TRACE_BIN_DIR: a build configured with -DQWEN_MEGA_TRACE=ON; default BIN_DIR, where
#           the trace is printed only if that build has it);
# longctx:  mega and ring after a 2000-token prompt;
# parity:   parity.py against Hugging Face with the persistent kernel (tensor-core rows) decoding;
# chunks:   mega's attention chunk size (CHUNKS, default "64 128 256") at short and long contexts.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"
bin=${BIN_DIR:-build-gpu-qwen/examples/qwen}
stages=${*:-tests sanitize bench longctx parity}
# racecheck (every hazard, grouped by research/qwen/scripts/racecheck-summary.py) of the CLI with mega on the tiny
# shape: tensor-core rows, FMA rows, slots of 2560 weights, split attention (3 chunks of 64 positions)
racecheck_one() {  # NAME ENV... -- ARGS...
  local name=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  env "${envs[@]}" timeout 200 compute-sanitizer --tool racecheck --racecheck-report hazard --show-backtrace no \
    --print-limit 1000000 "$bin/qwen" --preset tiny --batch 1 --mode both --kernels mega "$@" >"$out/mega_race_$name.log" 2>&1
  echo "racecheck ($name) exit $?: $(grep -E 'RACECHECK SUMMARY' "$out/mega_race_$name.log")"
  python3 research/qwen/scripts/racecheck-summary.py "$out/mega_race_$name.log" --top 8
}
# QWEN_MEGA_SERIAL_ISSUE=1: the producer lanes issue their bulk copies one at a time, which racecheck
# follows; the default (lanes together) is the same protocol, whose reports racecheck attributes to
# the wrong lane (mega.cu's header, probes/raceprobe.cu): run once for the record.
# RACE_CASES: the cases to run (default: the first five; `pairs`: split attention with items of two
# query heads).
racecheck_all() {
  local cases=" ${RACE_CASES:-mma fma piece2560 split mma_lanes_together} "
  [[ $cases == *" mma "* ]] && racecheck_one mma QWEN_MEGA_SERIAL_ISSUE=1 -- --random-prompt 12 --gen 6
  [[ $cases == *" fma "* ]] && racecheck_one fma QWEN_MEGA_SERIAL_ISSUE=1 -- --random-prompt 12 --gen 6 --mega-fma
  [[ $cases == *" piece2560 "* ]] &&
    racecheck_one piece2560 QWEN_MEGA_SERIAL_ISSUE=1 QWEN_MEGA_PIECE=2560 -- --random-prompt 12 --gen 6
  [[ $cases == *" split "* ]] &&
    racecheck_one split QWEN_MEGA_SERIAL_ISSUE=1 -- --random-prompt 130 --gen 6 --mega-attn-chunk 64
  [[ $cases == *" mma_lanes_together "* ]] && racecheck_one mma_lanes_together -- --random-prompt 12 --gen 6
  [[ $cases == *" pairs "* ]] &&
    racecheck_one pairs QWEN_MEGA_SERIAL_ISSUE=1 -- --random-prompt 130 --gen 6 --mega-attn-chunk 64 --mega-attn-heads 2
  return 0
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for stage in $stages; do
  case $stage in
    tests)
      timeout 400 "$bin/qwen_gpu" >"$out/mega_tests.log" 2>&1
      echo "tests exit $?"; grep -E "doctest\] (test cases|assertions)" "$out/mega_tests.log"
      for pc in 2560 3072; do
        QWEN_MEGA_PIECE=$pc QWEN_TEST_KERNELS=mega timeout 300 "$bin/qwen_gpu" -tc='the persistent kernel*' \
          >"$out/mega_tests_$pc.log" 2>&1
        echo "tests (slots of $pc weights) exit $?"; grep -E "doctest\] (test cases|assertions)" "$out/mega_tests_$pc.log"
      done
      # Tiles in either device's setting whatever the device (mega_device_tuning): H200 5 KiB slots and
      # a 75 ns pause, H100 4 KiB slots and 100 ns.
      for t in 2560:75 2048:100; do
        QWEN_MEGA_TILE_PIECE=${t%:*} QWEN_MEGA_PACE=${t#*:} QWEN_TEST_KERNELS=mega timeout 300 "$bin/qwen_gpu" \
          -tc='the persistent kernel*' >"$out/mega_tests_t${t%:*}.log" 2>&1
        echo "tests (tiles of ${t%:*} weights, pause ${t#*:} ns) exit $?"
        grep -E "doctest\] (test cases|assertions)" "$out/mega_tests_t${t%:*}.log"
      done ;;
    sanitize)
      QWEN_TEST_KERNELS=mega timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 "$bin/qwen_gpu" \
        -tc='the persistent kernel*,eager and graph*,padding rows*' >"$out/mega_memcheck.log" 2>&1
      echo "memcheck exit $?"; grep -E "doctest\] (test cases|assertions)|ERROR SUMMARY" "$out/mega_memcheck.log"
      QWEN_MEGA_PIECE=2560 QWEN_TEST_KERNELS=mega timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 \
        "$bin/qwen_gpu" -tc='the persistent kernel*' >"$out/mega_memcheck_2560.log" 2>&1
      echo "memcheck (slots of 2560 weights) exit $?"
      grep -E "doctest\] (test cases|assertions)|ERROR SUMMARY" "$out/mega_memcheck_2560.log"
      QWEN_MEGA_TILE_PIECE=2560 QWEN_MEGA_PACE=75 QWEN_TEST_KERNELS=mega timeout 300 compute-sanitizer --tool memcheck \
        --error-exitcode 1 "$bin/qwen_gpu" -tc='the persistent kernel*' >"$out/mega_memcheck_t2560.log" 2>&1
      echo "memcheck (tiles of 2560 weights, pause 75 ns) exit $?"
      grep -E "doctest\] (test cases|assertions)|ERROR SUMMARY" "$out/mega_memcheck_t2560.log"
      racecheck_all ;;
    racecheck)
      racecheck_all ;;
    bench)
      KERNELS="${KERNELS:-mega ring}" ROUNDS=${ROUNDS:-2} BIN_DIR="$bin" bash scripts/gpu-qwen-ab.sh
      for shape in qwen3-0.6b qwen3-4b; do
        kv=4096; [ "$shape" = qwen3-4b ] && kv=8192
        QWEN_MEGA_TRACE=1 timeout 150 "${TRACE_BIN_DIR:-$bin}/qwen" --preset "$shape" --bench --random-prompt 16 --gen 128 \
          --bench-batches 1 --kv-mem-mb $kv --kernels mega >"$out/mega_trace_$shape.log" 2>&1
        grep -E "^\| (eager|graph) |mega trace|^  [a-z]" "$out/mega_trace_$shape.log"
      done ;;
    longctx)
      for shape in qwen3-0.6b qwen3-4b; do
        kv=4096; [ "$shape" = qwen3-4b ] && kv=8192
        for k in mega ring; do
          timeout 150 "$bin/qwen" --preset "$shape" --bench --random-prompt 2000 --gen 64 --bench-batches 1 \
            --kv-mem-mb $kv --kernels $k >"$out/mega_long_${shape}_$k.log" 2>&1
          echo "2000-token prompt $shape $k: $(grep -E '^\| graph ' "$out/mega_long_${shape}_$k.log" | head -1 | tr -s ' ')"
        done
      done ;;
    parity)
      QWEN_KERNELS=mega PYTHONUNBUFFERED=1 timeout 200 python3 examples/qwen/parity.py --bin "$bin/qwen" \
        --out "$out/mega_parity.json" >"$out/mega_parity.log" 2>&1
      echo "parity exit $?"; grep -E "PARITY|rel L2|PASS|FAIL|divergence" "$out/mega_parity.log" | head -12 ;;
    chunks)
      for shape in qwen3-0.6b qwen3-4b; do
        kv=4096; [ "$shape" = qwen3-4b ] && kv=8192
        for prompt in 16 2000; do
          for c in ${CHUNKS:-64 128 256}; do
            timeout 150 "$bin/qwen" --preset "$shape" --bench --random-prompt $prompt --gen 128 --bench-batches 1 \
              --kv-mem-mb $kv --kernels mega --mega-attn-chunk $c >"$out/mega_chunk_${shape}_${prompt}_$c.log" 2>&1
            echo "$shape prompt $prompt chunk $c: $(grep -E '^\| graph ' "$out/mega_chunk_${shape}_${prompt}_$c.log" | head -1 | tr -s ' ')"
          done
        done
      done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
