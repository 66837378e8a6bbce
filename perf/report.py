#!/usr/bin/python3
"""Turns a results directory of perf/bench.py into RESULTS.md and PNG plots.

    /usr/bin/python3 perf/report.py OUTDIR [--md perf/RESULTS.md] [--plots perf/plots]

Reads OUTDIR/records.jsonl, OUTDIR/meta.json and, if present, OUTDIR/micro.json (Google
Benchmark). Every figure is a median over the repetitions; tables also give min and max.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict

PERF_DIR = os.path.dirname(os.path.abspath(__file__))
MiB, GiB = 1 << 20, 1 << 30

TOOL_LABEL = {
    "xdfs": "xDFS", "xdfs-private": "xDFS private", "gridftp": "GridFTP", "gridftp-pp": "GridFTP -pp",
    "gridftp-pp-cc": "GridFTP -pp -cc", "iperf3": "iperf3", "iperf3-z": "iperf3 -Z",
    "rsync": "rsync -a", "tar": "tar | tar",
}
TOOL_COLOR = {
    "xdfs": "#d62728", "xdfs-private": "#ff7f0e", "gridftp": "#1f77b4", "gridftp-pp": "#17becf", "gridftp-pp-cc": "#9467bd",
    "iperf3": "#7f7f7f", "iperf3-z": "#bcbd22", "rsync": "#2ca02c", "tar": "#8c564b",
}
SCEN_TITLE = {"mem": "Memory to memory (loopback)", "disk": "Disk to disk (loopback)",
              "small": "Lots of small files", "link": "Link mode (veth + tc tbf between two namespaces)",
              "cached": "A page-cached file to /dev/null (loopback)"}


def label(t: str) -> str:
    return TOOL_LABEL.get(t, t)


def mdl(t: str) -> str:
    """A tool's label inside a markdown table cell."""
    return label(t).replace("|", "\\|")


def human(n: float) -> str:
    for unit, m in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= m and n % m == 0:
            return f"{int(n // m)} {unit}"
    return f"{n:g} B"


def short_size(n: int) -> str:
    for unit, m in (("G", GiB), ("M", MiB), ("K", 1024)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


class Stat:
    def __init__(self, values):
        v = sorted(x for x in values if x is not None)
        self.n = len(v)
        self.med = statistics.median(v) if v else None
        self.min = v[0] if v else None
        self.max = v[-1] if v else None


def load(outdir: str):
    recs = []
    with open(os.path.join(outdir, "records.jsonl")) as f:
        for line in f:
            line = line.strip()
            if line:
                recs.append(json.loads(line))
    meta = {}
    mp = os.path.join(outdir, "meta.json")
    if os.path.exists(mp):
        with open(mp) as f:
            meta = json.load(f)
    micro = None
    up = os.path.join(outdir, "micro.json")
    if os.path.exists(up):
        try:
            with open(up) as f:
                micro = json.load(f)
        except ValueError:
            micro = None
    return recs, meta, micro


def key_of(r) -> tuple:
    return (r["scenario"], r.get("link") or "", r["tool"], r["direction"], r["streams"], r.get("size", r["bytes"]), r["files"])


class Agg:
    """Medians per point over the repetitions."""

    def __init__(self, recs):
        self.groups = defaultdict(list)
        self.counted = defaultdict(list)  # runs that counted system calls, never timed
        self.other = []  # failed / unsupported
        for r in recs:
            if r["status"] == "ok" and r.get("counted"):
                self.counted[key_of(r)].append(r)
            elif r["status"] == "ok":
                self.groups[key_of(r)].append(r)
            else:
                self.other.append(r)

    def get(self, scenario, tool, direction, streams, size, files=1, link=""):
        rs = self.groups.get((scenario, link, tool, direction, streams, size, files))
        return rs or []

    def get_counted(self, scenario, tool, direction, streams, size, files=1, link=""):
        return self.counted.get((scenario, link, tool, direction, streams, size, files)) or []

    @staticmethod
    def stat(rs, field, scale=1.0):
        return Stat([r[field] / scale for r in rs if isinstance(r.get(field), (int, float))])

    def points(self, scenario, link=None):
        return sorted({k for k in self.groups if k[0] == scenario and (link is None or k[1] == link)})


def tp(rs) -> Stat:
    return Agg.stat(rs, "bytes_per_second", 1e6)


def tp_data(rs) -> Stat:
    """Throughput over the data phase, set-up excluded, as iperf3 reports its own: xduc's seconds
    less its set-up, where every record of the point has it; otherwise the wall-clock rate."""
    if rs and all(isinstance(r.get("data_bytes_per_second"), (int, float)) for r in rs):
        return Agg.stat(rs, "data_bytes_per_second", 1e6)
    return tp(rs)


def fmt_tp(s: Stat) -> str:
    if s.med is None:
        return "–"
    if s.n == 1:
        return f"{s.med:,.0f}"
    return f"{s.med:,.0f} ({s.min:,.0f}–{s.max:,.0f})"


def fmt_ratio(a: Stat, b: Stat) -> str:
    if a.med is None or b.med is None or not b.med:
        return "–"
    return f"{a.med / b.med:.2f}"


def fmt_num(s: Stat, digits=2) -> str:
    return "–" if s.med is None else f"{s.med:.{digits}f}"


def cpu_per_gib(rs, side) -> Stat:
    return Stat([r[f"{side}_cpu_s"] / (r["bytes"] / GiB) for r in rs
                 if isinstance(r.get(f"{side}_cpu_s"), (int, float)) and r["bytes"]])


def syscalls_per_gib(rs, side) -> Stat:
    return Stat([r[f"{side}_syscalls"] / (r["bytes"] / GiB) for r in rs
                 if isinstance(r.get(f"{side}_syscalls"), int) and r["bytes"]])


def fmt_calls(s: Stat) -> str:
    return "–" if s.med is None else f"{s.med:,.0f}"


def syscalls_table(agg: "Agg", out, rows, tools, lead) -> None:
    """System calls per GiB (client / server) of the counted runs; rows are (cells, key args)."""
    if not any(agg.get_counted(*k) for _, ks in rows for k in ks.values()):
        return
    out.append("\nSystem calls per GiB moved (client / server), from one more run of each point that perf stat "
               "counted (raw_syscalls:sys_enter) and that is not timed:\n")
    out.append("| " + " | ".join(lead) + " | " + " | ".join(f"{label(t)} calls/GiB" for t in tools) + " |")
    out.append("|" + "---:|" * (len(lead) + len(tools)))
    for cells, ks in rows:
        row = []
        for t in tools:
            r = agg.get_counted(*ks[t])
            row.append(f"{fmt_calls(syscalls_per_gib(r, 'client'))} / {fmt_calls(syscalls_per_gib(r, 'server'))}")
        out.append("| " + " | ".join(cells) + " | " + " | ".join(row) + " |")


def rss_mib(rs, side) -> Stat:
    return Stat([r[f"{side}_maxrss_kb"] / 1024 for r in rs if isinstance(r.get(f"{side}_maxrss_kb"), (int, float))])


# ----------------------------------------------------------------------------------------------
# plots

def plotter():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"figure.dpi": 110, "font.size": 9, "axes.grid": True, "grid.alpha": 0.3})
    return plt


