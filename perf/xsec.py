#!/usr/bin/python3
"""What xSec costs: the two measurements of the xSec issue, repeatable by one command.

1. Protection modes: a SIZE download over loopback (a file in a RAM-backed directory on the
   server, /dev/null at the client), clear, integrity and private taking turns in the same run
   against one server, REPS each. Prints throughput (median, range), each mode's share of clear,
   and the CPU seconds (user + system) of each side per run. A mode written MODE/no-verify runs
   without the content manifest (xduc --no-verify): clear/no-verify against clear is what
   verification costs.
2. Session set-up: a 1-byte memory-mode session with 1 channel and with 256, taking turns,
   timed by xduc's own clock: set-up (resolve, connect, Noise XX on the first channel, the joins
   of the others, every channel's negotiation reply) and the whole session (plus one byte and
   the end of the session on every channel).

    perf/xsec.py [--xdfs-bin DIR] [--size 2G] [--reps 5] [--streams 4] [--smoke] [--json FILE]

Timings are printed, never judged: --smoke (tiny sizes) fails only when a run fails, so ctest can
keep the script working. Run it with nothing else busy on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SRC_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TICK = os.sysconf("SC_CLK_TCK")


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper()
    if s and s[-1] in units:
        return int(float(s[:-1]) * units[s[-1]])
    return int(s)


def write_random(path: str, size: int) -> None:
    """A file of `size` bytes: one random MiB over and over (nothing compresses or dedups it away)."""
    with open(path, "wb") as f:
        chunk = os.urandom(1 << 20)
        for _ in range(size >> 20):
            f.write(chunk)
        f.write(chunk[: size & ((1 << 20) - 1)])


def fail(msg: str) -> None:
    print(f"xsec.py: {msg}", file=sys.stderr)
    sys.exit(1)


def server_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Server:
    """One xdfsd on a free loopback port, with a client key of its own authorized rw."""

    def __init__(self, bindir: str, root: str, work: str, extra: tuple[str, ...] = ()) -> None:
        self.xduc = os.path.join(bindir, "xduc")
        xdfsd = os.path.join(bindir, "xdfsd")
        for exe in (self.xduc, xdfsd):
            if not os.access(exe, os.X_OK):
                fail(f"no executable {exe} (build first, or give --xdfs-bin)")
        ident = os.path.join(work, "id_x25519")
        r = subprocess.run([self.xduc, "keygen", "--identity", ident], capture_output=True, text=True)
        pub = [ln for ln in r.stdout.splitlines() if ln.startswith("xdfs-")]
        if r.returncode != 0 or not pub:
            fail(f"xduc keygen failed: {r.stderr.strip()}")
        auth = os.path.join(work, "authorized_keys")
        with open(auth, "w") as f:
            f.write(pub[0].strip() + " rw\n")
        os.chmod(auth, 0o600)
        self.auth = ["--identity", ident, "--known-hosts", os.path.join(work, "known_hosts")]
        port_file = os.path.join(work, "port")
        self.log = open(os.path.join(work, "xdfsd.log"), "w")
        self.proc = subprocess.Popen(
            [xdfsd, "--root", root, "--listen", "127.0.0.1:0", "--port-file", port_file,
             "--state-dir", os.path.join(work, "state"), "--authorized-keys", auth,
             "--allow-memory-mode", "--max-channels", "256", *extra],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                fail(f"xdfsd did not start (log: {self.log.name})")
            time.sleep(0.02)
        self.url = f"xdfs://127.0.0.1:{open(port_file).read().strip()}"

    def xduc_json(self, args: list[str], stdin=None) -> tuple[dict, float, float]:
        """Runs xduc --json (its standard input `stdin`, if given); returns its summary, its CPU
        seconds (with those of other children that ended meanwhile) and the server's."""
        c0, s0 = children_cpu(), server_cpu(self.proc.pid)
        r = subprocess.run([self.xduc, "-q", "--json", *self.auth, *args], capture_output=True, text=True, stdin=stdin)
        c1, s1 = children_cpu(), server_cpu(self.proc.pid)
        if r.returncode != 0:
            fail(f"xduc {' '.join(args)} failed: {r.stderr.strip()}")
        try:
            summary = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            fail(f"xduc printed no JSON summary: {r.stdout!r}")
        return summary, c1 - c0, s1 - s0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def disk_args(doc: str) -> argparse.Namespace:
    """The options of the disk-to-disk scripts (resume.py, stream.py); --smoke: 64M, 1 run."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--xdfs-bin", default=os.path.join(SRC_ROOT, "build-perf", "examples"))
    ap.add_argument("--size", default="2G")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go (default: the temporary directory)")
    ap.add_argument("--smoke", action="store_true", help="64M, 1 run each")
    a = ap.parse_args()
    if a.smoke:
        a.size, a.reps = "64M", 1
    return a


@contextlib.contextmanager
def disk_bench(name: str, a: argparse.Namespace):
    """A server whose root and a local directory are under a.dir, and a.size random bytes in
    local/src: yields (server, root, local, src); stops the server and removes it all after."""
    with tempfile.TemporaryDirectory(prefix=f"xdfs-{name}-", dir=a.dir) as base, \
            tempfile.TemporaryDirectory(prefix=f"xdfs-{name}-work-") as work:
        root, local = os.path.join(base, "root"), os.path.join(base, "local")
        os.makedirs(root)
        os.makedirs(local)
        src = os.path.join(local, "src")
        write_random(src, parse_size(a.size))
        srv = Server(a.xdfs_bin, root, work)
        try:
            yield srv, root, local, src
        finally:
            srv.stop()


def summary(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def modes_run(srv: Server, name: str, size: int, reps: int, streams: int, modes: list[str]) -> dict:
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(reps):
        order = modes[rep % len(modes):] + modes[:rep % len(modes)]  # who goes first rotates
        for m in order:
            protect, _, variant = m.partition("/")
            extra = ["--no-verify"] if variant == "no-verify" else []
            s, ccpu, scpu = srv.xduc_json(["-p", str(streams), "--protect", protect, *extra, f"{srv.url}/{name}", "/dev/null"])
            if s.get("bytes") != size:
                fail(f"{m}: {s.get('bytes')} bytes arrived, {size} expected")
            runs[m].append({"gbps": size / s["seconds"] / 1e9, "seconds": s["seconds"],
                            "client_cpu": ccpu, "server_cpu": scpu})
    return runs


def setup_run(srv: Server, reps: int, channels: list[int]) -> dict:
    runs: dict[int, dict[str, list[float]]] = {n: {"setup_ms": [], "session_ms": []} for n in channels}
    for rep in range(reps):
        order = channels if rep % 2 == 0 else channels[::-1]
        for n in order:
            s, _, _ = srv.xduc_json(["-p", str(n), "--memory", "1", "/dev/zero", f"{srv.url}/m"])
            if s.get("bytes") != 1 or s.get("channels") != n or not 0 < s.get("setup_seconds", 0) <= s["seconds"]:
                fail(f"set-up with {n} channels: unexpected summary {s}")
            runs[n]["setup_ms"].append(s["setup_seconds"] * 1000)
            runs[n]["session_ms"].append(s["seconds"] * 1000)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--xdfs-bin", default=os.path.join(SRC_ROOT, "build-perf", "examples"),
                    help="directory holding xdfsd and xduc (default build-perf/examples)")
    ap.add_argument("--size", default="2G", help="download size (default 2G)")
    ap.add_argument("--reps", type=int, default=5, help="runs of each mode (default 5)")
    ap.add_argument("--streams", type=int, default=4, help="channels of the downloads (default 4)")
    ap.add_argument("--modes", default="clear,clear/no-verify,integrity,private")
    ap.add_argument("--setup-channels", default="1,256")
    ap.add_argument("--setup-reps", type=int, default=7)
    ap.add_argument("--dir", default="", help="where the server's file lives (default /dev/shm if it has room)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 2 runs each: checks that it works")
    ap.add_argument("--json", default="", help="also write every run to this file")
    a = ap.parse_args()
    if a.smoke:
        a.size, a.reps, a.setup_reps, a.setup_channels = "16M", 2, 2, "1,16"
    size = parse_size(a.size)
    modes = [m for m in a.modes.split(",") if m]
    channels = [int(n) for n in a.setup_channels.split(",") if n]
    if "clear" not in modes:
        fail("--modes must include clear (the shares are of clear)")

    base = a.dir or ("/dev/shm" if shutil.disk_usage("/dev/shm").free > size + (256 << 20) else tempfile.gettempdir())
    with tempfile.TemporaryDirectory(prefix="xdfs-xsec-", dir=base) as root, \
            tempfile.TemporaryDirectory(prefix="xdfs-xsec-work-") as work:
        name = "f"
        write_random(os.path.join(root, name), size)
        srv = Server(a.xdfs_bin, root, work)
        try:
            commit = subprocess.run(["git", "-C", SRC_ROOT, "rev-parse", "--short", "HEAD"],
                                    capture_output=True, text=True).stdout.strip()
            print(f"# xSec costs at {commit or '?'}: {a.size} download to /dev/null over loopback, -p {a.streams}, "
                  f"{a.reps} runs per mode taking turns (file in {base}); {os.cpu_count()} CPUs\n")
            runs = modes_run(srv, name, size, a.reps, a.streams, modes)
            clear = statistics.median(r["gbps"] for r in runs["clear"])
            print("| mode | GB/s median | range | share of clear | client CPU s | server CPU s |")
            print("|---|---|---|---|---|---|")
            for m in modes:
                med, lo, hi = summary([r["gbps"] for r in runs[m]])
                cc = statistics.median(r["client_cpu"] for r in runs[m])
                sc = statistics.median(r["server_cpu"] for r in runs[m])
                print(f"| {m} | {med:.2f} | {lo:.2f}–{hi:.2f} | {med / clear:.0%} | {cc:.2f} | {sc:.2f} |")
            setup = setup_run(srv, a.setup_reps, channels)
            print(f"\nSession set-up, 1-byte memory-mode session, {a.setup_reps} runs each taking turns:\n")
            print("| channels | set-up ms median | range | whole session ms median | range |")
            print("|---|---|---|---|---|")
            for n in channels:
                med, lo, hi = summary(setup[n]["setup_ms"])
                smed, slo, shi = summary(setup[n]["session_ms"])
                print(f"| {n} | {med:.1f} | {lo:.1f}–{hi:.1f} | {smed:.1f} | {slo:.1f}–{shi:.1f} |")
            if len(channels) >= 2:
                lo_n, hi_n = channels[0], channels[-1]
                extra = {k: statistics.median(setup[hi_n][k]) - statistics.median(setup[lo_n][k])
                         for k in ("setup_ms", "session_ms")}
                print(f"\n{hi_n} channels cost {extra['setup_ms']:.1f} ms more than {lo_n} to set up, "
                      f"{extra['session_ms']:.1f} ms more for the whole 1-byte session (medians).")
            if a.json:
                with open(a.json, "w") as f:
                    json.dump({"commit": commit, "size": size, "streams": a.streams, "modes": runs,
                               "setup": {str(k): v for k, v in setup.items()}}, f, indent=1)
        finally:
            srv.stop()


if __name__ == "__main__":
    main()
