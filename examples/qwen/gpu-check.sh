#!/usr/bin/env bash
# The Qwen example on a GPU machine, from the repo root:
#   source .deps/tools/env.sh && bash examples/qwen/gpu-check.sh
# Builds the example, runs its tests (plain, compute-sanitizer memcheck, racecheck on a reduced
# case), parity.py against transformers, the staggered demo and the benchmarks (0.6B and 4B
# shapes). RESEARCH=1 also builds research/ (-DREPLAY_BUILD_RESEARCH=ON), runs its GPU test and the
# "graph of kernels vs persistent kernel" rows. STEPS=... decode steps per bench (default 128).
# SKIP="tests sanitizers parity bench" skips parts. Logs go to $OUT (or ./out).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
build=${BUILD_DIR:-build-gpu-qwen}
steps=${STEPS:-128}
skip=" ${SKIP:-} "
research=${RESEARCH:-0}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/device.txt"
targets="qwen qwen_gpu qwen_host"
[ "$research" = 1 ] && targets="$targets qwen_research qwen_research_gpu"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DREPLAY_EXAMPLES="common;qwen" -DREPLAY_BUILD_BENCHMARKS=OFF -DREPLAY_BUILD_RESEARCH=$([ "$research" = 1 ] && echo ON || echo OFF) \
  >"$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
start=$(date +%s)
cmake --build "$build" -j16 --target $targets >"$out/build.log" 2>&1 || { grep -E "error|FAILED" "$out/build.log" | head -40; exit 1; }
echo "build: $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"
bin="$build/examples/qwen"
if [[ "$skip" != *" tests "* ]]; then
  (cd "$build" && ctest --output-on-failure -R qwen -j4) 2>&1 | tee "$out/ctest.log" | tail -8
  "$bin/qwen" --preset tiny --demo 2>&1 | tail -4 | tee -a "$out/summary.txt"
fi
if [[ "$skip" != *" sanitizers "* ]]; then
  timeout 400 compute-sanitizer --tool memcheck "$bin/qwen_gpu" >"$out/memcheck.log" 2>&1
  grep -E "ERROR SUMMARY|test cases" "$out/memcheck.log" | tee -a "$out/summary.txt"
  # racecheck on a reduced case: two sequences of the tiny shape, eager and graph (every kernel).
  timeout 300 compute-sanitizer --tool racecheck --racecheck-report hazard "$bin/qwen" --preset tiny --batch 2 --gen 4 \
    --mode both >"$out/racecheck.log" 2>&1
  grep -E "RACECHECK SUMMARY|ERROR SUMMARY|identical" "$out/racecheck.log" | tee -a "$out/summary.txt"
fi
if [[ "$skip" != *" parity "* ]]; then
  python3 examples/qwen/parity.py --bin "$bin/qwen" --out "$out/parity.json" 2>&1 | tail -12 | tee "$out/parity.txt"
fi
if [[ "$skip" != *" bench "* ]]; then
  for p in qwen3-0.6b qwen3-4b; do
    "$bin/qwen" --preset "$p" --bench --gen "$steps" --json "$out/bench-$p.json" 2>&1 | tee "$out/bench-$p.txt" | grep -vE "^  seq|^\[" 
  done
fi
if [ "$research" = 1 ]; then
  rb="$build/research/qwen"
  timeout 300 "$rb/qwen_research_gpu" 2>&1 | tail -4 | tee -a "$out/summary.txt"
  for p in qwen3-0.6b qwen3-4b; do
    for k in mega ring; do
      "$rb/qwen_research" --preset "$p" --bench --gen "$steps" --kernels "$k" --bench-batches 1 --mode graph 2>&1 \
        | grep -E "TPOT|^\| graph|floor" | sed "s/^/[research $p $k] /" | tee -a "$out/summary.txt"
    done
  done
fi
