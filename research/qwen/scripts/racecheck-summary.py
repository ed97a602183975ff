#!/usr/bin/env python3
"""Groups a compute-sanitizer racecheck hazard report (--racecheck-report hazard) by kind, source
lines and warps: one line per (kind, read site, write site, reader warp -> writer warp) with the
count, the blocks and the shared-memory address range.
    python3 research/qwen/scripts/racecheck-summary.py race.log [--block-threads 288]"""
import argparse
import collections
import re

ap = argparse.ArgumentParser()
ap.add_argument("log")
ap.add_argument("--top", type=int, default=40)
a = ap.parse_args()
head = re.compile(r"Potential (\w+) hazard detected at __shared__ (0x[0-9a-f]+) in block \((\d+),")
acc = re.compile(r"(Read|Write) Thread \((\d+),\d+,\d+\) at (.*?)\+0x[0-9a-f]+ in (\S+:\d+)")
groups = collections.defaultdict(lambda: [0, set(), None, None])
cur = None
for line in open(a.log, errors="replace"):
    m = head.search(line)
    if m:
        cur = {"kind": m.group(1), "addr": int(m.group(2), 16), "block": int(m.group(3)), "acc": []}
        continue
    m = acc.search(line)
    if m and cur is not None:
        fn = re.sub(r"\(.*", "", m.group(3)).split("::")[-1]
        cur["acc"].append((m.group(1), int(m.group(2)) // 32, int(m.group(2)) % 32, f"{fn} {m.group(4)}"))
        if len(cur["acc"]) == 2:
            (k1, w1, l1, s1), (k2, w2, l2, s2) = cur["acc"]
            key = (cur["kind"], f"{k1} {s1}", f"{k2} {s2}", f"warp {w1} -> warp {w2} (lane {l2})" if k2 == "Write" else f"warp {w1} -> warp {w2}")
            g = groups[key]
            g[0] += 1
            g[1].add(cur["block"])
            g[2] = cur["addr"] if g[2] is None else min(g[2], cur["addr"])
            g[3] = cur["addr"] if g[3] is None else max(g[3], cur["addr"])
            cur = None
total = sum(g[0] for g in groups.values())
print(f"{total} hazards in {len(groups)} groups")
for key, (n, blocks, lo, hi) in sorted(groups.items(), key=lambda kv: -kv[1][0])[: a.top]:
    bl = sorted(blocks)
    print(f"{n:7d}  {key[0]}  {key[1]}  /  {key[2]}  {key[3]}  blocks {len(bl)} ({bl[:6]}{'...' if len(bl) > 6 else ''})  "
          f"addr {lo:#x}-{hi:#x}")
