#!/usr/bin/env bash
# The qwen checks with binaries built on the CPU machine and carried along xz-compressed (a build of
# the qwen targets is ~20 MB per binary; three of them plus .deps exceed what a device call carries).
# On the CPU machine, from the repo root (build dirs configured with -DCMAKE_CUDA_ARCHITECTURES=90):
#   mkdir -p build-carry/qx
#   strip -o /tmp/q build-qwen/examples/qwen/qwen && xz -c /tmp/q > build-carry/qx/qwen.xz   # likewise:
#   qwen_gpu.xz (the GPU test), qwen_base.xz (a build to compare against), qwen_trace.xz (a build
#   configured with -DQWEN_MEGA_TRACE=ON), qwen_var_NAME.xz (more builds for the A/B, e.g. another
#   QWEN_MEGA_WARPS)
# On the GPU machine, after `source .deps/tools/env.sh` (carry .deps and build-carry):
#   bash scripts/gpu-qwen-carried.sh [mega stages...]   (default: tests sanitize parity)
# Unpacks to $UNPACK (default /tmp/qb): new/{qwen,qwen_gpu}, base/qwen, trace/qwen; runs
# scripts/gpu-qwen-mega.sh on new/ with the given stages; then, when qwen_base.xz was carried, an A/B
# of base and new (scripts/gpu-qwen-variants.sh, ROUNDS rounds, alternating processes) and, when
# qwen_trace.xz was carried, one traced run per shape.
set -uo pipefail
src=${CARRY_DIR:-build-carry/qx}
dst=${UNPACK:-/tmp/qb}
mkdir -p "$dst/new" "$dst/base" "$dst/trace"
unpack() {  # NAME DIR NEWNAME
  [ -f "$src/$1.xz" ] || return 1
  xz -dc "$src/$1.xz" > "$dst/$2/$3" && chmod +x "$dst/$2/$3"
}
unpack qwen new qwen || { echo "no $src/qwen.xz"; exit 2; }
unpack qwen_gpu new qwen_gpu
has_base=0; unpack qwen_base base qwen && has_base=1
has_trace=0; unpack qwen_trace trace qwen && has_trace=1
BIN_DIR="$dst/new" bash scripts/gpu-qwen-mega.sh ${*:-tests sanitize parity}
# Further builds to compare, carried as qwen_var_NAME.xz: joined to the A/B as qwen_NAME.
vars=""
for v in "$src"/qwen_var_*.xz; do
  [ -f "$v" ] || continue
  n=$(basename "$v" .xz); n=${n#qwen_var_}
  mkdir -p "$dst/ab" && xz -dc "$v" > "$dst/ab/qwen_$n" && chmod +x "$dst/ab/qwen_$n" && vars="$vars $dst/ab/qwen_$n"
done
if [ $has_base = 1 ]; then
  mkdir -p "$dst/ab" && ln -sf "$dst/base/qwen" "$dst/ab/qwen_base" && ln -sf "$dst/new/qwen" "$dst/ab/qwen_new"
  BINS="$dst/ab/qwen_base $dst/ab/qwen_new$vars" KERNELS=mega ROUNDS=${ROUNDS:-3} bash scripts/gpu-qwen-variants.sh
fi
if [ $has_trace = 1 ]; then
  mkdir -p "$dst/tr" && ln -sf "$dst/trace/qwen" "$dst/tr/qwen_trace"
  BINS="$dst/tr/qwen_trace" ROUNDS=0 TRACE=1 bash scripts/gpu-qwen-variants.sh
fi
