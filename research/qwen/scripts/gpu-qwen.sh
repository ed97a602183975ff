#!/usr/bin/env bash
# Qwen example on the GPU machine, from the repo root (see ../shared/device/README.md):
#   source .deps/tools/env.sh && bash scripts/gpu-qwen.sh [stages...]
# Stages (default: test parity demo bench nopdl longctx memcheck):
#   test      host tests + GPU test (every decode-kernel variant: eager == graph, streaming == legacy)
#   memcheck  the GPU test and the staggered demo under compute-sanitizer
#   parity    examples/qwen/parity.py against transformers (parity.json)
#   parity_small  the same with 2 KiB streaming tiles (GEMV items of 1-4 rows; parity_small.json)
#   demo      staggered batch; bench: 0.6B and 4B batch-1 TPOT vs D2D and batched throughput
#   bench1    batch-1 bench only; nopdl: batch-1 bench without PDL
#   gemv      batch-1/2/4 TPOT of the ring GEMV (ring, default), the pipelined per-row GEMV (rowpipe) and the
#             per-row GEMV (legacy)
#   nsys      per-kernel GPU time summary and trace tail of a 0.6B / 4B graph bench (if nsys is installed)
#   gemvfloor each decode GEMV's per-kernel cost in a graph against a streaming read of its bytes
#             (qwen_gemv_floor, 0.6B and 4B, 1 and 4 rows; gemv_floor.md)
#   longctx   batch-1 TPOT after a 2000-token prompt, default (ring), rowpipe, legacy and streaming kernels
#   variants  batch-1 TPOT of every decode-kernel variant and streaming setting, 0.6B and 4B, plus a
#             phase-completion trace of the streaming kernel (variants.md)
#   xcheck    teacher-forced logits of the 0.6B and 4B shapes (random weights), every variant against the
#             legacy kernels; bar 2e-2 as parity.py's: with bf16 activations two fp32 summation orders
#             differ by 4e-3 (0.6B) to 1.2e-2 (4B)
# Logs and JSON go to $OUT (or ./out): qwen.log (everything), parity*.json, bench_*.json, variants.md.
# BIN_DIR=dir: use prebuilt qwen, qwen_gpu, qwen_host (and qwen_gemv_floor) from dir when they run here (skips the build).
# QWEN_KERNELS, QWEN_STREAM_TILE_KB, QWEN_STREAM_SLOTS, QWEN_STREAM_TRACE: defaults of the qwen CLI
# (and so of parity.py); QWEN_TEST_KERNELS: the GPU test's variants.
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
  cmake --build "$build" -j16 --target qwen qwen_gpu qwen_host qwen_gemv_floor >"$out/build.log" 2>&1 \
    || { grep -E "error|FAILED" "$out/build.log" | head -40; exit 1; }
  say "build: $(( $(date +%s) - t0 )) s"; rm -f "$out/configure.log" "$out/build.log"
fi
q="$bin/qwen"
for s in $stages; do
  case $s in
    test)
      run "$bin/qwen_host"
      run timeout 300 "$bin/qwen_gpu"
      QWEN_RING=all run timeout 120 "$bin/qwen_gpu" -tc="the ring*" ;;  # rings that wrap and refill
    memcheck)
      run timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 "$bin/qwen_gpu"
      run timeout 90 compute-sanitizer --tool memcheck --error-exitcode 1 "$q" --preset tiny --demo --mode both --quiet ;;
    parity)
      PYTHONUNBUFFERED=1 run timeout 200 python3 examples/qwen/parity.py --bin "$q" --out "$out/parity.json" ;;
    parity_small)
      QWEN_STREAM_TILE_KB=2 PYTHONUNBUFFERED=1 run timeout 200 python3 examples/qwen/parity.py --bin "$q" \
        --out "$out/parity_small.json" ;;
    xcheck)
      xdir=$(mktemp -d)
      for shape in qwen3-0.6b qwen3-4b; do
        IFS=',' read -ra xv <<<"${XCHECK_VARIANTS:-legacy,rowpipe,phase,layer,step,step --stream-tile-kb 8,step --stream-slots 2}"
        for v in "${xv[@]}"; do
          tag=$(echo "$v" | tr -d ' -' | sed 's/streamtilekb/t/; s/streamslots/s/')
          run timeout 120 "$q" --preset $shape --random-prompt 40 --teacher-force 8 --mode both --kernels $v \
            --kv-mem-mb 1024 --max-context 256 --quiet --dump-logits "$xdir/${shape}_${tag}.f32"
        done
      done
      python3 - "$xdir" <<'PY' | tee -a "$log"
