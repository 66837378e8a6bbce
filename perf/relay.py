#!/usr/bin/python3
"""One file to many hosts, side by side on the namespace test bed (scripts/testbed.sh: one source
and K hosts on a bridge, each link tbf-limited to the same rate both ways, an xdfsd on each host):

    perf/relay.py [--xdfs-bin DIR] [--hosts 8] [--rate 200mbit] [--size 256M] [--reps 3]
                  [--tools one,chain,star,serial,uftp,udpcast,gridftp-mc] [--protect clear] [--tree FILES]
                  [--smoke]

Per tool, the time until the last host has the file (byte for byte, checked) and the bytes that
left the source on its link, medians over the runs, the tools taking turns:
  one     xduc to the first host only (what "time to one host" means)
  chain   xduc SRC to all K hosts through the relay chain
  chain2  the same with --chains 2 (the hosts dealt between two chains, each fed by the source)
  chain-all  (--tree) the same with --chain-min 1: every file its own chain, none in a pack
  star    K xduc copies at once, one to each host
  serial  K xduc copies, one after another
  uftp    uftp multicast to K uftpd (closed group, at 95% of the link rate)
  udpcast udp-sender multicast to K udp-receiver (at 95% of the link rate)
  gridftp-mc  globus-url-copy -MC: GridFTP's multicast driver, which forwards through the
          hosts' globus-gridftp-servers; as a chain (cc=1 on every host: its fastest layout here,
          the default tree of cc=2 halves each forwarding host's uplink), anonymous, one stream
          a hop. The servers run as nobody in a user namespace of their own (a GridFTP server
          started as root drops its groups, which the test bed's namespace refuses) and find
          the bed's names in an /etc/hosts bound over the real one in the bed's mount namespace.
With --tree FILES the source is a tree of that many files in 10 directories, --size in all: nine
in ten are 32 KiB files, the rest share the other bytes (xduc -r; uftp sends the directory;
udpcast and gridftp-mc are left out). Results then go to relay-tree.json and relay-tree.png.
xDFS runs in --protect clear by default (the multicast tools neither encrypt nor authenticate);
every xDFS block is still checked against its digest. Results go to perf/results/relay.json and,
with matplotlib, perf/plots/relay.png. Timings are printed, never judged: --smoke (4 hosts,
4 MiB, 1 run, xDFS only) fails only when a copy fails or differs. Run it with nothing else busy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BED = os.path.join(HERE, "..", "scripts", "testbed.sh")


def fail(msg: str) -> None:
    print(f"relay.py: {msg}", file=sys.stderr)
    sys.exit(1)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.upper().rstrip("B").rstrip("I")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def rate_bits(rate: str) -> int:
    r = rate.lower()
    for unit, mult in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3), ("bit", 1)):
        if r.endswith(unit):
            return int(float(r[: -len(unit)]) * mult)
    fail(f"--rate {rate}: give it as tc does, e.g. 200mbit")
    return 0


def sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def digest(path: str, skip=lambda name: False) -> str:
    """A file's SHA-256, or a tree's: every file's relative path and SHA-256, in order (files
    whose name `skip` accepts left out)."""
    if not os.path.isdir(path):
        return sha(path)
    h = hashlib.sha256()
    for d, dirs, names in sorted(os.walk(path)):
        dirs.sort()
        for n in sorted(names):
            if skip(n):
                continue
            h.update(f"{os.path.relpath(os.path.join(d, n), path)} {sha(os.path.join(d, n))}\n".encode())
    return h.hexdigest()


def make_tree(path: str, files: int, size: int) -> None:
    """files files in 10 directories, size bytes in all: nine in ten of 32 KiB, the rest large."""
    small = files - max(1, files // 10)
    large = files - small
    each = max(0, size - small * 32768) // large
    for n in range(files):
        d = os.path.join(path, f"d{n % 10}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"f{n}"), "wb") as f:
            f.write(os.urandom(32768 if n < small else each))


def netns(i: int | None) -> list[str]:
    return ["ip", "netns", "exec", os.environ["XTB_SRC"] if i is None else os.environ[f"XTB_NS_{i}"]]


def addr(i: int) -> str:
    return os.environ[f"XTB_ADDR_{i}"]


def src_tx() -> int:
    out = subprocess.run([BED, "bytes", "src"], check=True, capture_output=True, text=True).stdout.split()
    return int(out[0])


class Bed:
    """The hosts' xdfsd servers and directories, inside the test bed."""

    def __init__(self, a: argparse.Namespace, work: str) -> None:
        self.a = a
        self.k = int(os.environ["XTB_HOSTS"])
        self.work = work
        self.xduc = os.path.join(a.xdfs_bin, "xduc")
        self.xdfsd = os.path.join(a.xdfs_bin, "xdfsd")
        self.env = dict(os.environ, XDFS_CONFIG_DIR=os.path.join(work, "cfg"))
        pub = subprocess.run([self.xduc, "keygen"], env=self.env, check=True, capture_output=True, text=True).stdout.strip()
        empty = os.path.join(work, "empty")
        os.makedirs(empty)
        keys = []
        for i in range(1, self.k + 1):
            st = self.state(i)
            os.makedirs(st)
            os.makedirs(self.dest(i))
            with open(os.path.join(st, "authorized_keys"), "w") as f:
                f.write(f"{pub} rw\n")
            keys.append(subprocess.run([self.xdfsd, "--root", empty, "--state-dir", st, "--print-key"], check=True,
                                       capture_output=True, text=True).stdout.strip() + f" {addr(i)}:7721")
        self.servers = []
        for i in range(1, self.k + 1):
            with open(os.path.join(self.state(i), "relay_peers"), "w") as f:
                f.write("".join(k + "\n" for k in keys))
            log = open(os.path.join(work, f"h{i}.log"), "ab")
            self.servers.append(subprocess.Popen(
                netns(i) + [self.xdfsd, "--root", self.root(i), "--state-dir", self.state(i), "--listen",
                            f"{addr(i)}:7721"], stdout=log, stderr=log))
        self.wait_listening(7721)

    def root(self, i: int) -> str:
        return os.path.join(self.work, f"h{i}", "root")

    def dest(self, i: int) -> str:
        return os.path.join(self.root(i), "in")

    def state(self, i: int) -> str:
        return os.path.join(self.work, f"h{i}", "state")

    def url(self, i: int) -> str:
        return f"xdfs://{addr(i)}:7721/in/"

    def gridftp(self) -> None:
        """GridFTP servers with the multicast driver on every host (gridftp-mc)."""
        names = os.path.join(self.work, "hosts")
        with open("/etc/hosts") as f, open(names, "w") as out:
            out.write(f.read() + "10.77.0.1 xtb-src\n" + "".join(f"{addr(i)} xtb-h{i}\n" for i in range(1, self.k + 1)))
        subprocess.run(["mount", "--bind", names, "/etc/hosts"], check=True)  # the bed's mount namespace only
        for i in range(1, self.k + 1):
            log = open(os.path.join(self.work, f"gridftp-h{i}.log"), "ab")
            self.servers.append(subprocess.Popen(
                netns(i) + ["unshare", "--user", "--map-user=65534", "--map-group=65534", "globus-gridftp-server",
                            "-p", "5000", "-control-interface", addr(i), "-data-interface", addr(i), "-aa",
                            "-disable-usage-stats", "-control-idle-timeout", "120",
                            "-fs-whitelist", "file,gridftp_multicast"], stdout=log, stderr=log))
        self.wait_listening(5000)

    def wait_listening(self, port: int) -> None:
        """Until every host's server takes connections on port (from the source, as the copies come)."""
        for i in range(1, self.k + 1):
            for _ in range(100):
                if subprocess.run(netns(None) + ["python3", "-c", f"import socket; socket.create_connection(('{addr(i)}', {port}), 0.2)"],
                                  capture_output=True).returncode == 0:
                    break
                time.sleep(0.05)

    def has(self, i: int, src: str) -> bool:
        """Host i has src (a file or a tree) byte for byte."""
        got = os.path.join(self.dest(i), os.path.basename(src))
        return os.path.exists(got) and digest(got) == digest(src)

    def clear(self) -> None:
        for i in range(1, self.k + 1):
            shutil.rmtree(self.dest(i))
            os.makedirs(self.dest(i))
            os.chmod(self.dest(i), 0o777)  # the GridFTP servers write as nobody

    def xduc_cmd(self, *args: str) -> list[str]:
        return netns(None) + [self.xduc, "-q", "-p", str(self.a.streams), "--protect", self.a.protect, "--retries", "0",
                              "--no-resume", *args]

    def stop(self) -> None:
        for s in self.servers:
            s.terminate()
        for s in self.servers:
            try:
                s.wait(10)
            except subprocess.TimeoutExpired:
                s.kill()


