#!/usr/bin/python3
"""How close the rate limits come to their rate: xduc --limit-rate, xdfsd --max-rate (per session)
and --max-total-rate (all sessions), each over about SECONDS of transfer.

Uploads read a file in a RAM-backed directory and downloads write to /dev/null, so neither disk
nor the loopback link is the bound: the limit is. Prints, per case, the rate the client measured
(bytes over its seconds, set-up included) against the limit, and the error.

    perf/rate.py [--xdfs-bin DIR] [--rate 50M] [--seconds 10] [--streams 4] [--reps 3] [--smoke]

Timings are printed, never judged: --smoke (tiny sizes) fails only when a run fails. Run it with
nothing else busy on the machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from xsec import SRC_ROOT, Server, fail, parse_size, write_random  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--xdfs-bin", default=os.path.join(SRC_ROOT, "build-perf", "examples"))
    ap.add_argument("--rate", default="50M", help="the limit, bytes per second in binary units (default 50M)")
    ap.add_argument("--seconds", type=float, default=10, help="length of each transfer at the limit (default 10)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="1 second at 4M, 1 run each")
    a = ap.parse_args()
    if a.smoke:
        a.rate, a.seconds, a.reps = "4M", 1.0, 1
    rate = parse_size(a.rate)
    size = int(rate * a.seconds)
    base = "/dev/shm" if shutil.disk_usage("/dev/shm").free > 3 * size + (256 << 20) else tempfile.gettempdir()
    with tempfile.TemporaryDirectory(prefix="xdfs-rate-", dir=base) as root, \
            tempfile.TemporaryDirectory(prefix="xdfs-rate-src-", dir=base) as src, \
            tempfile.TemporaryDirectory(prefix="xdfs-rate-work-") as work:
        f = os.path.join(src, "f")
        write_random(f, size)
        shutil.copy(f, os.path.join(root, "f"))
        p = ["-p", str(a.streams)]
        cases = [
            ("xduc --limit-rate, upload", (), lambda s: [[*p, "--limit-rate", a.rate, f, f"{s.url}/up"]]),
            ("xduc --limit-rate, download", (), lambda s: [[*p, "--limit-rate", a.rate, f"{s.url}/f", "/dev/null"]]),
            ("xdfsd --max-rate, upload", ("--max-rate", a.rate), lambda s: [[*p, f, f"{s.url}/up"]]),
            ("xdfsd --max-rate, download", ("--max-rate", a.rate), lambda s: [[*p, f"{s.url}/f", "/dev/null"]]),
            ("xdfsd --max-total-rate, 2 sessions", ("--max-total-rate", a.rate),
             lambda s: [[*p, f"{s.url}/f", "/dev/null"], [*p, f, f"{s.url}/up"]]),
        ]
        print(f"# Rate limits at {a.rate}/s ({rate / 1e6:.1f} MB/s), {a.seconds:g} s at the limit per session, "
              f"-p {a.streams}, {a.reps} runs each; {os.cpu_count()} CPUs\n")
        print("| case | limit MiB/s | measured MiB/s median | range | error |")
        print("|---|---|---|---|---|")
        for name, extra, commands in cases:
            d = os.path.join(work, name.split()[0] + str(abs(hash(name))))
            os.makedirs(d)
            srv = Server(a.xdfs_bin, root, d, extra)
            try:
                got = []
                for _ in range(a.reps):
                    cmds = commands(srv)
                    results: list = [None] * len(cmds)

                    def one(i: int, args: list[str]) -> None:
                        results[i] = srv.xduc_json(args)[0]

                    t0 = time.monotonic()
                    ts = [threading.Thread(target=one, args=(i, c)) for i, c in enumerate(cmds)]
                    for t in ts:
                        t.start()
                    for t in ts:
                        t.join()
                    if any(r is None for r in results):
                        fail(f"{name}: a transfer failed")
                    if len(cmds) == 1:
                        got.append(results[0]["bytes"] / results[0]["seconds"])
                    else:  # all sessions together over the wall time
                        got.append(sum(r["bytes"] for r in results) / (time.monotonic() - t0))
                med = statistics.median(got)
                print(f"| {name} | {rate / 2**20:.1f} | {med / 2**20:.2f} | {min(got) / 2**20:.2f}–{max(got) / 2**20:.2f} "
                      f"| {(med - rate) / rate:+.1%} |")
            finally:
                srv.stop()


if __name__ == "__main__":
    main()
