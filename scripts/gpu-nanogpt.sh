#!/usr/bin/env bash
# The NanoGPT example's checks on the GPU machine. From the repository root, with .deps (and, to
# train, examples/nanogpt/data from prepare_data.py) carried along:
#   source .deps/tools/env.sh && bash scripts/gpu-nanogpt.sh
# Stages: build → train (when TRAIN=1 or no weights file exists) → tests → default run → bench
# (PDL on and off) → parity vs PyTorch → compute-sanitizer memcheck. Every stage runs even if an
# earlier one failed; logs go to $OUT (default out-nanogpt), summary.txt says what passed.
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

{ nvidia-smi -L; nvcc --version | tail -1; python3 -c 'import torch; print("torch", torch.__version__)'; } >> "$S" 2>&1

stage configure 120 cmake -S . -B "$B" -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release
stage build 300 cmake --build "$B" -j16 --target nanogpt nanogpt_decode nanogpt_inputs nanogpt_make_bad_weights \
  examples_common_safetensors examples_common_report
tail -30 "$L/build.log" | grep -E "error|FAILED" >> "$S"

W=examples/nanogpt/weights/shakespeare_char.safetensors
if [ "${TRAIN:-0}" = 1 ] || [ ! -f "$W" ]; then
  if [ -f examples/nanogpt/data/shakespeare.txt ]; then
    stage train 240 python3 examples/nanogpt/train.py --data examples/nanogpt/data/shakespeare.txt --out "$W" --steps ${TRAIN_STEPS:-3000}
    grep -E "^step|parameters|saved" "$L/train.log" | tail -4 >> "$S"
    [ -f "$W" ] && cp "$W" "$OUT/"
  else
    echo "train: skipped (no examples/nanogpt/data/shakespeare.txt)" >> "$S"
  fi
fi

NG=$B/examples/nanogpt/nanogpt
stage ctest 240 ctest --test-dir "$B" -R "nanogpt|examples_common" --output-on-failure
grep -E "tests passed|Failed|Skipped|\(Failed\)" "$L/ctest.log" >> "$S"
stage default_run 60 "$NG"
tail -3 "$L/default_run.log" >> "$S"
stage bench 180 "$NG" --bench
stage bench_json 180 "$NG" --bench --json
stage bench_nopdl 180 "$NG" --bench --no-pdl
stage bench_meta_in_graph 180 "$NG" --bench --meta-in-graph
grep -E "^Back to back|^medium_generation" "$L/bench.log" "$L/bench_nopdl.log" "$L/bench_meta_in_graph.log" >> "$S"
# Per-kernel GPU time of the decode kernels in isolation (ncu serialises kernels).
stage ncu 150 ncu --metrics gpu__time_duration.sum --launch-skip 100 --launch-count 40 "$NG" -n 40 --mode eager
if [ -f "$W" ]; then
  stage parity 180 python3 examples/nanogpt/parity.py --exe "$NG" --weights "$W" --json "$L/parity.json"
  tail -3 "$L/parity.log" >> "$S"
fi
stage memcheck_tests 300 compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 \
  "$B/examples/nanogpt/nanogpt_decode"
grep -E "ERROR SUMMARY|test cases" "$L/memcheck_tests.log" >> "$S"
stage memcheck_cli 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$NG" -n 30
grep -E "ERROR SUMMARY" "$L/memcheck_cli.log" >> "$S"
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$L"
cat "$S"
