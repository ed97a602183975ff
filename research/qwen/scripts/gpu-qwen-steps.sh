#!/usr/bin/env bash
# Where a Qwen decode step's GPU time goes, by kernel (Nsight Compute, kernels serialised, base clocks):
#   source .deps/tools/env.sh && BIN_DIR=dir bash scripts/gpu-qwen-steps.sh [preset] [kernels]
# Profiles the decode-step kernels (embed, GEMVs, attention) of two eager decode steps after the
# prefill and sums gpu__time_duration by kernel.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
bin=${BIN_DIR:-build-gpu-qwen/examples/qwen}
preset=${1:-qwen3-0.6b}; kern=${2:-rowpipe}
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"
case $preset in qwen3-4b) layers=36 ;; qwen3-1.7b) layers=28 ;; tiny) layers=4 ;; *) layers=28 ;; esac
per_step=$((5 * layers + 2))
f="$out/steps_${preset}_$kern.csv"
timeout 300 /usr/local/cuda/bin/ncu --csv --page raw --metrics gpu__time_duration.sum --kernel-name "regex:gemv|attention|embed" \
  --launch-skip ${SKIP:-300} \
  --launch-count $((2 * per_step)) "$bin/qwen" --preset "$preset" --random-prompt 8 --gen 40 --kv-mem-mb 512 \
  --max-context 64 --kernels "$kern" --mode eager --quiet >"$f" 2>&1
python3 - "$f" "$per_step" <<'PY'
import csv, sys, collections, re
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
hdr = rows[0]; ki = hdr.index("Kernel Name"); ti = hdr.index("gpu__time_duration.sum")
tot = collections.Counter(); cnt = collections.Counter()
for r in rows[2:]:
    try: t = float(r[ti].replace(",", ""))
    except ValueError: continue
    name = re.sub(r"\(.*", "", r[ki]).split("::")[-1]
    tmpl = re.search(r"<([^>]*)>", r[ki]); name += ("<" + tmpl.group(1) + ">") if tmpl else ""
    tot[name] += t; cnt[name] += 1
steps = 2; all_t = sum(tot.values())
print(f"{sum(cnt.values())} kernels profiled ({steps} steps); GPU time per step {all_t/steps/1e3:.1f} us")
for n, t in tot.most_common():
    print(f"  {t/steps/1e3:8.1f} us/step  {cnt[n]//steps:4d} launches/step  {t/cnt[n]/1e3:7.2f} us each  {n}")
PY