import os, sys
import numpy as np
d = sys.argv[1]
for shape in ["qwen3-0.6b", "qwen3-4b"]:
    ref_path = f"{d}/{shape}_legacy.f32"
    if not os.path.exists(ref_path):
        print(f"xcheck {shape}: no legacy reference"); continue
    ref = np.fromfile(ref_path, dtype=np.float32).reshape(-1, 151936).astype(np.float64)
    for f in sorted(os.listdir(d)):
        if not f.startswith(shape + "_") or f.endswith("_legacy.f32"): continue
        x = np.fromfile(f"{d}/{f}", dtype=np.float32).reshape(-1, 151936).astype(np.float64)
        rel = np.linalg.norm(x - ref, axis=1) / np.linalg.norm(ref, axis=1)
        agree = int((x.argmax(1) == ref.argmax(1)).sum())
        print(f"xcheck {shape} {f[len(shape)+1:-4]} vs legacy: {len(rel)} teacher-forced steps, max rel L2 {rel.max():.3e}, "
              f"median {np.median(rel):.3e}, argmax agree {agree}/{len(rel)} -> {'PASS' if rel.max() < 2e-2 else 'FAIL'}")
PY
      ;;
    demo)
      run "$q" --preset tiny --demo --mode both
      run "$q" --preset qwen3-0.6b --batch 3 --random-prompt 12 --gen 40 --mode both
      run "$q" --preset tiny --batch 80 --gen 4 --no-eager-fallback ;;  # must fail: batch > bucket
    bench)
      run timeout 150 "$q" --preset qwen3-0.6b --bench --random-prompt 16 --gen 128 --bench-batches 1,2,4,8,32,64 \
        --kv-mem-mb 4096 --json "$out/bench_qwen3-0.6b.json"
      run timeout 150 "$q" --preset qwen3-4b --bench --random-prompt 16 --gen 128 --bench-batches 1,2,4,8,32,64 \
        --kv-mem-mb 8192 --json "$out/bench_qwen3-4b.json" ;;
    bench1)  # batch-1 only (quick re-measure after a kernel change)
      run "$q" --preset qwen3-0.6b --bench --random-prompt 16 --gen 128 --bench-batches 1 --kv-mem-mb 4096
      run "$q" --preset qwen3-4b --bench --random-prompt 16 --gen 128 --bench-batches 1 --kv-mem-mb 8192 ;;
    gemv)  # batch-1/2/4 TPOT, pipelined vs plain per-row GEMV, one process each
      for shape in qwen3-0.6b qwen3-4b; do
        kv=4096; [ $shape = qwen3-4b ] && kv=8192
        for k in ${GEMV_KERNELS:-ring rowpipe legacy}; do
          run timeout 120 "$q" --preset $shape --bench --random-prompt 16 --gen 128 --bench-batches 1,2,4 --kv-mem-mb $kv \
            --kernels $k --json "$out/gemv_${shape}_$k.json"
        done
      done ;;
    nsys)  # per-kernel GPU times of the 0.6B graph step (nsys, graph nodes traced), when nsys is installed
      ns=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
      if [ -z "$ns" ]; then say "nsys: not installed"; else
        for shape in qwen3-0.6b qwen3-4b; do
          run timeout 200 "$ns" profile --cuda-graph-trace=node --force-overwrite true -o "/tmp/prof_$shape" \
            "$q" --preset $shape --bench --random-prompt 16 --gen 32 --bench-batches 1 --kv-mem-mb 4096 --quiet \
            --kernels ${NSYS_KERNELS:-ring}
          "$ns" stats --force-export=true --report cuda_gpu_kern_sum --format csv "/tmp/prof_$shape.nsys-rep" \
            >"$out/nsys_${shape}_kern_sum.csv" 2>&1
          "$ns" stats --report cuda_gpu_trace --format csv "/tmp/prof_$shape.nsys-rep" 2>/dev/null | tail -800 \
            >"$out/nsys_${shape}_trace_tail.csv"
          head -20 "$out/nsys_${shape}_kern_sum.csv" | tee -a "$log"
        done
      fi ;;
    nopdl)  # the same batch-1 bench with programmatic dependent launch off, for comparison
      run "$q" --preset qwen3-0.6b --bench --no-pdl --random-prompt 16 --gen 128 --bench-batches 1 --kv-mem-mb 4096
      run "$q" --preset qwen3-4b --bench --no-pdl --random-prompt 16 --gen 128 --bench-batches 1 --kv-mem-mb 8192 ;;
    splitkv)  # split-KV decode attention off (QWEN_ATTN_SPLITS=1) and on, short and long context, batch 1 and 8
      for shape in qwen3-0.6b qwen3-4b; do
        kv=4096; [ $shape = qwen3-4b ] && kv=8192
        for ctx in 16 2000; do
          for sp in 1 32; do
            QWEN_ATTN_SPLITS=$sp run timeout 120 "$q" --preset $shape --bench --random-prompt $ctx --gen 64 \
              --bench-batches 1,8 --kv-mem-mb $kv --json "$out/splitkv_${shape}_${ctx}_$sp.json"
          done
        done
      done
      for mc in ${SPLITKV_CHUNKS:-64 256}; do  # the fewest positions per block
        QWEN_ATTN_MIN_CHUNK=$mc run timeout 120 "$q" --preset qwen3-0.6b --bench --random-prompt 2000 --gen 64 \
          --bench-batches 1,8 --kv-mem-mb 4096 --json "$out/splitkv_qwen3-0.6b_2000_c$mc.json"
      done ;;
    gemvfloor)
      say "\$ $bin/qwen_gemv_floor --rows 1,4"
      timeout 200 "$bin/qwen_gemv_floor" --rows 1,4 >"$out/gemv_floor.md" 2>&1; rc=$?
      tee -a "$log" <"$out/gemv_floor.md"; say "(exit $rc)" ;;
    longctx)  # attention cost grows with the context: batch-1 TPOT after a 2000-token prompt
      for k in ring rowpipe legacy step; do
        run timeout 120 "$q" --preset qwen3-0.6b --bench --random-prompt 2000 --gen 64 --bench-batches 1 --kv-mem-mb 4096 \
          --kernels $k
      done ;;
    variants)  # batch-1 TPOT of each decode-kernel variant in one run of the machine, then a summary table
      vdir=$(mktemp -d)
      for shape in qwen3-0.6b qwen3-4b; do
        kv=4096; [ $shape = qwen3-4b ] && kv=8192
        for v in "legacy" "phase" "layer" "step" "step --stream-tile-kb 16" "step --stream-tile-kb 24" \
                 "step --stream-tile-kb 64" "step --stream-slots 4"; do
          tag=$(echo "$v" | tr -d ' -' | sed 's/streamtilekb/t/; s/streamslots/s/')
          run timeout 120 "$q" --preset $shape --bench --random-prompt 16 --gen 128 --bench-batches 1 --kv-mem-mb $kv \
            --kernels $v --json "$vdir/${shape}_${tag}.json"
        done
        QWEN_STREAM_TRACE=1 run timeout 120 "$q" --preset $shape --bench --random-prompt 16 --gen 128 --bench-batches 1 \
          --kv-mem-mb $kv --kernels step --json "$vdir/${shape}_steptrace.json"
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
for f in sorted(os.listdir(d)):
    j = json.load(open(os.path.join(d, f)))
    if "stream_trace" in j["bench"]:
        rows.append(f"\n{f[:-5]}: {j['bench']['stream_trace']}")
open(dst, "w").write("\n".join(rows) + "\n")
print("\n".join(rows))
PY
      ;;
    *) say "unknown stage $s" ;;
  esac
done
say "done in $(( $(date +%s) - t0 )) s"
