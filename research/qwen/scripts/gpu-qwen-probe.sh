#!/usr/bin/env bash
# Where the persistent kernel's step goes, and A/B of its settings (docs/perf-notes.md).
# On the GPU machine, after `source .deps/tools/env.sh`, with build-carry/qx/qwen.xz carried (and
# optionally qwen_gpu.xz, qwen_base.xz: a build to compare against, qwen_trace.xz: a build configured
# with -DQWEN_MEGA_TRACE=ON -DQWEN_MEGA_PROF=ON; scripts/gpu-qwen-carried.sh says how to make them):
#   TESTS="*persistent*" VARIANTS="base new p0:QWEN_MEGA_PACE=0 p250:QWEN_MEGA_PACE=250,QWEN_MEGA_SLOTS=5" \
#     ROUNDS=2 bash scripts/gpu-qwen-probe.sh
# TESTS: first the GPU test's cases that match (doctest -tc). Then one traced run per shape (with
# qwen_trace.xz), then the A/B (scripts/gpu-qwen-variants.sh, alternating processes) of VARIANTS:
# `base`, `new`, NAME:VAR=value[,VAR=value...] (the new build with those environment settings; an
# item --flag is passed to the CLI instead, e.g. rows:--mega-rows), or
# v:X[:VAR=value,...] (the build carried as qwen_var_X.xz, with those settings).
set -uo pipefail
src=${CARRY_DIR:-build-carry/qx}
d=${UNPACK:-/tmp/qprobe}
out=${OUT:-out}; mkdir -p "$out" "$d/tr" "$d/ab"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"
xz -dc "$src/qwen.xz" > "$d/qwen" && chmod +x "$d/qwen"
if [ -n "${TESTS:-}" ]; then
  xz -dc "$src/qwen_gpu.xz" > "$d/qwen_gpu" && chmod +x "$d/qwen_gpu"
  timeout 500 "$d/qwen_gpu" -tc="$TESTS" >"$out/qwen_gpu_probe.log" 2>&1
  echo "qwen_gpu -tc='$TESTS' exit $?"; grep -E "^\[doctest\] (test cases|assertions)|ERROR|FAILED" "$out/qwen_gpu_probe.log" | head -20
fi
if [ -f "$src/qwen_trace.xz" ]; then
  xz -dc "$src/qwen_trace.xz" > "$d/tr/qwen_trace" && chmod +x "$d/tr/qwen_trace"
  BINS="$d/tr/qwen_trace" ROUNDS=0 TRACE=1 bash scripts/gpu-qwen-variants.sh
fi
for shape in ${SHAPES:-qwen3-0.6b qwen3-4b}; do
  "$d/qwen" --preset "$shape" --bench --random-prompt 16 --gen 4 --bench-batches 1 --kv-mem-mb 2048 --kernels mega 2>&1 |
    grep -E "^decode kernels" | head -1
done
bins=""
for v in ${VARIANTS:-new}; do
  case $v in
    base) xz -dc "$src/qwen_base.xz" > "$d/ab/qwen_base" && chmod +x "$d/ab/qwen_base" && bins="$bins $d/ab/qwen_base" ;;
    new) ln -sf "$d/qwen" "$d/ab/qwen_new" && bins="$bins $d/ab/qwen_new" ;;
    v:*) n=${v#v:}; envs=""; [[ $n == *:* ]] && envs=${n#*:} && n=${n%%:*}  # v:X[:VAR=value,...]: qwen_var_X.xz
         xz -dc "$src/qwen_var_$n.xz" > "$d/ab/qwen_var_$n" && chmod +x "$d/ab/qwen_var_$n"
         w="$d/ab/qwen_v$n${envs:+.${envs//[=,]/-}}"
         printf '#!/bin/sh\nexec env %s %s "$@"\n' "${envs//,/ }" "$d/ab/qwen_var_$n" > "$w" && chmod +x "$w"
         bins="$bins $w" ;;
    *:*) n=${v%%:*}; envs=""; args=""  # settings VAR=value, or --flag: an argument of the CLI
         IFS=, read -ra xs <<< "${v#*:}"
         for x in "${xs[@]}"; do case $x in --*) args="$args $x" ;; *) envs="$envs $x" ;; esac; done
         printf '#!/bin/sh\nexec env %s %s "$@"%s\n' "$envs" "$d/qwen" "$args" > "$d/ab/qwen_$n" && chmod +x "$d/ab/qwen_$n"
         bins="$bins $d/ab/qwen_$n" ;;
  esac
done
[ "${ROUNDS:-2}" -gt 0 ] && BINS="$bins" KERNELS=mega bash scripts/gpu-qwen-variants.sh
exit 0
