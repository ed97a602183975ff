#!/usr/bin/env bash
# Graph pool / step runner checks on the GPU machine, from the repo root (see ../shared/device/README.md):
#   source .deps/tools/env.sh && bash scripts/gpu-pool.sh [stages...]
# Stages (default: all): test (CTest of the pool/bucket/runner tests, then the GPU tests with their
# statistics tables), memcheck (GPU tests under compute-sanitizer memcheck, two passes as
# scripts/gpu-check.sh), bench (benchmarks with JSON output and a summary: pool vs raw launch
# overhead; capture time and memory per bucket; about 1 minute).
# Files in $OUT (or ./out): pool.log, memcheck-full.log, pool_overhead.json, pool_capture.json,
# pool_summary.txt.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
build=${BUILD_DIR:-build-gpu-pool}
stages=${*:-test memcheck bench}
log="$out/pool.log"; : >"$log"
say() { echo "$@" | tee -a "$log"; }
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee -a "$log"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DREPLAY_EXAMPLES=launch_overhead >"$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
targets="host_test_bucket host_test_graph_pool host_test_runner gpu_test_pool gpu_test_runner bench_pool_overhead bench_pool_capture"
cmake --build "$build" -j16 --target $targets >"$out/build.log" 2>&1 \
  || { grep -E "error|FAILED" "$out/build.log" | head -40; exit 1; }
rm -f "$out/configure.log" "$out/build.log"
say "build: $(( $(date +%s) - t0 )) s"

has() { case " $stages " in *" $1 "*) return 0 ;; esac; return 1; }
if has test; then
say "== ctest"
(cd "$build" && ctest --output-on-failure -R 'host_test_(bucket|graph_pool|runner)|gpu_test_(pool|runner)|bench_pool') 2>&1 | tee -a "$log" | tail -15

say "== GPU tests with messages (doctest -s: statistics tables, warnings)"
for t in gpu_test_pool gpu_test_runner; do
  "$build/tests/$t" -s 2>&1 | grep -vE "^\s*(CHECK|REQUIRE)|PASSED|^=+$|^$|values:" >>"$log"
done

fi
if has memcheck; then
say "== memcheck"
san="compute-sanitizer --tool memcheck"
: >"$out/memcheck-full.log"
for t in gpu_test_pool gpu_test_runner; do
  for pass in "--report-api-errors no|" "--report-api-errors explicit|-tse=expected_cuda_errors"; do
    sflags=${pass%%|*}; tflags=${pass#*|}
    say "-- memcheck $t $sflags $tflags"
    $san $sflags "$build/tests/$t" $tflags >>"$out/memcheck-full.log" 2>&1
    tail -n 4 "$out/memcheck-full.log" | grep -E "ERROR SUMMARY|test cases" | tee -a "$log"
  done
done

fi
if has bench; then
say "== benchmarks"
"$build/benchmarks/bench_pool_overhead" --benchmark_repetitions=10 --benchmark_report_aggregates_only=true \
  --benchmark_format=json --benchmark_out="$out/pool_overhead.json" \
  --benchmark_out_format=json >/dev/null 2>>"$log"
"$build/benchmarks/bench_pool_capture" --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
  --benchmark_format=json --benchmark_out="$out/pool_capture.json" --benchmark_out_format=json >/dev/null 2>>"$log"
python3 - "$out" <<'EOF' 2>&1 | tee "$out/pool_summary.txt" | tee -a "$log"
import json, sys, os
out = sys.argv[1]
ov = json.load(open(os.path.join(out, "pool_overhead.json")))
print("device:", ov["context"].get("device", "?"), "| host:", ov["context"].get("host_name", "?"))
med = {}
for b in ov["benchmarks"]:
    if b.get("aggregate_name") == "median":
        # run names look like BM_pool_run/launch/1/iterations:2000/manual_time
        parts = [x for x in b["run_name"].split("/") if not x.startswith("iterations:")]
        med["/".join(parts)] = b["real_time"]
print("\nhost time per call (median of 10 repetitions, ns); overhead = variant - raw")
print(f"{'variant':<8} {'keys':>4} {'raw':>8} {'pool':>8} {'runner':>8} {'pool-raw':>9} {'runner-raw':>10}")
for variant in ("launch", "push"):
    for keys in (1, 16):
        r = lambda n: med.get(f"BM_{n}/{variant}/{keys}/manual_time", float("nan"))
        raw, pool, run = r("raw_launch"), r("pool_run"), r("runner_run")
        print(f"{variant:<8} {keys:>4} {raw:8.1f} {pool:8.1f} {run:8.1f} {pool-raw:9.1f} {run-raw:10.1f}")
cap = json.load(open(os.path.join(out, "pool_capture.json")))
print("\n400-kernel step, per bucket (median of 3 repetitions of 24 graphs)")
print(f"{'bench':<22} {'bucket':>6} {'capture ms':>10} {'inst ms':>8} {'total ms':>9} {'bytes/graph':>12} {'pool probe B':>12}")
for b in cap["benchmarks"]:
    if b.get("aggregate_name") != "median":
        continue
    name, bucket = b["run_name"].split("/")[0], b["run_name"].split("/")[1]
    print(f"{name:<22} {bucket:>6} {b['capture_ms']:10.3f} {b['instantiate_ms']:8.3f} {b['real_time']:9.3f} "
          f"{b['bytes_per_graph']:12.0f} {b.get('pool_device_bytes_per_graph', float('nan')):12.0f}")
EOF
fi
say "done in $(( $(date +%s) - t0 )) s"
