#!/usr/bin/env bash
# A/B of several builds of the qwen CLI (e.g. variants of the persistent kernel) at batch 1,
# alternating processes, on the GPU machine (from the repo root, after `source .deps/tools/env.sh`):
#   BINS="dir/qwen_a dir/qwen_b" KERNELS=mega ROUNDS=2 SHAPES="qwen3-0.6b qwen3-4b" TRACE=1 \
#     bash scripts/gpu-qwen-variants.sh
# One line per run (binary, shape, eager and graph TPOT); TRACE=1 adds one QWEN_MEGA_TRACE run per
# binary and shape (its per-phase summary; binaries configured with -DQWEN_MEGA_TRACE=ON); with
# TRACE_MODES="default rows" one traced run per mode (rows: --mega-rows).
# ENVS="QWEN_MEGA_WARM=0 QWEN_MEGA_WARM=4": run each binary once per environment setting (space
# separated; "-" for none), alternating like the binaries.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for round in $(seq 1 "${ROUNDS:-2}"); do
  for shape in ${SHAPES:-qwen3-0.6b qwen3-4b}; do
    kv=4096; [ "$shape" = qwen3-4b ] && kv=8192
    for b in $BINS; do
      for e in ${ENVS:--}; do
      for k in ${KERNELS:-mega}; do
        n=$(basename "$b"); [ "$e" != - ] && n="$n.${e//=/-}"  # (no '=' in the log's name)
        # shellcheck disable=SC2086  # $e: one VAR=value setting
        env ${e#-} timeout 150 "$b" --preset "$shape" --bench --random-prompt ${PROMPT:-16} --gen 128 --bench-batches 1 \
          --kv-mem-mb $kv --kernels "$k" ${EXTRA:-} >"$out/var_${shape}_${n}_${k}_${round}.log" 2>&1
        echo "round $round $shape $n $k exit $? $(grep -E '^\| (eager|graph) ' "$out/var_${shape}_${n}_${k}_${round}.log" | tr -s ' ' | tr '\n' ' ')"
      done
      done
    done
  done
done
if [ "${TRACE:-0}" = 1 ]; then
  for shape in ${SHAPES:-qwen3-0.6b qwen3-4b}; do
    kv=4096; [ "$shape" = qwen3-4b ] && kv=8192
    for b in $BINS; do
      for m in ${TRACE_MODES:-default}; do  # default, rows (--mega-rows)
        n=$(basename "$b").$m; a=""; [ "$m" = rows ] && a=--mega-rows
        QWEN_MEGA_TRACE=1 timeout 150 "$b" --preset "$shape" --bench --random-prompt 16 --gen 128 \
          --bench-batches 1 --kv-mem-mb $kv --kernels mega $a >"$out/trace_${shape}_${n}.log" 2>&1
        echo "== trace $shape $n"; grep -E "mega trace|^  [a-z]|^decode kernels|^\| graph " "$out/trace_${shape}_${n}.log"
      done
    done
  done
fi
