#!/usr/bin/python3
"""What zero copy saves: a page-cached file sent over loopback, by sendfile and by reading it.

    perf/zerocopy.py [--xdfs-bin DIR] [--size 2G] [--streams 1] [--reps 5] [--verify] [--smoke]

Cases, taking turns, REPS each, all in --protect clear:
  download zc     xdfsd sends a file in a RAM-backed directory by sendfile (--loopback-sendfile:
                  by default a peer on this host is sent blocks read first, as copy); xduc
                  writes it to /dev/null
  download copy   the same from a second xdfsd run with --no-zero-copy (every block read first)
  upload zc       xduc sends the file by sendfile (--loopback-sendfile); xdfsd writes it into
                  its RAM-backed root
  upload copy     the same with xduc --no-zero-copy
  iperf3 -Z -R    iperf3's server sends SIZE by sendfile, its client discards it
  iperf3 -R       the same with send(2) from a buffer
Per case: throughput (median and range), CPU seconds per GiB on each side (user + system: the
server's from /proc, the client's as a child's) and, where `perf` can count them, system calls
per GiB on each side (perf stat -e raw_syscalls:sys_enter). On loopback the kernel charges much
of the receiving path to the sender's system calls, so the sides are not independent.
Without --verify the blocks travel without digests (xduc --no-verify): this is the channel itself.
With it, every block is hashed at both ends and the sender reads each block to hash it.

Timings are printed, never judged: --smoke (64M, 1 run) fails only when a run fails.
Run it with nothing else busy on the machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import syscalls  # noqa: E402  (perf stat's count of system calls)
import xsec  # noqa: E402  (the loopback server and the CPU accounting are the xSec benchmark's)

class Watch:
    """perf stat on a running process for the length of one run (None when perf cannot)."""

    def __init__(self, pid: int | None, on: bool) -> None:
        self.proc = None
        if on and pid:
            self.proc = subprocess.Popen(["perf", "stat", "-x", ",", "-e", syscalls.EVENT, "-p", str(pid)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            time.sleep(0.3)  # attached before the run starts

    def stop(self) -> int | None:
        if not self.proc:
            return None
        self.proc.send_signal(2)
        _, err = self.proc.communicate(timeout=30)
        return syscalls.parse(err)


def run_counted(cmd: list[str], on: bool) -> tuple[float, int | None]:
    """Runs cmd (perf stat around it if on); returns its wall seconds and its system calls."""
    full = syscalls.wrap(cmd, "/dev/stderr") if on else cmd
    t0 = time.monotonic()
    r = subprocess.run(full, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        xsec.fail(f"{' '.join(cmd)} failed: {r.stderr.strip()[-300:]}")
    return wall, syscalls.parse(r.stderr) if on else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--xdfs-bin", default=os.path.join(xsec.SRC_ROOT, "build-perf", "examples"))
    ap.add_argument("--size", default="2G")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--verify", action="store_true", help="blocks with their digests (the default of xduc)")
    ap.add_argument("--dir", default="", help="RAM-backed directory for the files (default /dev/shm)")
    ap.add_argument("--smoke", action="store_true", help="64M, 1 run: checks that it works")
    a = ap.parse_args()
    if a.smoke:
        a.size, a.reps = "64M", 1
    size = xsec.parse_size(a.size)
    gib = size / (1 << 30)
    base = a.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    if shutil.disk_usage(base).free < 3 * size:
        xsec.fail(f"{base} has not room for 3 x {a.size}")
    iperf = shutil.which("iperf3")
    counting = syscalls.works()
    with tempfile.TemporaryDirectory(dir=base, prefix="xdfs-zc-") as work:
        root = os.path.join(work, "root")
        os.makedirs(root)
        xsec.write_random(os.path.join(root, "f"), size)
        os.makedirs(os.path.join(work, "a"))
        os.makedirs(os.path.join(work, "b"))
        # Over loopback sendfile is no longer the default: ask for it where the build knows how.
        helptext = subprocess.run([os.path.join(a.xdfs_bin, "xduc"), "--help"], capture_output=True, text=True).stdout
        loop = ["--loopback-sendfile"] if "--loopback-sendfile" in helptext else []
        zc = xsec.Server(a.xdfs_bin, root, os.path.join(work, "a"), tuple(loop))
        copy = xsec.Server(a.xdfs_bin, root, os.path.join(work, "b"), ("--no-zero-copy",))
        ip = None
        if iperf:
            port = 17000 + os.getpid() % 10000
            ip = subprocess.Popen([iperf, "-s", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)
        verify = [] if a.verify else ["--no-verify"]
        common = ["-q", "--protect", "clear", "-p", str(a.streams), *verify]

        def xdfs(srv: xsec.Server, args: list[str]) -> list[str]:
            return [srv.xduc, *srv.auth, *common, *args]

        cases = {
            "download zc": (zc, lambda: xdfs(zc, [f"{zc.url}/f", "/dev/null"])),
            "download copy": (copy, lambda: xdfs(copy, [f"{copy.url}/f", "/dev/null"])),
            "upload zc": (zc, lambda: xdfs(zc, [*loop, os.path.join(root, "f"), f"{zc.url}/up"])),
            "upload copy": (zc, lambda: xdfs(zc, ["--no-zero-copy", os.path.join(root, "f"), f"{zc.url}/up"])),
        }
        if ip:
            ipc = [iperf, "-c", "127.0.0.1", "-p", str(port), "-R", "-n", str(size), "-P", str(a.streams)]
            cases["iperf3 -Z -R"] = (None, lambda: [*ipc, "-Z"])
            cases["iperf3 -R"] = (None, lambda: ipc)
        runs: dict[str, list[tuple[float, float, float, int | None, int | None]]] = {k: [] for k in cases}
        for rep in range(a.reps):
            for name, (srv, cmd) in cases.items():
                pid = srv.proc.pid if srv else ip.pid
                upload = name.startswith("upload")
                watch = Watch(pid, counting)
                c0, s0 = xsec.children_cpu(), xsec.server_cpu(pid)
                wall, client_calls = run_counted(cmd(), counting)
                server_calls = watch.stop()
                c1, s1 = xsec.children_cpu(), xsec.server_cpu(pid)
                ccpu, scpu = c1 - c0, s1 - s0
                # Sender first: the client sends an upload, the server the rest.
                sender, receiver = (ccpu, scpu) if upload else (scpu, ccpu)
                calls = (client_calls, server_calls) if upload else (server_calls, client_calls)
                runs[name].append((size / wall / 1e9, sender / gib, receiver / gib, *calls))
                print(f"# run {rep + 1} {name}: {size / wall / 1e9:.2f} GB/s", flush=True)
                if upload:
                    os.unlink(os.path.join(root, "up"))
        for srv in (zc, copy):
            srv.stop()
        if ip:
            ip.terminate()
            ip.wait(timeout=10)

    def med(vals: list) -> str:
        vals = [v for v in vals if v is not None]
        return f"{statistics.median(vals):.2f}" if vals else "-"

    def per_gib(vals: list) -> str:
        vals = [v / gib for v in vals if v is not None]
        return f"{statistics.median(vals):.0f}" if vals else "-"

    print(f"\n# {a.size} page-cached file over loopback, -p {a.streams}, clear{'' if a.verify else ', --no-verify'}; "
          f"medians of {a.reps} runs taking turns; {os.cpu_count()} CPUs\n")
    print("| case | GB/s | range | sender CPU-s/GiB | receiver CPU-s/GiB | sender syscalls/GiB | receiver syscalls/GiB |")
    print("|---|---|---|---|---|---|---|")
    for name, rs in runs.items():
        gbs = [r[0] for r in rs]
        print(f"| {name} | {med(gbs)} | {min(gbs):.2f}-{max(gbs):.2f} | {med([r[1] for r in rs])} | "
              f"{med([r[2] for r in rs])} | {per_gib([r[3] for r in rs])} | {per_gib([r[4] for r in rs])} |")
    if not counting:
        print("\n(perf cannot count system calls here: install linux-perf, run as root or lower "
              "kernel.perf_event_paranoid)")


if __name__ == "__main__":
    main()
