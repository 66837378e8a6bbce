#!/usr/bin/python3
"""What one session for many files saves: the measurements of the session issue, by one command.

1. Many files: FILES files of SIZE each uploaded to one xdfsd over loopback, as one xduc command
   with every file a source (one session: the channels are set up once, each file one xFTSM
   transfer on them), against one xduc run per file. The two take turns, REPS times each.
2. Set-up paid once: SMALL small files with -p CHANNELS (256 by default) as one command, against
   one run per file. Prints the session's set-up (xduc's setup_seconds) and the whole time.
3. A large file inside a tree: a tree of TREE_FILES files of TREE_SIZE plus one file of BIG,
   uploaded with xduc -r (the big file goes as an xFTSM transfer of its own on the tree's
   session), against the big file alone (one xduc upload) and the tree all in path mode
   (--large-file 0). Prints the big file's rate inside the tree (xduc's large_bytes and
   large_seconds) over its rate alone (bytes over seconds less the set-up).

    perf/session.py [--xdfs-bin DIR] [--files 100] [--size 10M] [--streams 8] [--reps 3]
                    [--small 20] [--channels 256] [--protect private]
                    [--tree-files 1000] [--tree-size 1M] [--big 4G] [--only many,setup,tree]
                    [--smoke] [--json FILE]

Timings are printed, never judged: --smoke (tiny sizes) fails only when a run fails, so ctest can
keep the script working. Run it with nothing else busy on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from xsec import SRC_ROOT, Server, fail, parse_size, summary  # noqa: E402


def make_files(where: str, count: int, size: int, prefix: str) -> list[str]:
    os.makedirs(where, exist_ok=True)
    chunk = os.urandom(1 << 20)
    paths = []
    for i in range(count):
        p = os.path.join(where, f"{prefix}{i:04d}.bin")
        with open(p, "wb") as f:
            left = size
            while left > 0:
                n = min(left, len(chunk))
                f.write(chunk[:n])
                left -= n
        paths.append(p)
    return paths


def run(srv: Server, args: list[str]) -> tuple[float, dict]:
    """Runs one xduc command; returns its wall time and its JSON summary."""
    t0 = time.monotonic()
    r = subprocess.run([srv.xduc, "-q", "--json", *srv.auth, *args], capture_output=True, text=True)
    dt = time.monotonic() - t0
    if r.returncode != 0:
        fail(f"xduc {' '.join(args[:6])}... failed: {r.stderr.strip()}")
    try:
        return dt, json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        fail(f"xduc printed no JSON summary: {r.stdout!r}")
        raise


def one_vs_many(srv: Server, files: list[str], dest: str, reps: int, common: list[str]) -> dict:
    """The files as one command and as one run each, taking turns; wall seconds of each rep."""
    out = {"one_command": [], "separate_runs": [], "setup_seconds": []}
    for rep in range(reps):
        order = ["one_command", "separate_runs"] if rep % 2 == 0 else ["separate_runs", "one_command"]
        for how in order:
            if how == "one_command":
                dt, s = run(srv, [*common, *files, f"{srv.url}/{dest}/"])
                if s.get("files") != len(files) or s.get("failed") != 0:
                    fail(f"one command: unexpected summary {s}")
                out["setup_seconds"].append(s["setup_seconds"])
            else:
                dt = 0.0
                for f in files:
                    d, _ = run(srv, [*common, f, f"{srv.url}/{dest}/"])
                    dt += d
            out[how].append(dt)
    return out


def tree_vs_alone(srv: Server, tree: str, big: str, reps: int, common: list[str], large: str) -> dict:
    """The tree (its big file as its own transfer), the big file alone, and the tree all in path
    mode, taking turns; the big file's rate in the first two, wall seconds of all three."""
    out = {"tree_big_rate": [], "alone_rate": [], "tree_seconds": [], "alone_seconds": [], "path_only_seconds": []}
    hows = ["tree", "alone", "path_only"]
    for how in hows:  # one untimed round first: the pages the runs write into have been used once
        shutil.rmtree(os.path.join(srv.root, "tree"), ignore_errors=True)
        run(srv, [*common, "-r", "--large-file", large if how == "tree" else "0", tree + "/", f"{srv.url}/tree"])
    for rep in range(reps):
        for how in hows[rep % 3:] + hows[:rep % 3]:
            shutil.rmtree(os.path.join(srv.root, "tree"), ignore_errors=True)
            if how == "alone":
                # The destination as the tree's big file finds it: the small files already there
                # (untimed). Writing into memory the machine has not used for a while costs more
                # than into memory it has (on a VM whose host takes freed pages back, much more),
                # so the two must write the big file with the same memory in use.
                run(srv, [*common, "-r", "--large-file", "0", os.path.join(tree, "small"), f"{srv.url}/tree/"])
                dt, s = run(srv, [*common, big, f"{srv.url}/tree/{os.path.basename(big)}"])
                out["alone_rate"].append(s["bytes"] / max(s["seconds"] - s["setup_seconds"], 1e-9))
                out["alone_seconds"].append(dt)
            else:
                dt, s = run(srv, [*common, "-r", "--large-file", large if how == "tree" else "0", tree + "/",
                                  f"{srv.url}/tree"])
                if s.get("failed") != 0:
                    fail(f"tree copy: unexpected summary {s}")
                if how == "tree":
                    if s.get("large_files") != 1:
                        fail(f"tree copy: the big file did not go as its own transfer: {s}")
                    out["tree_big_rate"].append(s["large_bytes"] / max(s["large_seconds"], 1e-9))
                    out["tree_seconds"].append(dt)
                else:
                    if s.get("large_files") != 0:
                        fail(f"tree copy with --large-file 0: {s}")
                    out["path_only_seconds"].append(dt)
    shutil.rmtree(os.path.join(srv.root, "tree"), ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--xdfs-bin", default=os.path.join(SRC_ROOT, "build-perf", "examples"),
                    help="directory holding xdfsd and xduc (default build-perf/examples)")
    ap.add_argument("--files", type=int, default=100)
    ap.add_argument("--size", default="10M")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--small", type=int, default=20, help="small files for the set-up measurement")
    ap.add_argument("--small-size", default="64K")
    ap.add_argument("--channels", type=int, default=256)
    ap.add_argument("--protect", default="private")
    ap.add_argument("--tree-files", type=int, default=1000, help="small files of the tree with a big file")
    ap.add_argument("--tree-size", default="1M")
    ap.add_argument("--big", default="4G", help="the tree's big file")
    ap.add_argument("--large-file", default="64M", help="xduc --large-file for the tree")
    ap.add_argument("--only", default="many,setup,tree", help="which measurements (comma-separated)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 2 runs each: checks that it works")
    ap.add_argument("--json", default="", help="also write every run to this file")
    a = ap.parse_args()
    if a.smoke:
        a.files, a.size, a.reps, a.small, a.channels, a.streams = 4, "256K", 2, 3, 16, 2
        a.tree_files, a.tree_size, a.big, a.large_file = 20, "64K", "3M", "1M"
    only = set(a.only.split(","))
    size = parse_size(a.size)
    big = parse_size(a.big)
    tree_bytes = a.tree_files * parse_size(a.tree_size) + big
    need = ((a.files * size * 2) if "many" in only else 0) + ((tree_bytes * 2) if "tree" in only else 0) + (256 << 20)
    base = "/dev/shm" if shutil.disk_usage("/dev/shm").free > need else tempfile.gettempdir()
    with tempfile.TemporaryDirectory(prefix="xdfs-session-", dir=base) as top, \
            tempfile.TemporaryDirectory(prefix="xdfs-session-work-") as work:
        root = os.path.join(top, "root")
        os.makedirs(os.path.join(root, "many"))
        os.makedirs(os.path.join(root, "small"))
        files = make_files(os.path.join(top, "src"), a.files, size, "f") if "many" in only else []
        small = make_files(os.path.join(top, "small"), a.small, parse_size(a.small_size), "s") if "setup" in only else []
        tree = os.path.join(top, "tree")
        if "tree" in only:
            make_files(os.path.join(tree, "small"), a.tree_files, parse_size(a.tree_size), "t")
            make_files(tree, 1, big, "big")
        srv = Server(a.xdfs_bin, root, work)
        srv.root = root
        many, setup, inside = {}, {}, {}
        try:
            commit = subprocess.run(["git", "-C", SRC_ROOT, "rev-parse", "--short", "HEAD"],
                                    capture_output=True, text=True).stdout.strip()
            print(f"# One session, many files, at {commit or '?'}: loopback, --protect {a.protect}, "
                  f"files in {base}; {os.cpu_count()} CPUs\n")
            if "many" in only:
                many = one_vs_many(srv, files, "many", a.reps, ["-p", str(a.streams), "--protect", a.protect])
                med1, lo1, hi1 = summary(many["one_command"])
                medn, lon, hin = summary(many["separate_runs"])
                print(f"{a.files} files of {a.size}, -p {a.streams}, {a.reps} runs each taking turns:\n")
                print("| how | seconds median | range | MB/s |")
                print("|---|---|---|---|")
                total = a.files * size
                print(f"| one xduc command, one session | {med1:.2f} | {lo1:.2f}–{hi1:.2f} | {total / med1 / 1e6:.0f} |")
                print(f"| {a.files} xduc runs | {medn:.2f} | {lon:.2f}–{hin:.2f} | {total / medn / 1e6:.0f} |")
                print(f"\nOne command takes {med1 / medn:.2f} of the time of {a.files} runs.\n")
            if "setup" in only:
                setup = one_vs_many(srv, small, "small", a.reps, ["-p", str(a.channels), "--protect", a.protect])
                s1, _, _ = summary(setup["one_command"])
                sn, _, _ = summary(setup["separate_runs"])
                ss, slo, shi = summary(setup["setup_seconds"])
                print(f"{a.small} files of {a.small_size} with -p {a.channels}, {a.reps} runs each taking turns:\n")
                print("| how | seconds median | per file |")
                print("|---|---|---|")
                print(f"| one xduc command, one session | {s1:.3f} | {s1 / a.small * 1000:.1f} ms |")
                print(f"| {a.small} xduc runs | {sn:.3f} | {sn / a.small * 1000:.1f} ms |")
                print(f"\nThe session's set-up with {a.channels} channels: {ss * 1000:.1f} ms median "
                      f"({slo * 1000:.1f}–{shi * 1000:.1f}), paid once by the one command and {a.small} times by the runs.\n")
            if "tree" in only:
                inside = tree_vs_alone(srv, tree, os.path.join(tree, "big0000.bin"), a.reps,
                                       ["-p", str(a.streams), "--protect", a.protect], a.large_file)
                rt, rlo, rhi = summary(inside["tree_big_rate"])
                ra, alo, ahi = summary(inside["alone_rate"])
                tt, _, _ = summary(inside["tree_seconds"])
                ta, _, _ = summary(inside["alone_seconds"])
                tp, _, _ = summary(inside["path_only_seconds"])
                print(f"A tree of {a.tree_files} files of {a.tree_size} and one of {a.big}, -p {a.streams}, "
                      f"{a.reps} runs each taking turns:\n")
                print("| what | MB/s of the big file median | range | whole command, s |")
                print("|---|---|---|---|")
                print(f"| the tree, big file as its own transfer | {rt / 1e6:.0f} | {rlo / 1e6:.0f}–{rhi / 1e6:.0f} "
                      f"| {tt:.2f} |")
                print(f"| the big file alone | {ra / 1e6:.0f} | {alo / 1e6:.0f}–{ahi / 1e6:.0f} | {ta:.2f} |")
                print(f"| the tree all in path mode (--large-file 0) | | | {tp:.2f} |")
                print(f"\nInside the tree the big file moves at {rt / ra:.2f}x its rate alone.\n")
            with open(srv.log.name) as f:
                log = f.read()
            if a.json:
                with open(a.json, "w") as f:
                    json.dump({"commit": commit, "args": vars(a), "many": many, "setup": setup, "tree": inside}, f,
                              indent=1)
        finally:
            srv.stop()
        # One session per command: one start line per command, the others are operations of it.
        starts = log.count(" start peer=")
        expect = (a.reps * (1 + a.files) if "many" in only else 0) + (a.reps * (1 + a.small) if "setup" in only else 0)
        expect += (4 * a.reps + 3) if "tree" in only else 0
        if starts != expect:
            fail(f"the server saw {starts} sessions, {expect} expected")


if __name__ == "__main__":
    main()
