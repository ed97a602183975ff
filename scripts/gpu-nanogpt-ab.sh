#!/usr/bin/env bash
# The NanoGPT per-step speedup across processes: the eager step's host launch cost moves by up to
# ±15% from one process to the next, so one process's ratio is one sample. Runs ROUNDS rounds of
# `nanogpt --bench`, one process per (binary, metadata path, extra flags) variant, alternating, and
# prints each process's medium_generation line and, per variant, the median over processes of the
# eager step, the graph step and the per-step speedup.
#   NG / BINS  the nanogpt binary, or several to compare builds (BINS="a/nanogpt b/nanogpt")
#   META       metadata paths (default "device mapped")
#   FLAGS      extra flag sets, separated by commas (e.g. FLAGS=",--null-kernels": default and empty
#              kernels); default: none
#   CORES      CPU cores to pin the processes to (taskset -c), one per round in turn (e.g. CORES="0 4 8
#              12"); default: not pinned. The eager step is the host's launch time, so this separates
#              the host core's speed from the code's
#   source .deps/tools/env.sh && NG=build/examples/nanogpt/nanogpt bash scripts/gpu-nanogpt-ab.sh
set -uo pipefail
NG=${NG:-build-gpu-nanogpt/examples/nanogpt/nanogpt}
BINS=${BINS:-$NG}
ROUNDS=${ROUNDS:-8}
META=${META:-device mapped}
FLAGS=${FLAGS:-}
IFS=',' read -r -a flag_sets <<< "$FLAGS"
read -r -a cores <<< "${CORES:-}"
[ ${#flag_sets[@]} -eq 0 ] && flag_sets=("")
log=$(mktemp)
for r in $(seq 1 "$ROUNDS"); do
  pin=()
  [ ${#cores[@]} -gt 0 ] && pin=(taskset -c "${cores[$(( (r - 1) % ${#cores[@]} ))]}")
  for f in "${flag_sets[@]}"; do
    for bin in $BINS; do
      for m in $META; do
        # shellcheck disable=SC2086  # $f: a set of flags
        "${pin[@]}" "$bin" --bench --meta "$m" $f 2>&1 | grep "^medium_generation per step" |
          sed "s|^|round $r${pin:+ core ${pin[2]}} [$bin${f:+ $f}]: |" | tee -a "$log"
      done
    done
  done
done
python3 - "$log" <<'PY'
import re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.search(r"\[(.*?)\]: .*meta (\S+?)[\],].*eager ([\d.]+) µs, graph ([\d.]+) µs, ([\d.]+)x", line)
    if m:
        rows.setdefault(f"{m.group(1)} meta {m.group(2)}", []).append(tuple(float(m.group(i)) for i in (3, 4, 5)))
for key, v in rows.items():
    e, g, x = (statistics.median(c) for c in zip(*v))
    print(f"{key}: {len(v)} processes, medians: eager {e:.2f} µs, graph {g:.2f} µs, per-step speedup {x:.2f}x "
          f"(range {min(t[2] for t in v):.2f}-{max(t[2] for t in v):.2f}x)")
PY