def run_tool(bed: Bed, tool: str, src: str) -> tuple[float, int, int]:
    """Runs one copy; returns (seconds until the last host has it, bytes the source sent, hosts reached)."""
    k = 1 if tool == "one" else bed.k
    rate_kbps = int(rate_bits(bed.a.rate) * 0.95 / 1000)
    bed.clear()
    before = src_tx()
    t0 = time.monotonic()
    procs: list[subprocess.Popen] = []
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = ["-r"] if os.path.isdir(src) else []
    if tool in ("one", "chain", "chain2", "chain-all"):
        extra = {"chain2": ["--chains", "2"], "chain-all": ["--chain-min", "1"]}.get(tool, [])
        cmd = bed.xduc_cmd(*r, *extra, src, *[bed.url(i) for i in range(1, k + 1)])
        subprocess.run(cmd, env=bed.env, cwd=bed.work, **quiet)
    elif tool == "star":
        procs = [subprocess.Popen(bed.xduc_cmd(*r, src, bed.url(i)), env=bed.env, **quiet) for i in range(1, k + 1)]
        for p in procs:
            p.wait()
    elif tool == "serial":
        for i in range(1, k + 1):
            subprocess.run(bed.xduc_cmd(*r, src, bed.url(i)), env=bed.env, **quiet)
    elif tool == "uftp":
        rx = [subprocess.Popen(netns(i) + ["uftpd", "-d", "-x", "0", "-D", bed.dest(i), "-I", "eth0"], **quiet)
              for i in range(1, k + 1)]
        time.sleep(0.5)
        t0 = time.monotonic()
        before = src_tx()
        subprocess.run(netns(None) + ["uftp", "-I", "eth0", "-R", str(rate_kbps), "-x", "0", "-C", "none",
                                      "-H", ",".join(addr(i) for i in range(1, k + 1)), src], **quiet)
        for p in rx:
            p.terminate()
            p.wait()
    elif tool == "gridftp-mc" and not r:
        mc = os.path.join(bed.work, "multicast-urls")
        with open(mc, "w") as f:
            f.write("".join(f"ftp://{addr(i)}:5000{bed.dest(i)}/{os.path.basename(src)}?cc=1\n" for i in range(1, k + 1)))
        subprocess.run(netns(None) + ["globus-url-copy", "-MC", mc, f"file://{src}"], **quiet)
    elif tool == "udpcast" and not r:
        rx = [subprocess.Popen(netns(i) + ["udp-receiver", "--interface", "eth0", "--nokbd", "--no-progress",
                                          "--file", os.path.join(bed.dest(i), os.path.basename(src))], **quiet)
              for i in range(1, k + 1)]
        time.sleep(0.5)
        t0 = time.monotonic()
        before = src_tx()
        subprocess.run(netns(None) + ["udp-sender", "--interface", "eth0", "--nokbd", "--no-progress", "--min-receivers",
                                      str(k), "--max-bitrate", f"{rate_kbps // 1000}m", "--file", src], **quiet)
        for p in rx:
            p.wait(60)
    else:
        fail(f"unknown tool {tool}")
    seconds = time.monotonic() - t0
    sent = src_tx() - before
    reached = sum(1 for i in range(1, k + 1) if bed.has(i, src))
    return seconds, sent, reached


