#!/usr/bin/env bash
# compute-sanitizer racecheck (shared-memory hazards) over the GPU tests whose kernels use shared
# memory: the examples' decoders and the pool/runner tests. From the repo root on the GPU machine:
#   source .deps/tools/env.sh && bash scripts/gpu-racecheck.sh
set -uo pipefail
# The persistent kernel (the default for bucket 1) with its producer lanes issuing one at a time: the
# same protocol, which racecheck follows (examples/qwen/README.md, "compute-sanitizer racecheck").
export QWEN_MEGA_SERIAL_ISSUE=1
out=${OUT:-out}; mkdir -p "$out"
build=${BUILD_DIR:-build-gpu-race}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 >"$out/race-configure.log" 2>&1 || exit 1
cmake --build "$build" -j16 --target nanogpt_decode qwen_gpu gpu_test_pool gpu_test_runner gpu_test_core >"$out/race-build.log" 2>&1 || { grep -E "error|FAILED" "$out/race-build.log" | head; exit 1; }
for t in examples/nanogpt/nanogpt_decode examples/qwen/qwen_gpu tests/gpu_test_pool tests/gpu_test_runner tests/gpu_test_core; do
  echo "== racecheck $(basename $t)"
  timeout ${RACE_TIMEOUT:-240} compute-sanitizer --tool racecheck --racecheck-report hazard "$build/$t" -tse=expected_cuda_errors >"$out/race-$(basename $t).log" 2>&1
  echo "exit $?"; grep -E "test cases|RACECHECK SUMMARY|ERROR SUMMARY" "$out/race-$(basename $t).log"
done 2>&1 | tee "$out/racecheck.log"
