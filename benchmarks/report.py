#!/usr/bin/env python3
"""Turns replay's Google Benchmark JSON into docs/benchmarks.md tables and PNG plots.

    python3 benchmarks/report.py results/launch_overhead.json results/decode_step.json \
        [results/pool_*.json ...] --out docs/benchmarks.md --img docs/img

Reads the JSON written by `--benchmark_out_format=json` (with or without repetitions: with
`--benchmark_report_aggregates_only=true` the medians are used). The page is stamped with the
device, driver, CUDA runtime and date from the benchmark context. Needs matplotlib (PyPI); without
it, pass --no-plots to write the tables only.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
from collections import defaultdict

SIZES_ORDER = [1, 10, 25, 50, 100, 400, 1600]


# ---- loading -----------------------------------------------------------------------------------

def parse_name(run_name: str):
    """'launch/eager/sync/N:10/manual_time' -> (['launch','eager','sync'], {'N': 10})."""
    path, args = [], {}
    for part in run_name.split("/"):
        if part in ("manual_time", "real_time") or part.startswith("iterations:") or part.startswith("repeats:"):
            continue
        if ":" in part:
            k, v = part.split(":", 1)
            try:
                args[k] = int(v)
            except ValueError:
                args[k] = v
        else:
            path.append(part)
    return path, args


TIME_SCALE = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}  # to microseconds


class Result:
    """One benchmark's figures: the median aggregate if present, else the mean of its runs."""

    def __init__(self, name, entry, n_runs, stat):
        self.name = name
        self.path, self.args = parse_name(name)
        self.entry = entry
        self.n_runs = n_runs
        self.stat = stat
        self.error = entry.get("error_message") if entry.get("error_occurred") else None

    @property
    def time_us(self):
        return self.entry["real_time"] * TIME_SCALE[self.entry.get("time_unit", "ns")]

    def counter(self, key, default=None):
        v = self.entry.get(key, default)
        return v if isinstance(v, (int, float)) else default

    cv_entry: dict = {}

    def noisy(self, key="real_time"):
        """True when the figure varied by more than NOISY_CV across repetitions."""
        v = self.cv_entry.get(key)
        return isinstance(v, (int, float)) and v > NOISY_CV


NOISY_CV = 0.10  # coefficient of variation above which a figure is marked with *


def mark(r, key, digits=2, scale=1.0):
    """A counter of a result, formatted, with * when it was noisy across repetitions."""
    if r is None:
        return "–"
    v = r.time_us if key == "real_time" else r.counter(key)
    if v is None:
        return "–"
    return fmt(v * scale, digits) + ("*" if r.noisy(key) else "")


def load(paths):
    """Returns (context of the first file, with "dates": every file's date, {program: {run_name:
    Result}}, errors)."""
    context, programs, errors, dates = None, {}, [], set()
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        if context is None:
            context = data.get("context", {})
        if data.get("context", {}).get("date"):
            dates.add(data["context"]["date"][:10])
        prog = os.path.splitext(os.path.basename(p))[0]
        groups = defaultdict(list)
        for b in data.get("benchmarks", []):
            groups[b.get("run_name", b["name"])].append(b)
        results = {}
        for run_name, entries in groups.items():
            errs = [e for e in entries if e.get("error_occurred")]
            if errs:
                errors.append((prog, run_name, errs[0].get("error_message", "")))
                results[run_name] = Result(run_name, errs[0], 0, "error")
                continue
            med = [e for e in entries if e.get("run_type") == "aggregate" and e.get("aggregate_name") == "median"]
            if med:
                reps = med[0].get("repetitions", 1)
                results[run_name] = Result(run_name, med[0], reps, "median")
                cv = [e for e in entries if e.get("run_type") == "aggregate" and e.get("aggregate_name") == "cv"]
                results[run_name].cv_entry = cv[0] if cv else {}
                continue
            its = [e for e in entries if e.get("run_type", "iteration") == "iteration"]
            if not its:
                continue
            merged = dict(its[0])
            for k, v in its[0].items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("repetitions", "repetition_index", "family_index", "per_family_instance_index", "threads"):
                    merged[k] = sum(e.get(k, 0) for e in its) / len(its)
            results[run_name] = Result(run_name, merged, len(its), "mean" if len(its) > 1 else "single run")
        programs[prog] = results
    context = context or {}
    context["dates"] = sorted(dates)
    return context, programs, errors


