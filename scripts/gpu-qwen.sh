#!/usr/bin/env bash
# Qwen example on the GPU machine, from the repo root (see ../shared/device/README.md):
#   source .deps/tools/env.sh && bash scripts/gpu-qwen.sh [stages...]
# Stages (default: all): test (GPU test + host tests), memcheck (GPU test under compute-sanitizer),
# parity (examples/qwen/parity.py against transformers), demo (staggered batch), bench (0.6B and 4B
# shapes: batch-1 TPOT vs D2D bandwidth, batched throughput), nopdl (batch-1 bench without PDL),
# longctx (batch-1 bench after a 2000-token prompt), bench1 (batch-1 bench only), variants (batch-1 TPOT of
# every decode-kernel variant and streaming-kernel setting, 0.6B and 4B, summarised in variants.md).
# Logs and JSON go to $OUT (or ./out): qwen.log (everything), parity.json, bench_qwen3-0.6b.json,
# bench_qwen3-4b.json, variants.md.
# BIN_DIR=dir: use prebuilt qwen, qwen_gpu, qwen_host from dir when they run here (skips the build).
# QWEN_KERNELS picks the decode kernels of the qwen CLI (and so of parity.py); default: step.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
build=${BUILD_DIR:-build-gpu-qwen}
stages=${*:-test parity demo bench nopdl longctx memcheck}
log="$out/qwen.log"
: >"$log"
say() { echo "$@" | tee -a "$log"; }
run() { say "\$ $*"; "$@" 2>&1 | tee -a "$log"; local rc=${PIPESTATUS[0]}; say "(exit $rc)"; return $rc; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee -a "$log"
t0=$(date +%s)
bin="$build/examples/qwen"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64:/usr/local/cuda/lib"
if [ -n "${BIN_DIR:-}" ] && "$BIN_DIR/qwen" --help >/dev/null 2>&1 && "$BIN_DIR/qwen_gpu" --help >/dev/null 2>&1; then
  bin="$BIN_DIR"; say "using prebuilt binaries from $BIN_DIR"
else
  [ -n "${BIN_DIR:-}" ] && say "prebuilt binaries in $BIN_DIR do not run here: $("$BIN_DIR/qwen" --help 2>&1 | head -2)"
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DREPLAY_EXAMPLES="common;qwen" -DREPLAY_BUILD_BENCHMARKS=OFF >"$out/configure.log" 2>&1 \
    || { tail -30 "$out/configure.log"; exit 1; }
  cmake --build "$build" -j16 --target qwen qwen_gpu qwen_host >"$out/build.log" 2>&1 \
    || { grep -E "error|FAILED" "$out/build.log" | head -40; exit 1; }
  say "build: $(( $(date +%s) - t0 )) s"; rm -f "$out/configure.log" "$out/build.log"
fi
q="$bin/qwen"
for s in $stages; do
  case $s in
    test)
      run "$bin/qwen_host"
      run timeout 300 "$bin/qwen_gpu" ;;
    memcheck)
      run timeout 240 compute-sanitizer --tool memcheck --error-exitcode 1 "$bin/qwen_gpu"
      run timeout 90 compute-sanitizer --tool memcheck --error-exitcode 1 "$q" --preset tiny --demo --mode both --quiet ;;
    parity)
      PYTHONUNBUFFERED=1 run timeout 200 python3 examples/qwen/parity.py --bin "$q" --out "$out/parity.json" ;;
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
      for k in legacy step; do
        run timeout 120 "$q" --preset qwen3-0.6b --bench --random-prompt 2000 --gen 64 --bench-batches 1 --kv-mem-mb 4096 \
          --kernels $k
      done ;;
    variants)  # batch-1 TPOT of each decode-kernel variant in one run of the machine, then a summary table
      vdir=$(mktemp -d)
      for shape in qwen3-0.6b qwen3-4b; do
        kv=4096; [ $shape = qwen3-4b ] && kv=8192
        for v in "legacy" "legacy8" "phase" "layer" "step" "step --stream-tile-kb 24" "step --stream-tile-kb 64" \
                 "step --stream-slots 3"; do
          tag=$(echo "$v" | tr -d ' -' | sed 's/streamtilekb/t/; s/streamslots/s/')
          run timeout 120 "$q" --preset $shape --bench --random-prompt 16 --gen 128 --bench-batches 1 --kv-mem-mb $kv \
            --kernels $v --json "$vdir/${shape}_${tag}.json"
        done
      done
      python3 - "$vdir" "$out/variants.md" <<'PY' | tee -a "$log"
import json, os, sys
d, dst = sys.argv[1], sys.argv[2]
rows = ["| shape | variant | eager TPOT (ms) | graph TPOT (ms) | graph % of D2D | D2D (GB/s) | kernels |",
        "|---|---|---:|---:|---:|---:|---|"]
for f in sorted(os.listdir(d)):
    j = json.load(open(os.path.join(d, f)))
    b = j["bench"]["batch1"]
    shape, tag = f[:-5].split("_", 1)
    rows.append(f"| {shape} | {tag} | {b['eager']['tpot_ms']:.3f} | {b['graph']['tpot_ms']:.3f} | "
                f"{b['graph']['pct_d2d']:.1f} | {j['bench']['d2d_GBps']:.0f} | {j['kernels']} |")
open(dst, "w").write("\n".join(rows) + "\n")
print("\n".join(rows))
PY
      ;;
    *) say "unknown stage $s" ;;
  esac
done
say "done in $(( $(date +%s) - t0 )) s"