def _errbars(stats):
    meds = [s.med for s in stats]
    lo = [s.med - s.min for s in stats]
    hi = [s.max - s.med for s in stats]
    return meds, [lo, hi]


def line_plot(plt, path, title, xlabel, ylabel, series, logx=False, xticks=None, ylim0=True, note=None):
    """series: list of (label, color, style, xs, [Stat])."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for lab, color, style, xs, stats in series:
        pts = [(x, s) for x, s in zip(xs, stats) if s.med is not None]
        if not pts:
            continue
        x = [p[0] for p in pts]
        meds, err = _errbars([p[1] for p in pts])
        ax.errorbar(x, meds, yerr=err, label=lab, color=color, linestyle=style, marker="o", markersize=3.5,
                    capsize=2.5, linewidth=1.4)
    if logx:
        ax.set_xscale("log", base=2)
    if xticks:
        ax.set_xticks(xticks[0])
        ax.set_xticklabels(xticks[1])
        ax.minorticks_off()
    if ylim0:
        ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if note:
        ax.text(0.99, 0.01, note, transform=ax.transAxes, ha="right", va="bottom", fontsize=7, color="#555")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def bar_plot(plt, path, title, ylabel, groups, tools, values, logy=False, note=None):
    """values[(group, tool)] = Stat."""
    fig, ax = plt.subplots(figsize=(max(6.4, 1.3 * len(groups) + 2), 4.0))
    width = 0.8 / max(1, len(tools))
    for i, t in enumerate(tools):
        xs, meds, lo, hi = [], [], [], []
        for g, grp in enumerate(groups):
            s = values.get((grp, t))
            if s is None or s.med is None:
                continue
            xs.append(g + (i - (len(tools) - 1) / 2) * width)
            meds.append(s.med)
            lo.append(s.med - s.min)
            hi.append(s.max - s.med)
        if xs:
            ax.bar(xs, meds, width=width * 0.95, yerr=[lo, hi], capsize=2, label=label(t), color=TOOL_COLOR.get(t))
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    if note:
        ax.text(0.01, 0.98, note, transform=ax.transAxes, ha="left", va="top", fontsize=7, color="#555")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# sections

def section_mem(agg: Agg, plt, plots_dir, rel, out, scenario="mem", link=""):
    pts = agg.points(scenario, link if scenario == "link" else None)
    if not pts:
        return
    tools = [t for t in ("xdfs", "xdfs-private", "gridftp", "iperf3", "iperf3-z") if any(p[2] == t for p in pts)]
    sizes = sorted({p[5] for p in pts}, reverse=True)
    for size, direction in [(sz, d) for sz in sizes for d in ("upload", "download")]:
        streams = sorted({p[4] for p in pts if p[5] == size and p[3] == direction})
        if not streams:
            continue
        rs = {(t, n): agg.get(scenario, t, direction, n, size, 1, link) for t in tools for n in streams}
        out.append(f"\n### {direction.capitalize()}, {human(size)} per run\n")
        # xDFS's rate after set-up beside its wall-clock one, where xduc reported its set-up: the
        # ratios to iperf3 compare it with iperf3's own rate, which excludes set-up too.
        data = "xdfs" in tools and any(isinstance(r.get("data_bytes_per_second"), (int, float))
                                       for n in streams for r in rs[("xdfs", n)])
        head = "| streams | " + " | ".join(f"{label(t)} MB/s" + (" | xDFS MB/s after set-up" if data and t == "xdfs" else "")
                                          for t in tools)
        cols = []
        if "xdfs" in tools and "gridftp" in tools:
            cols.append(("xDFS/GridFTP", "gridftp", tp))
        for peer in ("iperf3", "iperf3-z"):
            if "xdfs" in tools and peer in tools:
                cols.append((f"xDFS/{label(peer)}{' ‡' if data else ''}", peer, tp_data if data else tp))
        head += "".join(f" | {c[0]}" for c in cols) + " |"
        out.append(head)
        out.append("|" + "---:|" * (1 + len(tools) + len(cols) + (1 if data else 0)))
        for n in streams:
            row = f"| {n} | " + " | ".join(fmt_tp(tp(rs[(t, n)])) + (f" | {fmt_tp(tp_data(rs[(t, n)]))}" if data and t == "xdfs" else "")
                                           for t in tools)
            row += "".join(f" | {fmt_ratio(c[2](rs[('xdfs', n)]), tp(rs[(c[1], n)]))}" for c in cols)
            out.append(row + " |")
        if data and any(c[1].startswith("iperf3") for c in cols):
            out.append("\n‡ set-up excluded on both sides: xDFS's rate after its set-up (xduc's seconds less its "
                       "`setup_seconds`: every channel connected, secured and accepted) against iperf3's receiver "
                       "rate, which excludes its connection set-up. xDFS/GridFTP compares wall-clock rates.")
        out.append("\nCPU seconds per GiB moved (client / server) and peak resident memory in MiB (client / server), medians:\n")
        out.append("| streams | " + " | ".join(f"{label(t)} CPU s/GiB | {label(t)} RSS MiB" for t in tools) + " |")
        out.append("|" + "---:|" * (1 + 2 * len(tools)))
        for n in streams:
            cells = []
            for t in tools:
                r = rs[(t, n)]
                cells.append(f"{fmt_num(cpu_per_gib(r, 'client'))} / {fmt_num(cpu_per_gib(r, 'server'))}")
                cells.append(f"{fmt_num(rss_mib(r, 'client'), 1)} / {fmt_num(rss_mib(r, 'server'), 1)}")
            out.append(f"| {n} | " + " | ".join(cells) + " |")
        syscalls_table(agg, out, [([str(n)], {t: (scenario, t, direction, n, size, 1, link) for t in tools})
                                  for n in streams], tools, ["streams"])

        if plt is None:
            continue
        tag = f"{scenario}{'_' + link if link else ''}_{direction}" + (f"_{short_size(size)}" if len(sizes) > 1 else "")
        xt = (streams, [str(n) for n in streams])
        fname = f"{tag}_throughput.png"
        line_plot(plt, os.path.join(plots_dir, fname),
                  {"mem": "Parallel throughput", "cached": "Page-cached file to /dev/null"}.get(scenario, f"{link} throughput")
                  + f", {direction}" + (", memory to memory" if scenario != "cached" else ""),
                  "parallel streams", "MB/s",
                  [(label(t), TOOL_COLOR[t], "-" if not t.startswith("iperf3") else "--", streams, [tp(rs[(t, n)]) for n in streams])
                   for t in tools], logx=True, xticks=xt, note=f"{human(size)} per run; median, bars min–max")
        out.append(f"\n![{tag} throughput]({rel(fname)})")
        series_cpu, series_mem = [], []
        for t in tools:
            for side, style in (("client", "-"), ("server", "--")):
                series_cpu.append((f"{label(t)} {side}", TOOL_COLOR[t], style, streams,
                                   [Stat([r[f"{side}_cpu_s"] / r["seconds"] * 100 for r in rs[(t, n)]
                                          if isinstance(r.get(f"{side}_cpu_s"), (int, float))]) for n in streams]))
                series_mem.append((f"{label(t)} {side}", TOOL_COLOR[t], style, streams,
                                   [rss_mib(rs[(t, n)], side) for n in streams]))
        fname = f"{tag}_cpu.png"
        line_plot(plt, os.path.join(plots_dir, fname),
                  f"Client-server CPU usage, {direction}" + (", memory to memory" if scenario != "cached" else ""),
                  "parallel streams", "CPU % of one core (user+system)", series_cpu, logx=True, xticks=xt,
                  note="cpu seconds / wall seconds × 100")
        out.append(f"![{tag} cpu]({rel(fname)})")
        fname = f"{tag}_memory.png"
        line_plot(plt, os.path.join(plots_dir, fname), f"Client-server peak resident memory, {direction}",
                  "parallel streams", "MiB (peak RSS)", series_mem, logx=True, xticks=xt)
        out.append(f"![{tag} memory]({rel(fname)})\n")


def section_disk(agg: Agg, plt, plots_dir, rel, out):
    pts = agg.points("disk")
    if not pts:
        return
    tools = [t for t in ("xdfs", "xdfs-private", "gridftp") if any(p[2] == t for p in pts)]
    ratio = "xdfs" in tools and "gridftp" in tools
    combos = sorted({(p[5], p[4]) for p in pts})
    sizes = sorted({c[0] for c in combos})
    for direction in ("upload", "download"):
        if not any(p[3] == direction for p in pts):
            continue
        out.append(f"\n### {direction.capitalize()}\n")
        out.append("| file | streams | " + " | ".join(f"{label(t)} MB/s" for t in tools) +
                   (" | xDFS/GridFTP" if ratio else "") +
                   " | " + " | ".join(f"{label(t)} CPU s/GiB c/s | {label(t)} RSS MiB c/s" for t in tools) + " |")
        out.append("|" + "---:|" * (2 + len(tools) + (1 if ratio else 0) + 2 * len(tools)))
        for size, n in combos:
            rs = {t: agg.get("disk", t, direction, n, size) for t in tools}
            row = f"| {human(size)} | {n} | " + " | ".join(fmt_tp(tp(rs[t])) for t in tools)
            if ratio:
                row += f" | {fmt_ratio(tp(rs['xdfs']), tp(rs['gridftp']))}"
            for t in tools:
                row += (f" | {fmt_num(cpu_per_gib(rs[t], 'client'))} / {fmt_num(cpu_per_gib(rs[t], 'server'))}"
                        f" | {fmt_num(rss_mib(rs[t], 'client'), 1)} / {fmt_num(rss_mib(rs[t], 'server'), 1)}")
            out.append(row + " |")
        syscalls_table(agg, out, [([human(size), str(n)], {t: ("disk", t, direction, n, size) for t in tools})
                                  for size, n in combos], tools, ["file", "streams"])
        if plt is None:
            continue
        # Throughput and CPU against file size at one stream (paper figs 12-14).
        s1 = [s for s in sizes if any(agg.get("disk", t, direction, 1, s) for t in tools)]
        if len(s1) >= 1:
            xs = [s / MiB for s in s1]
            fname = f"disk_{direction}_throughput_vs_size.png"
            line_plot(plt, os.path.join(plots_dir, fname), f"Single stream throughput, {direction}, disk to disk",
                      "file size (MiB)", "MB/s",
                      [(label(t), TOOL_COLOR[t], "-", xs, [tp(agg.get("disk", t, direction, 1, s)) for s in s1]) for t in tools],
                      logx=True, xticks=(xs, [short_size(s) for s in s1]), note="median, bars min–max")
            out.append(f"\n![disk {direction} vs size]({rel(fname)})")
            fname = f"disk_{direction}_cpu_vs_size.png"
            series = []
            for t in tools:
                for side, style in (("client", "-"), ("server", "--")):
                    series.append((f"{label(t)} {side}", TOOL_COLOR[t], style, xs,
                                   [cpu_per_gib(agg.get("disk", t, direction, 1, s), side) for s in s1]))
            line_plot(plt, os.path.join(plots_dir, fname), f"Client-server CPU, single stream, {direction}",
                      "file size (MiB)", "CPU seconds per GiB", series, logx=True, xticks=(xs, [short_size(s) for s in s1]))
            out.append(f"![disk {direction} cpu vs size]({rel(fname)})")
        # Against streams at the largest size with a sweep (figs 15, 17, 18).
        sweep = [s for s in sizes if len({n for (sz, n) in combos if sz == s}) >= 3]
        if sweep:
            size = sweep[-1]
            ns = sorted({n for (sz, n) in combos if sz == size})
            xt = (ns, [str(n) for n in ns])
            fname = f"disk_{direction}_throughput_vs_streams.png"
            line_plot(plt, os.path.join(plots_dir, fname), f"Parallel throughput, {direction}, disk to disk, {human(size)}",
                      "parallel streams", "MB/s",
                      [(label(t), TOOL_COLOR[t], "-", ns, [tp(agg.get("disk", t, direction, n, size)) for n in ns]) for t in tools],
                      logx=True, xticks=xt, note="median, bars min–max")
            out.append(f"![disk {direction} vs streams]({rel(fname)})")
            fname = f"disk_{direction}_memory_vs_streams.png"
            series = []
            for t in tools:
                for side, style in (("client", "-"), ("server", "--")):
                    series.append((f"{label(t)} {side}", TOOL_COLOR[t], style, ns,
                                   [rss_mib(agg.get("disk", t, direction, n, size), side) for n in ns]))
            line_plot(plt, os.path.join(plots_dir, fname),
                      f"Client-server memory, disk to disk, {human(size)}, {direction}", "parallel streams",
                      "MiB (peak RSS)", series, logx=True, xticks=xt)
            out.append(f"![disk {direction} memory]({rel(fname)})\n")


def section_small(agg: Agg, plt, plots_dir, rel, out, recs):
    pts = agg.points("small")
    unsupported = sorted({r.get("error", "") for r in recs if r["scenario"] == "small" and r["status"] == "unsupported"})
    if not pts and not unsupported:
        return
    tools = [t for t in ("xdfs", "xdfs-private", "gridftp", "gridftp-pp", "gridftp-pp-cc", "rsync", "tar")
             if any(p[2] == t for p in pts)]

    def runs(t, size, files):
        # xDFS copies a tree over a few channels (its records carry that count); the peers run as one.
        direction = "local" if t in ("rsync", "tar") else "upload"
        return [r for k, g in agg.groups.items() if k[:4] == ("small", "", t, direction) and k[5:] == (size, files)
                for r in g]
    sets = sorted({(p[6], p[5]) for p in pts}, key=lambda x: (x[0], -x[1]))
    conc = sorted({r.get("concurrency") for r in recs if r.get("concurrency")})
    if unsupported:
        out.append("\nxDFS is not in this table yet: " + "; ".join(unsupported) + ". Its column fills in once "
                   "path mode lands (bench.py: `small_run`, `xdfs_tree_support`).\n")
    if conc:
        out.append(f"GridFTP -cc is {', '.join(map(str, conc))}. GridFTP rows copy the tree to the server (upload) "
                   "with `globus-url-copy -fast -r -cd`; rsync and tar copy it to another local directory.\n")
    out.append("| set | " + " | ".join(f"{mdl(t)} MB/s" for t in tools) + " | " +
               " | ".join(f"{mdl(t)} files/s" for t in tools) + " |")
    out.append("|" + "---:|" * (1 + 2 * len(tools)))
    values = {}
    for files, size in sets:
        grp = f"{files}×{short_size(size)}"
        cells, rates = [], []
        for t in tools:
            rs = runs(t, size, files)
            s = tp(rs)
            values[(grp, t)] = s
            cells.append(fmt_tp(s))
            fs = Stat([files / r["seconds"] for r in rs])
            rates.append("–" if fs.med is None else f"{fs.med:,.0f}")
        out.append(f"| {grp} | " + " | ".join(cells) + " | " + " | ".join(rates) + " |")
    streams = sorted({r["streams"] for r in recs if r["scenario"] == "small" and r["tool"].startswith("xdfs")})
    if "rsync" in tools and any(t.startswith("xdfs") for t in tools):
        xt = [t for t in tools if t.startswith("xdfs")]
        out.append(f"\nWall-clock seconds (median) against a local `rsync -a` of the same tree, in the same run "
                   f"(xDFS with {', '.join(map(str, streams))} channels):\n")
        out.append("| set | rsync s | " + " | ".join(f"{mdl(t)} s | {mdl(t)} ÷ rsync" for t in xt) + " |")
        out.append("|" + "---:|" * (2 + 2 * len(xt)))
        for files, size in sets:
            base = Stat([r["seconds"] for r in runs("rsync", size, files)])
            cells = [fmt_num(base, 2)]
            for t in xt:
                mine = Stat([r["seconds"] for r in runs(t, size, files)])
                cells.append(fmt_num(mine, 2))
                ratio = None if mine.med is None or not base.med else mine.med / base.med
                cells.append("–" if ratio is None else f"{ratio:.2f}")
            out.append(f"| {files}×{short_size(size)} | " + " | ".join(cells) + " |")
    out.append("\nCPU seconds (client+server, median) and peak RSS MiB (client / server):\n")
    out.append("| set | " + " | ".join(f"{mdl(t)} CPU s | {mdl(t)} RSS MiB" for t in tools) + " |")
    out.append("|" + "---:|" * (1 + 2 * len(tools)))
    for files, size in sets:
        cells = []
        for t in tools:
            rs = runs(t, size, files)
            cpu = Stat([r["client_cpu_s"] + (r.get("server_cpu_s") or 0) for r in rs])
            cells.append(fmt_num(cpu))
            srv = rss_mib(rs, "server")
            cells.append(f"{fmt_num(rss_mib(rs, 'client'), 1)} / {fmt_num(srv, 1) if srv.med is not None else '–'}")
        out.append(f"| {files}×{short_size(size)} | " + " | ".join(cells) + " |")
    if plt is not None and sets:
        fname = "small_throughput.png"
        groups = [f"{f}×{short_size(s)}" for f, s in sets]
        bar_plot(plt, os.path.join(plots_dir, fname), "Lots of small files (same bytes, more files)", "MB/s",
                 groups, tools, values, note="xDFS: no path mode yet" if "xdfs" not in tools else None)
        out.append(f"\n![small files]({rel(fname)})\n")


def section_link(agg: Agg, plt, plots_dir, rel, out, recs):
    links = sorted({p[1] for p in agg.points("link")}, key=lambda s: float(s.rstrip("gmkbit") or 0))
    unsupported = sorted({r.get("error", "") for r in recs if r["scenario"] == "link" and r["status"] == "unsupported"})
    if unsupported:
        out.append("\nNot run: " + "; ".join(unsupported) + "\n")
    if not links:
        return
    out.append("\nEach tool's throughput as a share of iperf3's on the same link, direction and stream count "
               "(memory to memory: `xduc --memory`, `globus-url-copy -len` from /dev/zero to /dev/null).\n")
    out.append("| link | direction | streams | iperf3 MB/s | xDFS MB/s | xDFS private MB/s | GridFTP MB/s | "
               "xDFS % of iperf3 | xDFS private % | GridFTP % of iperf3 | xDFS/GridFTP |")
    out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    share_vals = {}
    groups = []
    for link in links:
        pts = agg.points("link", link)
        size = sorted({p[5] for p in pts})[-1]
        for direction in ("upload", "download"):
            for n in sorted({p[4] for p in pts if p[3] == direction}):
                ip = tp(agg.get("link", "iperf3", direction, n, size, 1, link))
                xd = tp(agg.get("link", "xdfs", direction, n, size, 1, link))
                xp = tp(agg.get("link", "xdfs-private", direction, n, size, 1, link))
                gf = tp(agg.get("link", "gridftp", direction, n, size, 1, link))

                def share(s):
                    return "–" if s.med is None or not ip.med else f"{100 * s.med / ip.med:.0f}%"
                out.append(f"| {link} | {direction} | {n} | {fmt_tp(ip)} | {fmt_tp(xd)} | {fmt_tp(xp)} | {fmt_tp(gf)} | "
                           f"{share(xd)} | {share(xp)} | {share(gf)} | {fmt_ratio(xd, gf)} |")
                grp = f"{link}\n{'up' if direction == 'upload' else 'down'} p{n}"
                groups.append(grp)
                for t, s in (("xdfs", xd), ("xdfs-private", xp), ("gridftp", gf)):
                    if s.med is not None and ip.med:
                        share_vals[(grp, t)] = Stat([100 * r["bytes_per_second"] / 1e6 / ip.med
                                                      for r in agg.get("link", t, direction, n, size, 1, link)])
    if plt is not None and groups:
        fname = "link_share.png"
        bar_plot(plt, os.path.join(plots_dir, fname), "Share of iperf3 throughput on a shaped link",
                 "% of iperf3 (median)", groups, [t for t in ("xdfs", "xdfs-private", "gridftp")
                                                   if any(k[1] == t for k in share_vals)], share_vals)
        out.append(f"\n![link share]({rel(fname)})\n")
        for link in links:
            section_mem(agg, plt, plots_dir, rel, [], scenario="link", link=link)  # plots only
            for direction in ("upload", "download"):
                f = f"link_{link}_{direction}_throughput.png"
                if os.path.exists(os.path.join(plots_dir, f)):
                    out.append(f"![{link} {direction}]({rel(f)})")
        out.append("")


def section_micro(micro, out):
    if not micro or "benchmarks" not in micro:
        return
    out.append("\n## Micro-benchmarks (Google Benchmark, perf/micro)\n")
    ctx = micro.get("context", {})
    out.append(f"{ctx.get('num_cpus', '?')} CPUs at {ctx.get('mhz_per_cpu', '?')} MHz, "
               f"library build {ctx.get('library_build_type', '?')}.\n")
    out.append("| benchmark | time | CPU | bytes | items |")
    out.append("|---|---:|---:|---:|---:|")
    for b in micro["benchmarks"]:
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        unit = b.get("time_unit", "ns")
        by = f"{b['bytes_per_second'] / GiB:,.2f} GiB/s" if "bytes_per_second" in b else ""
        it = f"{b['items_per_second'] / 1e6:,.2f} M/s" if "items_per_second" in b else ""
        name = b.get("run_name", b["name"]) + (f" ({b['label']})" if b.get("label") else "")
        out.append(f"| {name} | {b['real_time']:.3g} {unit} | {b['cpu_time']:.3g} {unit} | {by} | {it} |")


def aead_pass_seconds_per_gib(micro) -> float | None:
    """Seconds one core takes for one pass of xDFS's own block sealing over a GiB: half of
    BM_BlockSealOpen's seal and open of 1 MiB blocks (private, AES-256-GCM), its median."""
    for b in (micro or {}).get("benchmarks", []):
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        name = b.get("run_name", b.get("name", ""))
        if (name.startswith("BM_BlockSealOpen/") and name.split("/")[3:4] == ["bytes:1048576"]
                and b.get("label") == "private, AES-256/GCM" and b.get("bytes_per_second")):
            return GiB / b["bytes_per_second"] / 2
    return None