def find(results, *path, **args):
    for r in results.values():
        if r.error is None and r.path == list(path) and all(r.args.get(k) == v for k, v in args.items()):
            return r
    return None


# ---- formatting --------------------------------------------------------------------------------

def fmt(v, digits=2):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 100:
        return f"{v:.0f}" if digits <= 2 else f"{v:.1f}"
    return f"{v:.{digits}f}"


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(out) + "\n"


def stamp(ctx):
    dev = ctx.get("device", "unknown device")
    cc = ctx.get("compute_capability")
    driver = ctx.get("driver") or ctx.get("driver_cuda")
    drv = f"driver {ctx['driver']} (CUDA {ctx.get('driver_cuda', '?')})" if ctx.get("driver") else f"driver CUDA {ctx.get('driver_cuda', '?')}"
    date = ctx.get("date", "")[:10] or dt.date.today().isoformat()
    parts = [dev + (f" (sm_{cc.replace('.', '')})" if cc else ""), drv if driver else None,
             f"CUDA runtime {ctx.get('cuda_runtime', '?')}", date]
    return " · ".join(p for p in parts if p)


# ---- sections ----------------------------------------------------------------------------------

LAUNCH_MODES = [("eager", "eager launches"), ("eager_pdl", "eager + PDL"), ("graph", "graph (replay::graph_exec)"),
                ("graph_pdl", "graph + PDL"),
                ("graph_raw", "graph (raw cudaGraphLaunch)"), ("graph_meta", "graph + step_meta push"),
                ("pool", "graph_pool hit")]


