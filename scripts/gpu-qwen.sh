#!/usr/bin/env bash
# Qwen example on the GPU machine, from the repo root (see ../shared/device/README.md):
#   source .deps/tools/env.sh && bash scripts/gpu-qwen.sh [stages...]
# Stages (default: all): test (GPU test + host tests), memcheck (GPU test under compute-sanitizer),
# parity (examples/qwen/parity.py against transformers), demo (staggered batch), bench (0.6B and 4B
# shapes: batch-1 TPOT vs D2D bandwidth, batched throughput), nopdl (batch-1 bench without PDL),
# longctx (batch-1 bench after a 2000-token prompt), bench1 (batch-1 bench only). Logs and JSON go to $OUT (or ./out):
# qwen.log (everything), parity.json, bench_qwen3-0.6b.json, bench_qwen3-4b.json.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
build=${BUILD_DIR:-build-gpu-qwen}
stages=${*:-test parity demo bench nopdl longctx memcheck}
log="$out/qwen.log"
: >"$log"
say() { echo "$@" | tee -a "$log"; }
run() { say "\$ $*"; "$@" 2>&1 | tee -a "$log"; local rc=${PIPESTATUS[0]}; say "(exit $rc)"; return $rc; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee -a "$log"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DREPLAY_EXAMPLES="common;qwen" -DREPLAY_BUILD_BENCHMARKS=OFF >"$out/configure.log" 2>&1 \
  || { tail -30 "$out/configure.log"; exit 1; }
t0=$(date +%s)
cmake --build "$build" -j16 --target qwen qwen_gpu qwen_host >"$out/build.log" 2>&1 \
  || { grep -E "error|FAILED" "$out/build.log" | head -40; exit 1; }
say "build: $(( $(date +%s) - t0 )) s"; rm -f "$out/configure.log" "$out/build.log"
q="$build/examples/qwen/qwen"
for s in $stages; do
  case $s in
    test)
      run "$build/examples/qwen/qwen_host"
      run "$build/examples/qwen/qwen_gpu" ;;
    memcheck)
      run compute-sanitizer --tool memcheck --error-exitcode 1 "$build/examples/qwen/qwen_gpu"
      run compute-sanitizer --tool memcheck --error-exitcode 1 "$q" --preset tiny --demo --mode both --quiet ;;
    parity)
      PYTHONUNBUFFERED=1 run python3 examples/qwen/parity.py --bin "$q" --out "$out/parity.json" ;;
    demo)
      run "$q" --preset tiny --demo --mode both
      run "$q" --preset qwen3-0.6b --batch 3 --random-prompt 12 --gen 40 --mode both
      run "$q" --preset tiny --batch 80 --gen 4 --no-eager-fallback ;;  # must fail: batch > bucket
    bench)
      run "$q" --preset qwen3-0.6b --bench --random-prompt 16 --gen 128 --bench-batches 1,8,32,64 \
        --kv-mem-mb 4096 --json "$out/bench_qwen3-0.6b.json"
      run "$q" --preset qwen3-4b --bench --random-prompt 16 --gen 128 --bench-batches 1,8,32,64 \
        --kv-mem-mb 8192 --json "$out/bench_qwen3-4b.json" ;;
    bench1)  # batch-1 only (quick re-measure after a kernel change)
      run "$q" --preset qwen3-0.6b --bench --random-prompt 16 --gen 128 --bench-batches 1 --kv-mem-mb 4096
      run "$q" --preset qwen3-4b --bench --random-prompt 16 --gen 128 --bench-batches 1 --kv-mem-mb 8192 ;;
    nopdl)  # the same batch-1 bench with programmatic dependent launch off, for comparison
      run "$q" --preset qwen3-0.6b --bench --no-pdl --random-prompt 16 --gen 128 --bench-batches 1 --kv-mem-mb 4096
      run "$q" --preset qwen3-4b --bench --no-pdl --random-prompt 16 --gen 128 --bench-batches 1 --kv-mem-mb 8192 ;;
    longctx)  # attention cost grows with the context: batch-1 TPOT after a 2000-token prompt
      run "$q" --preset qwen3-0.6b --bench --random-prompt 2000 --gen 64 --bench-batches 1 --kv-mem-mb 4096 ;;
    *) say "unknown stage $s" ;;
  esac
done
say "done in $(( $(date +%s) - t0 )) s"
