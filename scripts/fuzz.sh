#!/usr/bin/env bash
# Builds the libFuzzer harnesses of fuzz/ with clang (ASan + UBSan) and runs each for a while.
#
#   bash scripts/fuzz.sh [SECONDS_PER_HARNESS] [HARNESS...]     (default: 60 s, all four)
#
# Each harness starts from its committed corpus fuzz/corpus/NAME and keeps what it finds in
# build-fuzz/NAME/corpus (not committed). A crash, a sanitizer report or a timeout stops that harness
# and leaves the input in build-fuzz/NAME/ (crash-*, timeout-*, oom-*); fix the code, then commit the
# input as fuzz/corpus/NAME/regress_<what> so that the CI replay (ctest -R fuzz_replay) keeps it.
# Prints the executions of every harness and exits non-zero if any found something.
set -uo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
shift || true
harnesses=("$@")
[ ${#harnesses[@]} -eq 0 ] && harnesses=(safetensors_header safetensors_file sharded_index hf_config)
cxx=${CXX_FUZZ:-$(command -v clang++-14 || command -v clang++)}
out=${FUZZ_DIR:-build-fuzz}
mkdir -p "$out"
status=0
for h in "${harnesses[@]}"; do
  dir="$out/$h"
  mkdir -p "$dir/corpus"
  echo "== $h: building"
  "$cxx" -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -fno-omit-frame-pointer -DFMT_HEADER_ONLY -Iexamples -Iinclude "fuzz/$h.cpp" -o "$dir/fuzz_$h" || exit 1
  echo "== $h: fuzzing for $seconds s"
  (cd "$dir" && UBSAN_OPTIONS=print_stacktrace=1 ./"fuzz_$h" -max_total_time="$seconds" -timeout=10 \
     -rss_limit_mb=4096 -max_len=65536 -print_final_stats=1 corpus "$OLDPWD/fuzz/corpus/$h") \
     > "$dir/log.txt" 2>&1
  rc=$?
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$dir/log.txt" | grep -o '[0-9]*$')
  if [ $rc -eq 0 ]; then
    echo "== $h: ${runs:-?} executions, no findings"
  else
    status=1
    echo "== $h: FINDING (exit $rc) after ${runs:-?} executions; see $dir/log.txt and $dir/crash-*"
    grep -m5 -E 'ERROR|runtime error|Test unit written' "$dir/log.txt"
  fi
done
exit $status