def launch_sections(res):
    md = []
    sizes = sorted({r.args["N"] for r in res.values() if r.path[:1] == ["launch"] and "N" in r.args},
                   key=lambda n: (SIZES_ORDER.index(n) if n in SIZES_ORDER else 99, n))
    modes = [m for m, _ in LAUNCH_MODES if any(r.path[:2] == ["launch", m] for r in res.values())]
    label = dict(LAUNCH_MODES)

    def per_kernel(mode, sync, n):
        r = find(res, "launch", mode, sync, N=n)
        return r.counter("us_per_kernel") if r else None

    def per_kernel_cell(mode, sync, n):
        return mark(find(res, "launch", mode, sync, N=n), "us_per_kernel", 3)

    for sync, title, blurb in (
        ("sync", "Per-kernel cost, one host synchronisation per step",
         "Wall time of one step (issue the N-kernel chain, then `cudaStreamSynchronize`) divided by N: "
         "what a decode step that reads its token back pays per kernel."),
        ("nosync", "Per-kernel cost, steps issued back to back",
         "Steps are issued without a synchronisation in between (one per batch of steps): throughput, "
         "where the host's launch rate and the GPU overlap."),
    ):
        rows = []
        for n in sizes:
            e, g = per_kernel("eager", sync, n), per_kernel("graph", sync, n)
            row = [n] + [per_kernel_cell(m, sync, n) for m in modes]
            row.append(f"{e / g:.1f}×" if e and g else "–")
            rows.append(row)
        md.append(f"### {title}\n\n{blurb} µs per kernel; speedup = eager / graph.\n\n")
        md.append(table(["N"] + [label[m] for m in modes] + ["speedup"], rows))
        md.append("\n")

    rows = []
    for n in sizes:
        e = find(res, "launch", "eager", "sync", N=n)
        g = find(res, "launch", "graph", "sync", N=n)
        graw = find(res, "launch", "graph_raw", "sync", N=n)
        gm = find(res, "launch", "graph_meta", "sync", N=n)
        p = find(res, "launch", "pool", "sync", N=n)
        rows.append([n, mark(e, "host_us_per_launch", 3), mark(e, "host_us_per_step", 1),
                     mark(g, "host_us_per_step", 3), mark(graw, "host_us_per_step", 3),
                     mark(gm, "host_us_per_step", 3), mark(p, "host_us_per_step", 3)])
    md.append("### Host cost of launching\n\nHost time spent issuing one step (before the synchronisation), "
              "µs. Eager: per kernel launch and per step; graph: one launch of the whole chain.\n\n")
    md.append(table(["N", "eager / launch", "eager / step", "graph_exec::launch", "raw cudaGraphLaunch",
                     "push + launch", "graph_pool::run (hit)"], rows))
    md.append("\n")

    rows = []
    for n in sizes:
        ge, gg = find(res, "gpu", "eager", N=n), find(res, "gpu", "graph", N=n)
        gep, ggp = find(res, "gpu", "eager_pdl", N=n), find(res, "gpu", "graph_pdl", N=n)
        te = ge and ge.counter("gate_timeouts")
        rows.append([n, mark(ge, "gpu_us_per_kernel", 3), mark(gep, "gpu_us_per_kernel", 3),
                     mark(gg, "gpu_us_per_kernel", 3), mark(ggp, "gpu_us_per_kernel", 3),
                     f"{int(te)}" if te is not None else "–"])
    if any(r[1] != "–" for r in rows):
        md.append("### GPU-side cost per kernel\n\nCUDA-event time of the chain / N, with the stream held by a "
                  "gate kernel until the host has queued the whole chain, so the GPU runs it back to back: "
                  "the GPU's own per-kernel cost (launch gap included), without the host's launch rate. "
                  "Gate timeouts > 0 mean the launch queue filled and the host blocked (that row then "
                  "includes host time).\n\n")
        md.append(table(["N", "eager µs/kernel", "eager + PDL", "graph µs/kernel", "graph + PDL",
                         "eager gate timeouts"], rows))
        md.append("\n")

    rows = []
    for n in sizes:
        c, i, u = find(res, "capture", N=n), find(res, "instantiate", N=n), find(res, "exec_update", N=n)
        rows.append([n, mark(c, "real_time", 1), mark(i, "real_time", 1), mark(u, "real_time", 1)])
    if any(r[1] != "–" for r in rows):
        md.append("### Graph setup cost\n\nHost time, µs: stream capture of the chain, `cudaGraphInstantiate`, and "
                  "`cudaGraphExecUpdate` (`graph_exec::update` from a new capture of the same topology whose "
                  "kernels point at another buffer).\n\n")
        md.append(table(["N", "capture", "instantiate", "exec update"], rows))
        md.append("\n")

    rows = []
    for r in sorted((r for r in res.values() if r.path[:1] == ["step_meta"] and r.error is None),
                    key=lambda r: (r.path, r.args.get("elems", 0))):
        what = {"push": "`step_meta<T>` staging + push", "push_array": "`step_meta_array<int32>` staging + push",
                "raw_memcpy_async": "raw `cudaMemcpyAsync` (floor)"}.get(r.path[1], r.path[1])
        rows.append([what, int(r.counter("bytes", 0)), mark(r, "real_time", 3)])
    if rows:
        md.append("### Step metadata push\n\nHost cost of writing the per-step values into pinned staging and "
                  "issuing the host-to-device copy (stream idle before each push, as after a synchronised "
                  "step), µs.\n\n")
        md.append(table(["what", "bytes", "host µs"], rows))
        md.append("\n")
    return "".join(md)


def decode_rows(res):
    rows = []
    for r in res.values():
        if r.error is not None or r.path[:1] != ["decode"]:
            continue
        model, mode = r.path[1], r.path[2]
        sync = r.path[3] if len(r.path) > 3 else "sync"
        rows.append((model, mode, sync, int(r.args.get("batch", r.counter("batch", 1) or 1)), r))
    order = {"nanogpt": 0}
    rows.sort(key=lambda x: (order.get(x[0], 1), x[0], x[2] != "sync", x[3], x[1] != "eager"))
    return rows


