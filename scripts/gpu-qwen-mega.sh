#!/usr/bin/env bash
# The persistent kernel (--kernels mega) on the GPU machine: its GPU tests, then an A/B bench against
# the ring kernels. From the repo root, after `source .deps/tools/env.sh`:
#   BIN_DIR=dir bash scripts/gpu-qwen-mega.sh [tests|bench|all]
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"
bin=${BIN_DIR:-build-gpu-qwen/examples/qwen}
stage=${1:-all}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "$stage" = tests ] || [ "$stage" = all ]; then
  QWEN_TEST_KERNELS=mega timeout 300 "$bin/qwen_gpu" -tc='the persistent kernel*,eager and graph*,padding rows*' \
    >"$out/mega_tests.log" 2>&1
  echo "tests exit $?"; tail -4 "$out/mega_tests.log"; grep -E "ERROR|error|FAIL" "$out/mega_tests.log" | head -20
fi
if [ "$stage" = bench ] || [ "$stage" = all ]; then
  KERNELS="${KERNELS:-mega ring}" ROUNDS=${ROUNDS:-1} BIN_DIR="$bin" bash scripts/gpu-qwen-ab.sh
fi