def section_private_cost(agg: Agg, micro, out):
    """What private mode costs per byte beyond clear mode, memory to memory, against one pass of
    the cipher on each side (the floor item 3 of the ZxDFS issue holds it to)."""
    aead = aead_pass_seconds_per_gib(micro)
    pts = [p for p in agg.points("mem", None) if p[2] == "xdfs-private"]
    if aead is None or not pts:
        return
    rows = []
    for p in sorted(pts, key=lambda p: (p[3] != "upload", p[4], p[5])):
        direction, n, size = p[3], p[4], p[5]
        clear, private = agg.get("mem", "xdfs", direction, n, size), agg.get("mem", "xdfs-private", direction, n, size)
        cells = []
        for side in ("client", "server"):
            c, q = cpu_per_gib(clear, side).med, cpu_per_gib(private, side).med
            cells.append("–" if c is None or q is None else f"{q - c:.2f} ({(q - c) / aead:.2f}x)")
        rows.append(f"| {direction} | {n} | {human(size)} | {cells[0]} | {cells[1]} |")
    out.append("\n## What private mode costs per byte\n")
    out.append("CPU seconds per GiB that xDFS private uses beyond xDFS clear, memory to memory (medians; memory "
               "sessions never hash), and that as a multiple of one pass of xDFS's own block sealing on one core "
               f"({aead:.3f} s/GiB: half of BM_BlockSealOpen's seal and open of 1 MiB, below). Besides that pass, "
               "the difference holds what clear mode does not do at all here: a clear sender sends from the zero "
               "page and a clear receiver discards by splice, where a private sender sends each block from a slot it "
               "sealed in place and a private receiver reads each block into memory to open it.\n")
    out.append("| direction | streams | size | client: private − clear s/GiB (× one pass) | server |")
    out.append("|---|---:|---:|---:|---:|")
    out.extend(rows)


