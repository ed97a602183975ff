#!/usr/bin/env bash
# The tensor-parallel check, run on a machine with two or more NVIDIA GPUs from the repo root (with
# the unpacked Debian packages of ../shared/device: `source .deps/tools/env.sh` first):
#   bash scripts/tp-check.sh
# Builds the lockstep host test, the multi-GPU test and the all-reduce benchmark only, runs the
# tests, compute-sanitizer memcheck of the multi-GPU test (memory errors), and the benchmark (medians of REPS repetitions).
# Settings: OUT (logs, default ./out), BUILD_DIR (build-tp), REPS (5), FILTER (benchmark regex).
# NVLink multicast stays as the machine sets it (NCCL_NVLS_ENABLE is never touched here).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
build=${BUILD_DIR:-build-tp}
sum="$out/tp-summary.txt"
say() { echo "$*" | tee -a "$sum"; }
nvidia-smi --query-gpu=name,driver_version --format=csv | tee -a "$sum"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DREPLAY_BUILD_EXAMPLES=OFF >"$out/tp-configure.log" 2>&1 || { tail -30 "$out/tp-configure.log"; exit 1; }
grep "replay: NCCL" "$out/tp-configure.log" | tee -a "$sum"
t0=$SECONDS
cmake --build "$build" -j16 --target host_test_lockstep gpu_test_multi_gpu bench_allreduce \
  >"$out/tp-build.log" 2>&1 || { grep -E "error|FAILED" "$out/tp-build.log" | head -40; exit 1; }
say "build: $((SECONDS - t0)) s"
"$build/tests/host_test_lockstep" 2>&1 | tail -3 | tee -a "$sum"
[ -n "${SKIP_TEST:-}" ] || timeout 300 "$build/tests/gpu_test_multi_gpu" >"$out/tp-test.log" 2>&1; say "gpu_test_multi_gpu: exit $?"
tail -4 "$out/tp-test.log" | tee -a "$sum"
# Memory errors only: NCCL's own start-up probes fail CUDA API calls on purpose (kernel images for
# other architectures, peer access already enabled), so an API-error pass cannot be clean.
[ -n "${SKIP_MEMCHECK:-}" ] || for pass in "--report-api-errors no|"; do
  sflags=${pass%%|*}; tflags=${pass#*|}
  timeout 400 compute-sanitizer --tool memcheck $sflags "$build/tests/gpu_test_multi_gpu" $tflags \
    >"$out/tp-memcheck.log" 2>&1; rc=$?
  say "memcheck ($sflags $tflags): exit $rc"
  grep -E "ERROR SUMMARY|test cases" "$out/tp-memcheck.log" | tail -2 | tee -a "$sum"
done
timeout 200 "$build/benchmarks/bench_allreduce" --benchmark_repetitions="${REPS:-5}" \
  --benchmark_report_aggregates_only=true ${FILTER:+--benchmark_filter=$FILTER} \
  --benchmark_out="$out/allreduce.json" --benchmark_out_format=json >"$out/tp-bench.log" 2>&1
say "bench_allreduce: exit $?"
grep -E "_median|ERROR|error" "$out/tp-bench.log" | tee -a "$sum"
