#!/usr/bin/env bash
# The test command: installs missing Debian packages, configures, builds everything (library
# checks, tests, examples, benchmarks) and runs CTest. GPU tests report "Skipped" on machines
# without a GPU. Usage: bash scripts/test.sh [extra cmake args]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install-deps.sh
build=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -UREPLAY_EXAMPLES "$@"
cmake --build "$build" -j "$jobs"
ctest --test-dir "$build" --output-on-failure -j "$jobs"
