#!/usr/bin/env bash
# The NanoGPT per-step speedup across processes: the eager step's host launch cost moves by up to
# ±15% from one process to the next, so one process's ratio is one sample. Runs ROUNDS rounds of
# `nanogpt --bench` alternating the metadata paths (META, default "device mapped"), one process each,
# and prints each process's medium_generation line and, per path, the median over processes of the
# eager step, the graph step and the per-step speedup.
#   source .deps/tools/env.sh && NG=build/examples/nanogpt/nanogpt bash scripts/gpu-nanogpt-ab.sh
set -uo pipefail
NG=${NG:-build-gpu-nanogpt/examples/nanogpt/nanogpt}
ROUNDS=${ROUNDS:-8}
META=${META:-device mapped}
log=$(mktemp)
for r in $(seq 1 "$ROUNDS"); do
  for m in $META; do
    "$NG" --bench --meta "$m" 2>&1 | grep "^medium_generation per step" | sed "s/^/round $r: /" | tee -a "$log"
  done
done
python3 - "$log" <<'PY'
import re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.search(r"meta (\S+?)[\],].*eager ([\d.]+) µs, graph ([\d.]+) µs, ([\d.]+)x", line)
    if m:
        rows.setdefault(m.group(1), []).append(tuple(float(m.group(i)) for i in (2, 3, 4)))
for meta, v in rows.items():
    e, g, x = (statistics.median(c) for c in zip(*v))
    print(f"meta {meta}: {len(v)} processes, medians: eager {e:.2f} µs, graph {g:.2f} µs, per-step speedup {x:.2f}x "
          f"(range {min(t[2] for t in v):.2f}-{max(t[2] for t in v):.2f}x)")
PY
