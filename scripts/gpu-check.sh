#!/usr/bin/env bash
# Core GPU check, run on the GPU machine from the repo root (see ../shared/device/README.md):
#   source .deps/tools/env.sh && bash scripts/gpu-check.sh
# Builds the core tests and the launch_overhead example, runs the GPU tests (plain and under
# compute-sanitizer memcheck) and the demo, and writes logs to $OUT (or ./out).
# TARGETS="a b" builds only those targets; CTEST_ARGS="-R x" selects tests.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
build=${BUILD_DIR:-build-gpu-core}
examples=${REPLAY_EXAMPLES:-launch_overhead}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/device.txt"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DREPLAY_EXAMPLES="$examples" >"$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
cmake --build "$build" -j16 ${TARGETS:+--target $TARGETS} >"$out/build.log" 2>&1 || { grep -E "error|FAILED" "$out/build.log" | head -40; exit 1; }
(cd "$build" && ctest --output-on-failure -j4 ${CTEST_ARGS:-}) 2>&1 | tee "$out/ctest.log" | tail -25
# memcheck, two passes per GPU test: (1) every test case, memory errors only (tests in the doctest
# suite "expected_cuda_errors" provoke API errors on purpose); (2) all other cases with API-error
# reporting on. Full logs go to $out/memcheck-full.log; the summary lines to $out/memcheck.log.
san="compute-sanitizer --tool memcheck"
: >"$out/memcheck-full.log"
# Every test labelled "gpu" in CTest (core, pool, runner, examples), with its arguments.
mapfile -t gpu_cmds < <(ctest --test-dir "$build" -L gpu ${CTEST_ARGS:-} --show-only=json-v1 | python3 -c '
import json, shlex, sys
for t in json.load(sys.stdin)["tests"]:
    if t.get("command"): print(shlex.join(t["command"]))')
for cmd in "${gpu_cmds[@]}"; do
  for pass in "--report-api-errors no|" "--report-api-errors explicit|-tse=expected_cuda_errors"; do
    sflags=${pass%%|*}; tflags=${pass#*|}
    case "$cmd" in *gpu_test_*|*_gpu|*_decode) ;; *) tflags="" ;; esac  # doctest filters only for doctest programs
    echo "== memcheck $(basename "${cmd%% *}") $sflags $tflags" | tee -a "$out/memcheck.log" >>"$out/memcheck-full.log"
    eval "timeout ${MEMCHECK_TIMEOUT:-240} $san $sflags $cmd $tflags" >>"$out/memcheck-full.log" 2>&1 || echo "exit $? ($cmd)" >>"$out/memcheck-full.log"
    tail -n 4 "$out/memcheck-full.log" | grep -E "ERROR SUMMARY|test cases|^exit " | tee -a "$out/memcheck.log"
  done
done
"$build/examples/launch_overhead/launch_overhead" --iters 300 --json "$out/launch_overhead.json" 2>&1 | tee "$out/launch_overhead.txt"
# racecheck on the tests whose kernels share memory (the PDL chain stages through shared memory).
for t in gpu_test_launch; do
  bin=$(find "$build" -name "$t" -type f -perm -u+x | head -1)
  [ -n "$bin" ] || continue
  echo "== racecheck $t" | tee -a "$out/racecheck.log"
  timeout "${MEMCHECK_TIMEOUT:-240}" compute-sanitizer --tool racecheck --racecheck-report all "$bin" \
    -tse=expected_cuda_errors >"$out/racecheck-$t.log" 2>&1 || echo "exit $?" >>"$out/racecheck.log"
  grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test cases" "$out/racecheck-$t.log" | tee -a "$out/racecheck.log"
done
# BENCH=1: the launch-overhead chains with and without PDL (N = 10, 100, 400), JSON to $out.
if [ -n "${BENCH:-}" ]; then
  cmake -S . -B "$build" -DREPLAY_BUILD_BENCHMARKS=ON >/dev/null && cmake --build "$build" -j16 --target bench_launch_overhead >>"$out/build.log" 2>&1
  "$build/benchmarks/bench_launch_overhead" --benchmark_filter='^(gpu|launch/(eager|eager_pdl|graph|graph_pdl)/sync)/.*N:(10|100|400)/' \
    --benchmark_min_time=0.05 --benchmark_repetitions=5 --benchmark_report_aggregates_only=true \
    --benchmark_out="$out/launch_pdl.json" --benchmark_out_format=json 2>&1 | grep -E "median" | tee "$out/launch_pdl.txt"
fi