def behind(agg: Agg, out):
    """Points where xDFS's median is below a peer's, and memory runs far below iperf3."""
    rows = []
    for k, rs in agg.groups.items():
        sc, link, tool, direction, n, size, files = k
        if tool != "xdfs":  # clear mode: the like-for-like one (private is encrypted, GridFTP is not)
            continue
        for peer in ("gridftp", "iperf3", "iperf3-z"):
            prs = agg.groups.get((sc, link, peer, direction, n, size, files))
            if not prs:
                continue
            # Against iperf3 set-up is left out on both sides, as in the tables (‡); the link
            # table's shares are wall-clock.
            x = tp_data(rs) if peer.startswith("iperf3") and sc != "link" else tp(rs)
            p = tp(prs)
            if peer == "gridftp" and x.med < 0.95 * p.med:
                rows.append((sc, link, tool, direction, n, size, peer, x.med / p.med))
            if peer.startswith("iperf3") and x.med < 0.7 * p.med:
                rows.append((sc, link, tool, direction, n, size, peer, x.med / p.med))
    if not rows:
        out.append("\nxDFS's median is within 5% of GridFTP's or above it at every point measured, and at least 70% "
                   "of iperf3's (and of iperf3 -Z's).\n")
        return
    out.append("\n## Where xDFS is behind\n")
    out.append("xDFS (`--protect clear`) median more than 5% below GridFTP's, or below 70% of iperf3's or iperf3 -Z's "
               "(the ceilings; set-up left out of both sides except in link mode):\n")
    out.append("| scenario | xDFS mode | direction | streams | size | peer | xDFS/peer |")
    out.append("|---|---|---|---:|---:|---|---:|")
    for sc, link, tool, direction, n, size, peer, ratio in sorted(rows):
        out.append(f"| {sc}{' ' + link if link else ''} | {label(tool)} | {direction} | {n} | {human(size)} | "
                   f"{label(peer)} | {ratio:.2f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", help="a results directory written by perf/bench.py (perf/run.sh)")
    ap.add_argument("--md", default=os.path.join(PERF_DIR, "RESULTS.md"), help="where to write the markdown")
    ap.add_argument("--plots", default=os.path.join(PERF_DIR, "plots"), help="directory for the PNG plots")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)

    recs, meta, micro = load(args.outdir)
    agg = Agg(recs)
    plt = None if args.no_plots else plotter()
    os.makedirs(args.plots, exist_ok=True)
    # Only this report's own plots go: perf/pull.py and perf/relay.py publish theirs here too.
    for f in os.listdir(args.plots):
        if f.endswith(".png") and f.startswith(("mem_", "disk_", "small_", "link_", "cached_")):
            os.unlink(os.path.join(args.plots, f))
    md_dir = os.path.dirname(os.path.abspath(args.md))

    def rel(fname):
        return os.path.relpath(os.path.join(os.path.abspath(args.plots), fname), md_dir)

    m = meta.get("machine", {})
    v = meta.get("versions", {})
    o = meta.get("options", {})
    out = ["# xDFS side-by-side benchmarks", ""]
    if meta.get("smoke"):
        out.append("**Smoke run: tiny sizes, few repetitions. These numbers mean nothing; they show the driver works.**\n")
    out.append(f"Generated by `perf/report.py` from `{os.path.relpath(os.path.abspath(args.outdir), md_dir)}` "
               f"(`perf/run.sh`; see perf/README.md for what each scenario measures and how).\n")
    out.append(f"* commit `{meta.get('commit', '?')}`{' with uncommitted changes' if meta.get('dirty') else ''}"
               f" ({meta.get('branch', '?')})")
    out.append(f"* machine: {m.get('nproc', '?')} × {m.get('cpu_model', '?')}, {m.get('mem_gib', '?')} GiB, "
               f"kernel {m.get('kernel', '?')}, {m.get('os', '?')}")
    out.append(f"* run: {meta.get('started_at', '?')} → {meta.get('finished_at', '?')}, "
               f"{meta.get('wall_seconds', '?')} s, {meta.get('runs_done', len(recs))} runs, "
               f"{o.get('reps', '?')} repetitions of each point, tools taking turns")
    for rr in meta.get("reruns", []):
        out.append(f"* re-run since: {', '.join(rr.get('scenarios', []))} at commit `{rr.get('commit_short', '?')}`"
                   f"{' with uncommitted changes' if rr.get('dirty') else ''}, {rr.get('started_at', '?')} → "
                   f"{rr.get('finished_at', '?')}, {rr.get('runs', '?')} runs (its records replace the earlier ones)")
    pr = meta.get("page_reporting") or {}
    if pr:
        said = {"yes": "held off for the run", "already": "already off"}.get(pr.get("held", ""), pr.get("held", "?"))
        out.append(f"* free page reporting to the hypervisor (page_reporting_order {pr.get('order', '?')}): {said}, "
                   "so freed memory stays with this guest and no tool meets slow first touches of returned pages")
    if meta.get("scenario_seconds"):
        out.append("* time per scenario: " + ", ".join(f"{k} {v:.0f} s" for k, v in meta["scenario_seconds"].items()))
    out.append(f"* peers: {v.get('gridftp_server', '?')}; {v.get('globus_url_copy', '?')}; {v.get('iperf3', '?')}; "
               f"{v.get('rsync', '?')}; {v.get('tar', '?')}")
    out.append(f"* block size {o.get('block_size', '?')} for xduc and globus-url-copy/-server; TCP buffers left to "
               "kernel autotuning for every tool")
    if meta.get("xsec"):
        out.append("* xDFS = `xduc --protect clear` (control frames MACed, data as is: GridFTP's anonymous clear data "
                   "channel is the like-for-like peer); xDFS private = xduc's default `--protect private` "
                   "(every frame AES-256-GCM)")
    if o.get("xduc_extra") or o.get("xdfsd_extra"):
        out.append(f"* extra xduc arguments `{o.get('xduc_extra')}`, xdfsd `{o.get('xdfsd_extra')}`")
    out.append("")
    out.append("Throughput is bytes delivered / wall-clock seconds of the client process (connection set-up "
               "included), in MB/s (10^6 bytes/s): median (min–max) over the repetitions. iperf3, the ceiling, is "
               f"timed instead (`-t {o.get('iperf_time', '?')}`) and reports its receiver's rate, set-up excluded. "
               "CPU is user+system seconds of the whole process tree from wait4(); memory is peak resident set "
               "(ru_maxrss). Client and server share the same 2 cores on loopback, so loopback throughput is "
               "CPU-bound: compare CPU per GiB as much as MB/s.")

    for sc in ("mem", "disk", "small", "link", "cached"):
        if not any(r["scenario"] == sc for r in recs):
            continue
        out.append(f"\n## {SCEN_TITLE[sc]}")
        if sc == "mem":
            section_mem(agg, plt, args.plots, rel, out)
        elif sc == "cached":
            section_mem(agg, plt, args.plots, rel, out, scenario="cached")
        elif sc == "disk":
            section_disk(agg, plt, args.plots, rel, out)
        elif sc == "small":
            section_small(agg, plt, args.plots, rel, out, recs)
        elif sc == "link":
            section_link(agg, plt, args.plots, rel, out, recs)

    behind(agg, out)
    section_private_cost(agg, micro, out)
    section_micro(micro, out)

    failed = [r for r in agg.other if r["status"] == "failed"]
    if failed:
        out.append("\n## Failed runs\n")
        for r in failed:
            out.append(f"* {r['scenario']} {r['tool']} {r['direction']} p={r['streams']} {human(r['bytes'])} "
                       f"rep {r['rep']}: {r.get('error', '')[:300]}")
    out.append("")
    os.makedirs(md_dir, exist_ok=True)
    with open(args.md, "w") as f:
        f.write("\n".join(out))
    n_png = len([f for f in os.listdir(args.plots) if f.endswith(".png")])
    print(f"report: wrote {args.md} and {n_png} plots in {args.plots}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