def decode_section(res):
    rows = decode_rows(res)
    if not rows:
        return ""
    md = []
    d2d = find(res, "floor", "d2d_copy")
    null = find(res, "floor", "null_step")
    md.append("Floors measured in the same run: device-to-device copy "
              f"**{fmt(d2d and d2d.counter('GBps'), 0)} GB/s** (bytes read + written; 512 MiB copies), "
              f"null step (push metadata, one kernel, 4 bytes back, synchronise) "
              f"**{fmt(null and null.time_us, 1)} µs**.\n\n")

    nano = [x for x in rows if x[0] == "nanogpt"]
    if nano:
        t = []
        by = {(m, s): r for _, m, s, _, r in nano}
        for (mode, sync), r in sorted(by.items(), key=lambda kv: (kv[0][1] != "sync", kv[0][0] != "eager")):
            eager = by.get(("eager", sync))
            t.append([mode, "per step + sync (TPOT)" if sync == "sync" else "back to back", mark(r, "real_time", 1),
                      fmt(r.counter("us_per_kernel"), 2), fmt(r.counter("tokens_per_s"), 0),
                      f"{eager.time_us / r.time_us:.2f}×" if eager else "–",
                      fmt(r.counter("floor_us"), 1) if sync == "sync" else "–"])
        k = nano[0][4].counter("kernels_per_step")
        kernels = f"{int(k)} kernel{'' if int(k) == 1 else 's'}" if k else "? kernels"
        md.append(f"### NanoGPT (4 layers, 32 wide, batch 1, {kernels} per step)\n\n"
                  "Latency-bound (its weights fit in L2, as they do in any real decode loop, so L2 is not "
                  "flushed): the floor is the null step, a synchronised round trip (median of 200, measured "
                  "in the same process before these rows), not bandwidth. Back to back = "
                  "`enqueue_decode_step` without reading the token, one synchronisation per 32 steps.\n\n")
        md.append(table(["mode", "timing", "µs / step", "µs / kernel", "tokens/s", "speedup vs eager", "floor µs"], t))
        md.append("\n")

    qwen = [x for x in rows if x[0] != "nanogpt"]
    if qwen:
        t = []
        idx = {(m, mode, b): r for m, mode, _, b, r in qwen}
        for model, mode, _, b, r in qwen:
            eager = idx.get((model, "eager", b))
            t.append([model, b, int(r.counter("bucket", b) or b), mode, mark(r, "real_time", 3, 1e-3),
                      fmt(r.counter("tokens_per_s"), 0), fmt(r.counter("GBps"), 0), f"{fmt(r.counter('pct_of_d2d'), 1)}%",
                      fmt(r.counter("floor_ms"), 3), f"{eager.time_us / r.time_us:.2f}×" if eager else "–"])
        md.append("### Qwen3 shapes (random bf16 weights, paged KV, 16-token prompts)\n\n"
                  "Host wall time per decode step (token ids back on the host), L2 flushed before each step. "
                  "Batch 1 is the TPOT; larger batches run through the engine's bucketed graphs (one graph "
                  "per power-of-two bucket). GB/s = weight bytes read per step / step time; % of D2D = that "
                  "over the D2D copy bandwidth; floor = weight bytes / D2D bandwidth.\n\n")
        md.append(table(["model", "batch", "bucket", "mode", "ms / step", "tokens/s", "weights GB/s", "% of D2D",
                         "floor ms", "speedup vs eager"], t))
        md.append("\n")
    return "".join(md)


def generic_section(prog, res):
    rows = []
    for r in res.values():
        if r.error is not None:
            continue
        counters = {k: v for k, v in r.entry.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in (
                        "family_index", "per_family_instance_index", "repetitions", "repetition_index", "threads",
                        "iterations", "real_time", "cpu_time")}
        rows.append([f"`{r.name.replace('/manual_time', '').replace('/real_time', '')}`",
                     f"{fmt(r.entry['real_time'], 3)} {r.entry.get('time_unit', '')}",
                     ", ".join(f"{k} {int(v) if float(v).is_integer() else fmt(v, 3)}" for k, v in sorted(counters.items()))])
    if not rows:
        return ""
    return f"### {prog}\n\n" + table(["benchmark", "time", "counters"], rows) + "\n"


