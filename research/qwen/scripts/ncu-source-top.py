#!/usr/bin/env python3
"""Top SASS instructions by warp stall samples from `ncu --page source --csv --print-source sass`."""
import csv
import sys


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    head = next(i for i, r in enumerate(rows) if any("Source" in c for c in r))
    cols = rows[head]
    print("columns:", " | ".join(cols))
    src = next(i for i, c in enumerate(cols) if c.strip() == "Source")
    samp = [i for i, c in enumerate(cols) if "Sampling" in c and "All" in c] or \
           [i for i, c in enumerate(cols) if "Sampl" in c]
    if not samp:
        print("no sampling column")
        return
    s = samp[0]

    def num(x: str) -> float:
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0

    body = rows[head + 1:]
    total = sum(num(r[s]) for r in body if len(r) > s)
    print(f"total samples ({cols[s]}): {total:.0f}")
    ranked = sorted(range(len(body)), key=lambda i: -num(body[i][s]) if len(body[i]) > s else 0)
    for i in ranked[:top]:
        r = body[i]
        if len(r) <= s:
            continue
        ctx = " ; ".join(body[j][src].strip() for j in range(max(0, i - 2), i) if len(body[j]) > src)
        print(f"{num(r[s]):8.0f} {100 * num(r[s]) / max(total, 1):5.1f}%  #{i:5d} {r[src].strip():60.60s}  <- {ctx[:90]}")


if __name__ == "__main__":
    main()
