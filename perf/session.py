#!/usr/bin/python3
"""What one session for many files saves: the measurements of the session issue, by one command.

1. Many files: FILES files of SIZE each uploaded to one xdfsd over loopback, as one xduc command
   with every file a source (one session: the channels are set up once, each file one xFTSM
   transfer on them), against one xduc run per file. The two take turns, REPS times each.
2. Set-up paid once: SMALL small files with -p CHANNELS (256 by default) as one command, against
   one run per file. Prints the session's set-up (xduc's setup_seconds) and the whole time.

    perf/session.py [--xdfs-bin DIR] [--files 100] [--size 10M] [--streams 8] [--reps 3]
                    [--small 20] [--channels 256] [--protect private] [--smoke] [--json FILE]

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
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 2 runs each: checks that it works")
    ap.add_argument("--json", default="", help="also write every run to this file")
    a = ap.parse_args()
    if a.smoke:
        a.files, a.size, a.reps, a.small, a.channels, a.streams = 4, "256K", 2, 3, 16, 2
    size = parse_size(a.size)
    need = a.files * size * 2 + (256 << 20)
    base = "/dev/shm" if shutil.disk_usage("/dev/shm").free > need else tempfile.gettempdir()
    with tempfile.TemporaryDirectory(prefix="xdfs-session-", dir=base) as top, \
            tempfile.TemporaryDirectory(prefix="xdfs-session-work-") as work:
        root = os.path.join(top, "root")
        os.makedirs(os.path.join(root, "many"))
        os.makedirs(os.path.join(root, "small"))
        files = make_files(os.path.join(top, "src"), a.files, size, "f")
        small = make_files(os.path.join(top, "small"), a.small, parse_size(a.small_size), "s")
        srv = Server(a.xdfs_bin, root, work)
        try:
            commit = subprocess.run(["git", "-C", SRC_ROOT, "rev-parse", "--short", "HEAD"],
                                    capture_output=True, text=True).stdout.strip()
            print(f"# One session, many files, at {commit or '?'}: loopback, --protect {a.protect}, "
                  f"files in {base}; {os.cpu_count()} CPUs\n")
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
                  f"({slo * 1000:.1f}–{shi * 1000:.1f}), paid once by the one command and {a.small} times by the runs.")
            with open(srv.log.name) as f:
                log = f.read()
            if a.json:
                with open(a.json, "w") as f:
                    json.dump({"commit": commit, "args": vars(a), "many": many, "setup": setup}, f, indent=1)
        finally:
            srv.stop()
        # One session per command: one start line per command, the others are operations of it.
        starts = log.count(" start peer=")
        expect = a.reps * (1 + a.files) + a.reps * (1 + a.small)
        if starts != expect:
            fail(f"the server saw {starts} sessions, {expect} expected")


if __name__ == "__main__":
    main()