def spread_dirs(work: str) -> None:
    """Each host's directory, made afresh for every run, goes where ext4 would put a top-level
    one (the Orlov allocator's spread; chattr +T), as hosts' disks are apart. Otherwise each run
    makes its files beside the inodes the run before it just deleted, and on an ext4 without a
    journal (this machine's root) every file made within a minute of a deletion nearby scans past
    those inodes (the kernel's recently_deleted()): a fifth of every host's CPU in back-to-back
    runs, which no host pulling into a directory of its own meets. (Elsewhere: nothing.)"""
    if shutil.which("chattr"):
        subprocess.run(["chattr", "+T", work], capture_output=True)


def inside(a: argparse.Namespace) -> None:
    work = tempfile.mkdtemp(prefix="xdfs-relay-perf-", dir=a.dir)
    spread_dirs(work)
    bed = Bed(a, work)
    if "gridftp-mc" in a.tools.split(",") and not a.tree:
        bed.gridftp()
    size = parse_size(a.size)
    src = os.path.join(work, "src.bin")
    if a.tree:
        src = os.path.join(work, "src")
        make_tree(src, a.tree, size)
    else:
        with open(src, "wb") as f:
            left = size
            while left:
                n = min(left, 1 << 24)
                f.write(os.urandom(n))
                left -= n
    # udpcast sends one file; GridFTP's multicast one file a command
    tools = [t for t in a.tools.split(",") if not (a.tree and t in ("udpcast", "gridftp-mc"))]
    results: dict[str, list[tuple[float, int, int]]] = {t: [] for t in tools}
    try:
        for rep in range(a.reps):
            for tool in tools:
                r = run_tool(bed, tool, src)
                results[tool].append(r)
                print(f"# run {rep + 1} {tool}: {r[0]:.2f} s, {r[1] / size:.3f} x the data from the source, "
                      f"{r[2]} hosts whole", flush=True)
    finally:
        bed.stop()
    one = statistics.median(r[0] for r in results["one"]) if "one" in results else None
    what = f"A tree of {a.tree} files ({a.size})" if a.tree else f"One file ({a.size})"
    print(f"\n# {what} to {bed.k} hosts, {a.rate} links both ways, -p {a.streams}, xDFS --protect "
          f"{a.protect}; medians of {a.reps} runs taking turns; {os.cpu_count()} CPUs\n")
    print("| tool | hosts whole | time to the last host (s) | x time to one host | source link bytes / data |")
    print("|---|---|---|---|---|")
    table = {}
    bad = False
    for tool in tools:
        rs = results[tool]
        t = statistics.median(r[0] for r in rs)
        b = statistics.median(r[1] for r in rs) / size
        whole = min(r[2] for r in rs)
        k = 1 if tool == "one" else bed.k
        bad |= tool in ("one", "chain", "chain2", "chain-all", "star", "serial") and whole != k
        table[tool] = {"seconds": t, "source_bytes_per_data": b, "hosts_whole": whole, "hosts": k,
                       "runs": [list(r) for r in rs]}
        print(f"| {tool} | {whole}/{k} | {t:.2f} | {t / one:.2f} | {b:.3f} |" if one else
              f"| {tool} | {whole}/{k} | {t:.2f} | - | {b:.3f} |")
    out = {"hosts": bed.k, "rate": a.rate, "size": size, "tree_files": a.tree, "streams": a.streams, "protect": a.protect, "reps": a.reps,
           "tools": table}
    if not a.smoke:
        os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
        with open(os.path.join(HERE, "results", "relay-tree.json" if a.tree else "relay.json"), "w") as f:
            json.dump(out, f, indent=1)
        plot(out)
    shutil.rmtree(work, ignore_errors=True)
    if bad:
        fail("an xDFS copy did not reach every host whole")


