#!/usr/bin/python3
"""What resume costs and saves: a disk-to-disk download and upload of SIZE with the resume
bookkeeping (the default: hashing nothing more, a record beside the partial file every 16 MiB or
second) against --no-resume, taking turns, medians; then a transfer cut half-way (the client
killed) and the same command again, reporting what crossed the network.

    perf/resume.py [--xdfs-bin DIR] [--size 2G] [--streams 4] [--reps 5] [--dir DIR] [--smoke]

Files go to --dir (default: the system's temporary directory, a real disk here; /dev/shm
measures without the disk). Timings are printed, never judged: --smoke (small
sizes) fails only when a run fails. Run it with nothing else busy on the machine.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from xsec import disk_args, disk_bench, fail, parse_size  # noqa: E402


def main() -> None:
    a = disk_args(__doc__)
    size = parse_size(a.size)
    with disk_bench("resume", a) as (srv, root, local, src):
        os.link(src, os.path.join(root, "f"))
        p = ["-p", str(a.streams)]
        print(f"# Resume bookkeeping, {a.size} disk to disk under {a.dir}, -p {a.streams}, clear, "
              f"{a.reps} runs each taking turns; {os.cpu_count()} CPUs\n")
        print("| direction | --no-resume MB/s median | resumable MB/s median | resumable / no-resume |")
        print("|---|---|---|---|")
        for direction in ("download", "upload"):
            rates: dict[str, list[float]] = {"no": [], "yes": []}
            for _ in range(a.reps):
                for mode in ("no", "yes"):
                    extra = ["--no-resume"] if mode == "no" else []
                    if direction == "download":
                        dst = os.path.join(local, "dst")
                        args = [*p, "--protect", "clear", *extra, f"{srv.url}/f", dst]
                    else:
                        dst = os.path.join(root, "up")
                        args = [*p, "--protect", "clear", *extra, src, f"{srv.url}/up"]
                    s, _, _ = srv.xduc_json(args)
                    rates[mode].append(s["bytes"] / s["seconds"])
                    os.unlink(dst)
            no, yes = statistics.median(rates["no"]), statistics.median(rates["yes"])
            print(f"| {direction} | {no / 1e6:.0f} | {yes / 1e6:.0f} | {yes / no:.3f} |")

        print("\n| cut half-way, then again | resumed_from | bytes_sent | share sent | seconds |")
        print("|---|---|---|---|---|")
        for direction in ("download", "upload"):
            if direction == "download":
                dst = os.path.join(local, "dst")
                partial = os.path.join(local, ".dst.xdfs-partial")
                args = [*p, "--protect", "clear", f"{srv.url}/f", dst]
            else:
                dst = os.path.join(root, "up2")
                partial = os.path.join(root, ".up2.xdfs-partial")
                args = [*p, "--protect", "clear", src, f"{srv.url}/up2"]
            # A limited first run so that "half-way" is a moment a poll catches.
            proc = subprocess.Popen([srv.xduc, "-q", *srv.auth, "--limit-rate", "200M", *args],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                if os.path.exists(partial) and os.path.getsize(partial) >= size // 2:
                    break
                time.sleep(0.005)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            time.sleep(0.5)  # the server notices the client is gone and records where it was
            s, _, _ = srv.xduc_json(args)
            print(f"| {direction} | {s['resumed_from']} | {s['bytes_sent']} | {s['bytes_sent'] / size:.1%} "
                  f"| {s['seconds']:.2f} |")
            if not os.path.exists(dst):
                fail(f"{direction}: no file after the second run")
            os.unlink(dst)


if __name__ == "__main__":
    main()