# ---- plots -------------------------------------------------------------------------------------

def plots(ctx, programs, img_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(img_dir, exist_ok=True)
    made = {}
    st = stamp(ctx)
    lo = programs.get("launch_overhead", {})
    if lo:
        fig, ax = plt.subplots(figsize=(8, 5))
        styles = {"eager": ("#d62728", "o"), "graph": ("#1f77b4", "s"), "pool": ("#2ca02c", "^")}
        for mode, (color, marker) in styles.items():
            for sync, ls in (("sync", "-"), ("nosync", "--")):
                pts = sorted((r.args["N"], r.counter("us_per_kernel")) for r in lo.values()
                             if r.error is None and r.path == ["launch", mode, sync])
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, color=color, marker=marker,
                            label=f"{mode}, {'sync per step' if sync == 'sync' else 'back to back'}")
        pts = sorted((r.args["N"], r.counter("gpu_us_per_kernel")) for r in lo.values()
                     if r.error is None and r.path == ["gpu", "graph"])
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ":", color="#7f7f7f", marker=".",
                    label="graph, GPU-side only")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ns = sorted({r.args["N"] for r in lo.values() if "N" in r.args})
        if ns:
            ax.set_xticks(ns)
            ax.set_xticklabels([str(n) for n in ns])
            ax.minorticks_off()
        ax.set_xlabel("kernels per step (N)")
        ax.set_ylabel("µs per kernel (log scale)")
        lo_y, hi_y = ax.get_ylim()
        yt = [t for t in (0.5, 0.75, 1, 1.5, 2, 3, 4, 5, 7, 9, 15, 20, 30, 50, 100) if lo_y <= t <= hi_y]
        ax.set_yticks(yt)
        ax.set_yticklabels([f"{t:g}" for t in yt])
        ax.set_title("Per-kernel cost of a chain of N tiny dependent kernels")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.text(0.01, 0.01, st, fontsize=7, color="#555555")
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        path = os.path.join(img_dir, "launch_overhead.png")
        fig.savefig(path, dpi=130)
        plt.close(fig)
        made["launch_overhead"] = path

        series = [("capture", "stream capture"), ("instantiate", "cudaGraphInstantiate"),
                  ("exec_update", "cudaGraphExecUpdate")]
        if any(r.path[:1] == ["instantiate"] and r.error is None for r in lo.values()):
            fig, ax = plt.subplots(figsize=(7, 4.2))
            for key, lab in series:
                pts = sorted((r.args["N"], r.time_us) for r in lo.values() if r.error is None and r.path == [key])
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=lab)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ns = sorted({r.args["N"] for r in lo.values() if "N" in r.args})
            ax.set_xticks(ns)
            ax.set_xticklabels([str(n) for n in ns])
            ax.minorticks_off()
            ax.set_xlabel("kernels in the graph (N)")
            ax.set_ylabel("host µs")
            ax.set_title("Graph setup cost vs size")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
            fig.text(0.01, 0.01, st, fontsize=7, color="#555555")
            fig.tight_layout(rect=(0, 0.03, 1, 1))
            path = os.path.join(img_dir, "graph_setup.png")
            fig.savefig(path, dpi=130)
            plt.close(fig)
            made["graph_setup"] = path

    ds = programs.get("decode_step", {})
    rows = decode_rows(ds) if ds else []
    if rows:
        b1 = [(m, mode, r) for m, mode, sync, b, r in rows if b == 1 and sync == "sync"]
        models = []
        for m, _, _ in b1:
            if m not in models:
                models.append(m)
        qwen_models = [m for m in models if m != "nanogpt"]
        ncols = 2 if qwen_models else 1
        fig, axes = plt.subplots(1, ncols, figsize=(11 if ncols == 2 else 6, 4.5))
        axes = axes if ncols == 2 else [axes]
        ax = axes[0]
        x = range(len(models))
        w = 0.38
        for i, (mode, color) in enumerate((("eager", "#d62728"), ("graph", "#1f77b4"))):
            vals = []
            for m in models:
                r = next((r for mm, mo, r in b1 if mm == m and mo == mode), None)
                vals.append(r.time_us / 1e3 if r else 0)
            bars = ax.bar([xi + (i - 0.5) * w for xi in x], vals, w, label=mode, color=color)
            for bar, v in zip(bars, vals):
                if v:
                    ax.annotate(f"{v:.3g}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
        for j, m in enumerate(models):
            r = next((r for mm, mo, r in b1 if mm == m), None)
            fl = r.counter("floor_ms") if r and m != "nanogpt" else (r.counter("floor_us") / 1e3 if r and r.counter("floor_us") else None)
            if fl:
                ax.hlines(fl, j - 0.45, j + 0.45, colors="black", linestyles="dotted")
        ax.set_xticks(list(x))
        ax.set_xticklabels(models)
        ax.set_yscale("log")
        ax.set_ylabel("ms per decode step (TPOT), log scale")
        ax.set_title("Batch-1 decode step (dotted: floor)")
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        if qwen_models:
            ax = axes[1]
            for m, color in zip(qwen_models, ("#9467bd", "#8c564b", "#e377c2")):
                for mode, ls in (("eager", "--"), ("graph", "-")):
                    pts = sorted((b, r.counter("pct_of_d2d")) for mm, mo, sync, b, r in rows if mm == m and mo == mode)
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, marker="o", color=color, label=f"{m} {mode}")
            ax.set_xscale("log", base=2)
            bs = sorted({b for _, _, _, b, _ in rows})
            ax.set_xticks(bs)
            ax.set_xticklabels([str(b) for b in bs])
            ax.set_xlabel("batch")
            ax.set_ylabel("% of D2D copy bandwidth (weights read)")
            ax.set_title("Qwen3 shapes: weight bandwidth vs batch")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.text(0.01, 0.01, st, fontsize=7, color="#555555")
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        path = os.path.join(img_dir, "decode.png")
        fig.savefig(path, dpi=130)
        plt.close(fig)
        made["decode"] = path
    return made


