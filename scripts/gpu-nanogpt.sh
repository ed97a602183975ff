#!/usr/bin/env bash
# The NanoGPT example's checks on a GPU machine. From the repository root:
#   bash scripts/gpu-nanogpt.sh            (with .deps: source .deps/tools/env.sh first)
# Stages: build → train (when TRAIN=1 or no weights file exists and examples/nanogpt/data holds the
# text from prepare_data.py) → tests → default run (eager, graph and the device loop) → bench →
# parity against PyTorch (when torch is installed) → compute-sanitizer memcheck of the tests and the
# CLI (→ racecheck with RACECHECK=1). Every stage runs even if an earlier one failed; logs go to
# $OUT (default out-nanogpt), summary.txt says what passed.
set -u
OUT=${OUT:-out-nanogpt}
B=${BUILD_DIR:-build-gpu-nanogpt}
mkdir -p "$OUT/logs"
L=$OUT/logs
S=$OUT/summary.txt
: > "$S"
stage() {  # stage NAME TIMEOUT_S COMMAND...: runs, logs to $L/NAME.log, records rc and seconds
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$L/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc ($((SECONDS - t0)) s)" | tee -a "$S"
  return $rc
}

{ nvidia-smi -L; nvcc --version | tail -1; } >> "$S" 2>&1

stage configure 120 cmake -S . -B "$B" -G Ninja -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DCMAKE_BUILD_TYPE=Release \
  -DREPLAY_EXAMPLES="common;nanogpt" -DREPLAY_BUILD_BENCHMARKS=OFF
stage build 300 cmake --build "$B" -j"$(nproc)" --target nanogpt nanogpt_decode nanogpt_inputs nanogpt_make_bad_weights
grep -E "error|FAILED" "$L/build.log" | head -20 >> "$S"

W=examples/nanogpt/weights/shakespeare_char.safetensors
if [ "${TRAIN:-0}" = 1 ] || [ ! -f "$W" ]; then
  if [ -f examples/nanogpt/data/shakespeare.txt ]; then
    stage train 240 python3 examples/nanogpt/train.py --data examples/nanogpt/data/shakespeare.txt --out "$W"
    grep -E "^step|parameters|saved" "$L/train.log" | tail -4 >> "$S"
  else
    echo "train: skipped (no examples/nanogpt/data/shakespeare.txt)" >> "$S"
  fi
fi

NG=$B/examples/nanogpt/nanogpt
stage ctest 300 ctest --test-dir "$B" -R nanogpt --output-on-failure
grep -E "tests passed|Failed|Skipped|test cases" "$L/ctest.log" >> "$S"
stage default_run 60 "$NG" --tokens-per-launch 16
tail -4 "$L/default_run.log" >> "$S"
stage bench 300 "$NG" --bench
sed -n '/### Decode time per token/,$p' "$L/bench.log" >> "$S"
if python3 -c 'import torch' 2> /dev/null && [ -f "$W" ]; then
  stage parity 120 python3 examples/nanogpt/parity.py --exe "$NG" --weights "$W" --json "$L/parity.json"
  tail -3 "$L/parity.log" >> "$S"
fi
stage memcheck_tests 400 compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 \
  "$B/examples/nanogpt/nanogpt_decode"
grep -E "ERROR SUMMARY|test cases" "$L/memcheck_tests.log" >> "$S"
stage memcheck_cli 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$NG" -n 30 --tokens-per-launch 8
grep -E "ERROR SUMMARY" "$L/memcheck_cli.log" >> "$S"
# RACECHECK=1: the test cases that run every kernel of the per-step paths (the whole suite is slow
# under racecheck; under racecheck the device-loop cases report hazards between different kernels'
# shared arrays and crash, see docs/perf-notes.md).
if [ "${RACECHECK:-0}" = 1 ]; then
  stage racecheck_tests 300 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
    "$B/examples/nanogpt/nanogpt_decode" -tc="*CPU reference*,*PDL on and off*"
  grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test cases" "$L/racecheck_tests.log" >> "$S"
fi
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$L"
cat "$S"
