#!/usr/bin/env bash
# The NanoGPT example's checks on the GPU machine. From the repository root, with .deps (and, to
# train, examples/nanogpt/data from prepare_data.py) carried along:
#   source .deps/tools/env.sh && bash scripts/gpu-nanogpt.sh
# Stages: build → train (when TRAIN=1 or no weights file exists) → tests → default run → bench
# (the default settings, then each launch variant: metadata path, PDL off, empty kernels) → parity
# vs PyTorch → compute-sanitizer memcheck and racecheck (→ with STAMPS=1 the per-kernel timestamps).
# Every stage runs even if an earlier one failed;
# logs go to $OUT (default out-nanogpt), summary.txt says what passed.
#
# CARRIED_BUILD=dir: use a build directory configured and built on the CPU machine (sm_90, CUDA 13.0)
# and carried along, instead of building here, when its programs start. Its CTest files hold the
# CPU machine's absolute paths (CARRIED_ROOT, default /work/main): if that path does not exist here,
# it is made a link to this tree. If anything of that fails, the script builds here. (The CLI
# failure tests are host-only and call the CPU machine's cmake by absolute path: with a carried
# build they are left to the CPU machine.)
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

use_carried=0
if [ -n "${CARRIED_BUILD:-}" ] && [ -x "$CARRIED_BUILD/examples/nanogpt/nanogpt" ]; then
  root=${CARRIED_ROOT:-/work/main}
  if [ ! -e "$root" ]; then mkdir -p "$(dirname "$root")" && ln -s "$PWD" "$root"; fi
  if [ "$(realpath "$root")" = "$(realpath .)" ] && "$CARRIED_BUILD/examples/nanogpt/nanogpt" --help > /dev/null 2>&1; then
    use_carried=1
    B=$CARRIED_BUILD
    echo "build: using the carried $B (via $root)" | tee -a "$S"
  fi
fi
if [ $use_carried = 0 ]; then
  stage configure 120 cmake -S . -B "$B" -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release \
    -DREPLAY_EXAMPLES="common;nanogpt"
  stage build 300 cmake --build "$B" -j16 --target nanogpt nanogpt_decode nanogpt_inputs nanogpt_make_bad_weights \
    examples_common_safetensors examples_common_report
  tail -30 "$L/build.log" | grep -E "error|FAILED" >> "$S"
fi

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
CTEST_EXCLUDE=$([ $use_carried = 1 ] && echo "nanogpt_cli_" || echo "^$")
stage ctest 150 ctest --test-dir "$B" -R "nanogpt|examples_common" -E "$CTEST_EXCLUDE" --output-on-failure
grep -E "tests passed|Failed|Skipped|\(Failed\)|test cases" "$L/ctest.log" >> "$S"
stage default_run 60 "$NG"
tail -3 "$L/default_run.log" >> "$S"

# The bench with the default settings, then one launch setting changed at a time.
stage bench 120 "$NG" --bench
stage bench_json 120 "$NG" --bench --json
BENCHES=${BENCHES:-"mapped:--meta=mapped push:--meta=push graph_copy:--meta=graph-copy nopdl:--no-pdl null:--null-kernels null_mapped:--null-kernels,--meta=mapped null_push:--null-kernels,--meta=push again:"}
for b in $BENCHES; do
  name=${b%%:*}
  args=${b#*:}
  # shellcheck disable=SC2086
  stage "bench_$name" 120 "$NG" --bench ${args//,/ }
done
grep -hE "^Back to back|^medium_generation" "$L"/bench*.log >> "$S"
# The decode kernels' machine code (registers, where the loads sit relative to the waits).
command -v cuobjdump > /dev/null && cuobjdump -sass "$NG" > "$OUT/nanogpt.sass" 2>&1
if [ -f "$W" ]; then
  stage parity 120 python3 examples/nanogpt/parity.py --exe "$NG" --weights "$W" --json "$L/parity.json"
  tail -3 "$L/parity.log" >> "$S"
fi
stage memcheck_tests 200 compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 \
  "$B/examples/nanogpt/nanogpt_decode"
grep -E "ERROR SUMMARY|test cases" "$L/memcheck_tests.log" >> "$S"
# racecheck (the kernels share memory across warps): the test cases that run every kernel, prefill and
# decode, eager and graph (the whole suite takes more than 5 minutes under racecheck).
# RACECHECK=0 skips it (e.g. to stay within one call's time limit; run it in a second call).
if [ "${RACECHECK:-1}" = 1 ]; then
  stage racecheck_tests 300 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
    "$B/examples/nanogpt/nanogpt_decode" -tc="*CPU reference*,*PDL on and off*,*null kernels*,*MetaPath::device*"
  grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test cases" "$L/racecheck_tests.log" >> "$S"
fi
stage memcheck_cli 60 compute-sanitizer --tool memcheck --error-exitcode 9 "$NG" -n 30
stage memcheck_cli_push 60 compute-sanitizer --tool memcheck --error-exitcode 9 "$NG" -n 30 --meta push
stage memcheck_cli_mapped 60 compute-sanitizer --tool memcheck --error-exitcode 9 "$NG" -n 30 --meta mapped
grep -E "ERROR SUMMARY" "$L/memcheck_cli.log" "$L/memcheck_cli_push.log" "$L/memcheck_cli_mapped.log" >> "$S"
# STAMPS=1: the per-kernel timestamps (README item 11): a second build with -DNANOGPT_STAMPS=ON and
# its nanogpt_stamps probe (graph and eager, steps back to back).
if [ "${STAMPS:-0}" = 1 ]; then
  stage stamps_configure 120 cmake -S . -B "$B-stamps" -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_BUILD_TYPE=Release -DREPLAY_EXAMPLES="common;nanogpt" -DNANOGPT_STAMPS=ON -DREPLAY_BUILD_TESTS=OFF \
    -DREPLAY_BUILD_BENCHMARKS=OFF
  stage stamps_build 300 cmake --build "$B-stamps" -j16 --target nanogpt_stamps
  stage stamps 120 "$B-stamps/examples/nanogpt/nanogpt_stamps" 2400
  cp "$L/stamps.log" "$OUT/stamps.txt"
  grep -E "mode,|per step" "$L/stamps.log" >> "$S"
fi
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$L"
cat "$S"
