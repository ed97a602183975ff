#!/usr/bin/env bash
# The demo command: installs missing Debian packages, builds the main demo (the NanoGPT decoder,
# eager vs CUDA-graph decode with the shipped Shakespeare weights) and runs it. Arguments are passed
# to the program (try --bench). Exits non-zero with a clear message on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install-deps.sh
build=${BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -UREPLAY_EXAMPLES >/dev/null
cmake --build "$build" -j "$(nproc)" --target nanogpt
exec "$build/examples/nanogpt/nanogpt" "$@"
