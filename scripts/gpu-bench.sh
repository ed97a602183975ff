#!/usr/bin/env bash
# The benchmark suite on the GPU machine, from the repo root (see ../shared/device/README.md):
#   source .deps/tools/env.sh && bash scripts/gpu-bench.sh
# Builds and runs every benchmark program through benchmarks/run.sh (JSON only: the GPU machine has
# no matplotlib), and copies the JSON and a log to $OUT (or ./out). Then, on the CPU machine:
#   python3 benchmarks/report.py <files>/launch_overhead.json <files>/decode_step.json ... \
#       --out docs/benchmarks.md --img docs/img
# SMOKE=1 first runs each program briefly under compute-sanitizer memcheck (slow; off by default).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
log="$out/bench.log"
export BUILD_DIR=${BUILD_DIR:-build-gpu-bench}
export RESULTS=${RESULTS:-$BUILD_DIR/results}
export CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90 ${CMAKE_ARGS:-}"
export NO_REPORT=1
t0=$(date +%s)
bash benchmarks/run.sh 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
echo "suite: exit $rc, $(( $(date +%s) - t0 )) s (build included)" | tee -a "$log"
if [ -n "${SMOKE:-}" ]; then
  for p in launch_overhead decode_step; do
    exe="$BUILD_DIR/benchmarks/bench_$p"
    [ -x "$exe" ] || continue
    echo "== memcheck bench_$p" | tee -a "$log"
    compute-sanitizer --tool memcheck --error-exitcode 1 "$exe" --benchmark_filter="${SMOKE_FILTER:-/N:10/|null_step|nanogpt/graph/sync}" \
      --benchmark_min_time=0.001 2>&1 | tail -n 5 | tee -a "$log"
  done
fi
cp "$RESULTS"/*.json "$out"/ 2>/dev/null
ls -la "$out"
exit "$rc"
