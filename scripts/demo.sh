#!/usr/bin/env bash
# The demo command: installs missing Debian packages, builds the main demo and runs it.
# Exits non-zero with a clear message on a machine without an NVIDIA GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install-deps.sh
build=${BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$(nproc)" --target launch_overhead
exec "$build/examples/launch_overhead/launch_overhead" "$@"
