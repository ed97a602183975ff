#!/usr/bin/env bash
# The benchmark suite in one command: builds every benchmark program (benchmarks/*.cu), runs each
# on the GPU writing Google Benchmark JSON, then writes docs/benchmarks.md and its plots.
#
#   bash benchmarks/run.sh                 # full suite, about 3-4 minutes on an H100
#   QUICK=1 bash benchmarks/run.sh         # one repetition, shorter runs (a smoke test)
#
# Settings (environment): BUILD_DIR (build-bench), RESULTS ($BUILD_DIR/results), REPS (5 repetitions,
# medians reported), MIN_TIME (0.05 s per launch-overhead benchmark and repetition), FILTER (a
# --benchmark_filter regex), OTHER_REPS / OTHER_MIN_TIME (3 / 0.01 for programs other than
# launch_overhead and decode_step), PROGRAMS ("launch_overhead decode_step ..."; default: all),
# DOCS (docs: where benchmarks.md and img/ go), NO_REPORT=1 (JSON only), CMAKE_ARGS (extra configure
# arguments, e.g. -DCMAKE_CUDA_ARCHITECTURES=90). Without an NVIDIA GPU it says so and exits 2.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=${BUILD_DIR:-build-bench}
results=${RESULTS:-$build/results}
docs=${DOCS:-docs}
if [ -n "${QUICK:-}" ]; then reps=${REPS:-1}; min_time=${MIN_TIME:-0.01}; else reps=${REPS:-5}; min_time=${MIN_TIME:-0.05}; fi

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "benchmarks/run.sh: no NVIDIA GPU found; the benchmarks measure kernel launches and need one." >&2
  exit 2
fi
# The driver release for the report's stamp (the CUDA runtime API only gives the CUDA version),
# passed to every program as benchmark context.
driver_release=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv

# Debian packages (skipped where CMake finds them elsewhere, e.g. the unpacked .deps of the GPU machine).
if [ -z "${DEPS_ROOT:-}" ] && [ -f scripts/install-deps.sh ]; then source scripts/install-deps.sh; fi

gen=(); command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
# shellcheck disable=SC2086
cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DREPLAY_BUILD_BENCHMARKS=ON ${CMAKE_ARGS:-} >/dev/null
if [ -n "${PROGRAMS:-}" ]; then
  read -r -a progs <<<"$PROGRAMS"
else
  progs=()
  # The suite's own programs first (their order in the report), then any others.
  for p in launch_overhead decode_step; do [ -f "benchmarks/$p.cu" ] && progs+=("$p"); done
  for f in benchmarks/*.cu; do
    p=$(basename "$f" .cu)
    [[ " ${progs[*]} " == *" $p "* ]] || progs+=("$p")
  done
fi
targets=(); for p in "${progs[@]}"; do targets+=("bench_$p"); done
if ! cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"; then
  # One program does not build (a half-done one, say): build them one by one and run those that do.
  echo "building all benchmark programs failed; building them one at a time" >&2
  built=()
  for p in "${progs[@]}"; do
    if cmake --build "$build" -j "$(nproc)" --target "bench_$p" >/dev/null 2>&1; then built+=("$p"); else echo "skipping bench_$p: it does not build" >&2; fi
  done
  progs=("${built[@]}")
fi

mkdir -p "$results"
ran=()
for p in "${progs[@]}"; do
  exe="$build/benchmarks/bench_$p"
  out="$results/$p.json"
  # The suite's own programs get REPS / MIN_TIME; the pool programs, whose manual time
  # is a small part of their wall time, get fewer repetitions and a shorter minimum so the suite
  # stays within a few minutes. Programs with fixed iteration counts ignore MIN_TIME.
  case $p in
    launch_overhead|decode_step) r=$reps; m=$min_time ;;
    *) r=${OTHER_REPS:-3}; m=${OTHER_MIN_TIME:-0.01} ;;
  esac
  args=(--benchmark_repetitions="$r" --benchmark_report_aggregates_only=true --benchmark_min_time="$m"
        --benchmark_out="$out" --benchmark_out_format=json --benchmark_counters_tabular=true
        --benchmark_context=driver="$driver_release")
  [ -n "${FILTER:-}" ] && args+=(--benchmark_filter="$FILTER")
  echo "== $p"
  t0=$(date +%s)
  if "$exe" "${args[@]}"; then ran+=("$out"); else echo "bench_$p failed (exit $?)" >&2; fi
  echo "== $p: $(( $(date +%s) - t0 )) s"
done

if [ -n "${NO_REPORT:-}" ] || ((${#ran[@]} == 0)); then exit 0; fi
if python3 -c "import matplotlib" 2>/dev/null; then
  python3 benchmarks/report.py "${ran[@]}" --out "$docs/benchmarks.md" --img "$docs/img"
else
  python3 benchmarks/report.py "${ran[@]}" --out "$docs/benchmarks.md" --no-plots
  echo "matplotlib is missing (pip install matplotlib): wrote the tables without plots" >&2
fi
echo "results: $root/$results; report: $root/$docs/benchmarks.md"