def bars(out: dict, title: str, name: str) -> None:
    """perf/plots/NAME.png: per tool, the time to the last host and the source's bytes (with
    matplotlib; nothing without it)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    tools = list(out["tools"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(tools, [out["tools"][t]["seconds"] for t in tools])
    ax1.set_ylabel("seconds until the last host has the file")
    ax2.bar(tools, [out["tools"][t]["source_bytes_per_data"] for t in tools])
    ax2.set_ylabel("bytes on the source's link / file size")
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.join(HERE, "plots"), exist_ok=True)
    fig.savefig(os.path.join(HERE, "plots", name + ".png"))


def plot(out: dict) -> None:
    what = f"a tree of {out['tree_files']} files" if out.get("tree_files") else "one file"
    bars(out, f"{what}, {out['size'] >> 20} MiB, to {out['hosts']} hosts, {out['rate']} links",
         "relay-tree" if out.get("tree_files") else "relay")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--xdfs-bin", default=os.path.join(HERE, "..", "build-perf", "examples"))
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--rate", default="200mbit")
    p.add_argument("--size", default="256M")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--protect", default="clear")
    p.add_argument("--tools", default="one,chain,star,serial,uftp,udpcast,gridftp-mc")
    p.add_argument("--dir", default=None)
    p.add_argument("--tree", type=int, default=0, metavar="FILES")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.xdfs_bin = os.path.abspath(a.xdfs_bin)
    if a.smoke:
        a.hosts, a.size, a.reps, a.tools = 4, "4M", 1, "one,chain"
    if a.inside:
        return inside(a)
    for tool in a.tools.split(","):
        need = {"uftp": "uftp", "udpcast": "udp-sender", "gridftp-mc": "globus-url-copy"}.get(tool)
        if need and not shutil.which(need):
            fail(f"{need} is missing: perf/install-peers.sh installs it")
    args = [sys.executable, os.path.abspath(__file__), "--inside", "--xdfs-bin", a.xdfs_bin, "--size", a.size, "--reps",
            str(a.reps), "--streams", str(a.streams), "--protect", a.protect, "--tools", a.tools, "--rate", a.rate]
    if a.dir:
        args += ["--dir", a.dir]
    if a.tree:
        args += ["--tree", str(a.tree)]
    if a.smoke:
        args.append("--smoke")
    r = subprocess.run([BED, "--quiet", "--hosts", str(a.hosts), "--rate", a.rate, "--", *args])
    sys.exit(r.returncode)


if __name__ == "__main__":
    main()