# ---- the page ----------------------------------------------------------------------------------

def headline(lo, ds):
    rows = []
    for n in (10, 100, 400):
        e, g, p = find(lo, "launch", "eager", "sync", N=n), find(lo, "launch", "graph", "sync", N=n), find(lo, "launch", "pool", "sync", N=n)
        if e and g:
            rows.append([n, fmt(e.counter("us_per_kernel"), 3), fmt(g.counter("us_per_kernel"), 3),
                         fmt(p and p.counter("us_per_kernel"), 3), f"{e.counter('us_per_kernel') / g.counter('us_per_kernel'):.1f}×"])
    out = ""
    if rows:
        out += table(["N kernels", "eager µs/kernel", "graph µs/kernel", "pool µs/kernel", "speedup"], rows) + "\n"
    drows = []
    for model, mode, sync, b, r in decode_rows(ds):
        if b != 1 or sync != "sync":
            continue
        if model == "nanogpt":
            drows.append([model, mode, f"{fmt(r.time_us, 1)} µs", "–", f"null step {fmt(r.counter('floor_us'), 1)} µs"])
        else:
            drows.append([model, mode, f"{fmt(r.time_us / 1e3, 3)} ms", f"{fmt(r.counter('pct_of_d2d'), 1)}%",
                          f"{fmt(r.counter('floor_ms'), 3)} ms (D2D)"])
    if drows:
        out += table(["decode, batch 1", "mode", "TPOT", "% of D2D bandwidth", "floor"], drows) + "\n"
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", nargs="+", help="Google Benchmark JSON files (named <program>.json)")
    ap.add_argument("--out", default="docs/benchmarks.md")
    ap.add_argument("--img", default="docs/img", help="folder for the PNG plots")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--command", default="bash benchmarks/run.sh", help="the command shown as the way to reproduce")
    a = ap.parse_args(argv)

    ctx, programs, errors = load(a.json)
    made = {} if a.no_plots else plots(ctx, programs, a.img)
    rel = lambda p: os.path.relpath(p, os.path.dirname(os.path.abspath(a.out)) or ".")
    lo = programs.get("launch_overhead", {})
    ds = programs.get("decode_step", {})
    stats = sorted({r.stat for res in programs.values() for r in res.values() if r.error is None})
    reps = sorted({r.n_runs for res in programs.values() for r in res.values() if r.error is None})

    md = ["# Benchmark results\n\n",
          "<!-- generated by benchmarks/report.py from Google Benchmark JSON; do not edit by hand -->\n\n",
          f"Measured on **{ctx.get('device', 'unknown device')}**"]
    extra = []
    if ctx.get("compute_capability"):
        extra.append(f"compute capability {ctx['compute_capability']}")
    if ctx.get("sm_count"):
        extra.append(f"{ctx['sm_count']} SMs")
    if ctx.get("gpu_memory_gib"):
        extra.append(f"{ctx['gpu_memory_gib']} GiB")
    if extra:
        md.append(f" ({', '.join(extra)})")
    drv = ctx.get("driver")
    dates = ctx.get("dates") or [ctx.get("date", "")[:10]]
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]} (programs run separately)"
    md.append(f", driver {drv + ' / ' if drv else ''}CUDA {ctx.get('driver_cuda', '?')}, CUDA runtime "
              f"{ctx.get('cuda_runtime', '?')}, on {when} ({ctx.get('num_cpus', '?')} host CPUs). Figures are {', '.join(stats) or '?'}s of "
              f"{'/'.join(str(r) for r in reps) or '?'} repetitions. Reproduce with `{a.command}`; this page "
              f"was generated from {', '.join('`' + os.path.relpath(p) + '`' for p in a.json)}.\n\n")
    if any(r.noisy(k) for res in programs.values() for r in res.values() for k in r.cv_entry):
        md.append(f"Figures marked * varied by more than {NOISY_CV:.0%} (coefficient of variation) across "
                  "the repetitions; read them as rough.\n\n")
    md.append("## Headline\n\n")
    if "launch_overhead" in made:
        md.append(f"![per-kernel cost vs N]({rel(made['launch_overhead'])})\n\n")
    md.append(headline(lo, ds))
    if lo:
        md.append("## Launch overhead (`bench_launch_overhead`)\n\n"
                  "A chain of N tiny dependent kernels (each adds to one counter; the counter is checked "
                  "after every benchmark), launched eagerly, replayed as one graph, and replayed through a "
                  "`replay::graph_pool`.\n\n")
        md.append(launch_sections(lo))
        if "graph_setup" in made:
            md.append(f"![graph setup cost]({rel(made['graph_setup'])})\n\n")
    if ds:
        md.append("## Decode step (`bench_decode_step`)\n\n")
        if "decode" in made:
            md.append(f"![decode step]({rel(made['decode'])})\n\n")
        md.append(decode_section(ds))
    others = [p for p in programs if p not in ("launch_overhead", "decode_step")]
    if others:
        md.append("## Other benchmark programs\n\n")
        for p in others:
            md.append(generic_section(p, programs[p]))
    if errors:
        md.append("## Benchmarks that did not run\n\n")
        md.append(table(["program", "benchmark", "reason"], [[p, f"`{n}`", m] for p, n, m in errors]))
        md.append("\n")
    md.append("## Context\n\n")
    notes = {"library_build_type": " (Google Benchmark's own library as packaged by Debian; the benchmarks "
                                   "themselves are Release builds)",
             "host_name": " (the GPU machine)", "date": " (start of the first program)"}
    md.append(table(["key", "value"], [[k, f"{v}{notes.get(k, '')}"] for k, v in ctx.items()
                                       if not isinstance(v, (list, dict)) and k != "executable"]))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("".join(md))
    print(f"wrote {a.out}" + (f" and {len(made)} plot(s) in {a.img}" if made else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
