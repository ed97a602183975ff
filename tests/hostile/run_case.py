#!/usr/bin/env python3
"""Runs one case of the hostile-input corpus (written by corpus.py build DIR).

    run_case.py DIR NAME --nanogpt EXE --qwen EXE [--timeout S]

Exit 0 when the program behaves as the case states: the exit code and the message fragment, or for
a control case exit 0 or the program's "no CUDA device" exit. A case fails on anything else, on a
timeout (a hang), on a signal, or on a sanitizer report in the output. Standard library only.
"""
import json
import os
import subprocess
import sys

OK = "ok"
NO_DEVICE = {"nanogpt": 2, "qwen": 3}  # the exit code of valid input on a machine without a GPU
SANITIZER_MARKS = ("runtime error:", "AddressSanitizer", "LeakSanitizer", "UndefinedBehaviorSanitizer")


def run(root, name, exes, timeout):
    with open(os.path.join(root, "manifest.json")) as f:
        cases = {c["name"]: c for c in json.load(f)}
    c = cases[name]
    args = [a.encode("latin-1") if raw else a for a, raw in zip(c["args"], c["raw"])]
    cmd = [os.path.abspath(exes[c["prog"]])] + args
    shown = " ".join(repr(a) if isinstance(a, bytes) else a for a in args)
    if len(shown) > 300:
        shown = shown[:300] + "..."
    print("case %s: %s %s" % (name, c["prog"], shown))
    try:
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=timeout, cwd=os.path.join(root, name))
    except subprocess.TimeoutExpired:
        print("FAIL: still running after %d s (a hang?)" % timeout)
        return 1
    out = p.stdout.decode("utf-8", "replace")
    print("exit code %d\n%s" % (p.returncode, out[-4000:]))
    for mark in SANITIZER_MARKS:
        if mark in out:
            print("FAIL: sanitizer report (%s)" % mark)
            return 1
    if p.returncode < 0:
        print("FAIL: killed by signal %d" % -p.returncode)
        return 1
    if c["rc"] == OK:
        if p.returncode == 0 or (p.returncode == NO_DEVICE[c["prog"]] and "CUDA device" in out):
            print("PASS: accepted")
            return 0
        print("FAIL: valid input was refused")
        return 1
    if p.returncode != c["rc"]:
        print("FAIL: expected exit code %d" % c["rc"])
        return 1
    if c["msg"] not in out:
        print("FAIL: the output does not contain %r" % c["msg"])
        return 1
    if len(out.strip().splitlines()) > 40:
        print("FAIL: more than 40 lines of output for one bad input")
        return 1
    print("PASS")
    return 0


def main(argv):
    if len(argv) < 3:
        print(__doc__)
        return 2
    exes, timeout, rest = {}, 60, argv[3:]
    while len(rest) >= 2:
        flag, value, rest = rest[0], rest[1], rest[2:]
        if flag == "--nanogpt":
            exes["nanogpt"] = value
        elif flag == "--qwen":
            exes["qwen"] = value
        elif flag == "--timeout":
            timeout = int(value)
    return run(argv[1], argv[2], exes, timeout)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
