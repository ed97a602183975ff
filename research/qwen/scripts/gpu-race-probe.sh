#!/usr/bin/env bash
# What compute-sanitizer racecheck reports for each handoff of research/qwen/probes/raceprobe.cu
# (plain run first: every case must print "ok"). From the repo root on the GPU machine:
#   source .deps/tools/env.sh && PROBE=build/examples/qwen/qwen_race_probe bash scripts/gpu-race-probe.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
probe=${PROBE:-build-gpu-qwen/examples/qwen/qwen_race_probe}
for c in sync racy mbar_raw mbar_war ring ring_self ring_test ring8_try ring8_test ring8_serial ring8_sync; do
  plain=$("$probe" "$c" 2>&1); rc=$?
  compute-sanitizer --tool racecheck --racecheck-report all "$probe" "$c" > "$out/race-probe-$c.log" 2>&1
  echo "$c: plain exit $rc ($plain); racecheck exit $?: $(grep -E 'RACECHECK SUMMARY' "$out/race-probe-$c.log" | tr -s ' ')"
done 2>&1 | tee "$out/race-probe.log"
