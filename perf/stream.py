#!/usr/bin/python3
"""What an upload of a stream costs against the same bytes as a file: `cat SRC | xduc -` (the
size unknown until the end, blocks read in order from a pipe) against `xduc SRC`, disk to disk,
taking turns, medians, in clear and private mode; and whether the stream's digest is the file's.

    perf/stream.py [--xdfs-bin DIR] [--size 2G] [--streams 4] [--reps 5] [--dir DIR] [--smoke]

Files go to --dir (default: the system's temporary directory). Client CPU seconds include cat's
for the stream. Timings are printed, never judged: --smoke (small sizes) fails only when a run
fails or the digests differ. Run it with nothing else busy on the machine.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from xsec import disk_args, disk_bench, fail, parse_size  # noqa: E402


def main() -> None:
    a = disk_args(__doc__)
    size = parse_size(a.size)
    with disk_bench("stream", a) as (srv, root, local, src):
        print(f"# Stream uploads, {a.size} disk to disk under {a.dir}, -p {a.streams}, {a.reps} runs each "
              f"taking turns; {os.cpu_count()} CPUs\n")
        print("| protect | file MB/s median | stream MB/s median | stream / file | file client CPU-s | "
              "stream client CPU-s (with cat) |")
        print("|---|---|---|---|---|---|")
        for protect in ("clear", "private"):
            rates: dict[str, list[float]] = {"file": [], "stream": []}
            cpu: dict[str, list[float]] = {"file": [], "stream": []}
            digests: dict[str, str] = {}
            for _ in range(a.reps):
                for kind in ("file", "stream"):
                    dst = os.path.join(root, "up")
                    args = ["-p", str(a.streams), "--protect", protect, "--no-resume"]
                    if kind == "file":
                        s, c, _ = srv.xduc_json([*args, src, f"{srv.url}/up"])
                    else:
                        cat = subprocess.Popen(["cat", src], stdout=subprocess.PIPE)
                        s, c, _ = srv.xduc_json([*args, "-", f"{srv.url}/up"], stdin=cat.stdout)
                        cat.stdout.close()
                        if cat.wait() != 0:
                            fail("cat failed")
                    if s["bytes"] != size:
                        fail(f"{kind}: {s['bytes']} bytes arrived of {size}")
                    rates[kind].append(s["bytes"] / s["seconds"])
                    cpu[kind].append(c)
                    digests[kind] = s.get("digest", "")
                    os.unlink(dst)
            if digests["file"] != digests["stream"]:
                fail(f"{protect}: the stream's digest {digests['stream']} is not the file's {digests['file']}")
            f, st = statistics.median(rates["file"]), statistics.median(rates["stream"])
            print(f"| {protect} | {f / 1e6:.0f} | {st / 1e6:.0f} | {st / f:.3f} | "
                  f"{statistics.median(cpu['file']):.2f} | {statistics.median(cpu['stream']):.2f} |")


if __name__ == "__main__":
    main()
