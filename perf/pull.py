#!/usr/bin/python3
"""Many hosts pulling one file, side by side on the namespace test bed (scripts/testbed.sh: one
source and K hosts on a bridge, each link tbf-limited to the same rate both ways):

    perf/pull.py [--xdfs-bin DIR] [--hosts 16] [--rate 200mbit] [--size 128M] [--reps 3] [--set FILES]
                 [--spread SECONDS] [--tools one,pull,plain,ctorrent,aria2] [--protect clear] [--smoke]
                 [--pack-size SIZE]

The source holds the file; every host asks for it by itself, all at once or (--spread S) one after
another over S seconds. Per tool, the time from the first host's start until the last host has the
file (byte for byte, checked), and the bytes that left the source on its link, medians over the
runs, the tools taking turns:
  one       one host alone: xduc get from the master xdfsd (what "time one host takes alone" means)
  pull      every host runs xduc get against the master xdfsd on the source (the chain of pulling
            hosts; a host counts as done when its file is under its name, verified)
  plain     every host downloads from the source's xdfsd at once (xduc xdfs://SRC/FILE DIR)
  ctorrent  BitTorrent: opentracker and a seeding aria2c on the source, ctorrent on every host
            (a host is done when ctorrent runs its completion command); opentracker runs as nobody
            in a user namespace of its own (it refuses root), with the torrent on its list
  aria2     the same with aria2c on every host
With --set FILES the source is a directory of that many files, --size in all: xduc get -r pulls
it as a set (in packs of at most --pack-size, the master's --pull-pack-size), plain is xduc -r, the BitTorrent clients get a torrent of the directory.
xDFS runs in --protect clear by default (BitTorrent neither encrypts nor authenticates); every
xDFS block is still checked against its digest. Results go to perf/results/pull.json (pull-spread.json,
pull-set.json) and, with matplotlib, perf/plots/pull.png (pull-spread.png, pull-set.png). Timings are printed,
never judged: --smoke (4 hosts, 8 MiB, 1 run, xDFS only) fails only when a copy fails or differs.
Run it with nothing else busy.
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
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from relay import BED, addr, bars, digest, netns, parse_size, spread_dirs, src_tx  # noqa: E402  (the same bed, the same measures)

SRC = "10.77.0.1"
NAME = "data.bin"
TRACKER = f"http://{SRC}:6969/announce"


def fail(msg: str) -> None:
    print(f"pull.py: {msg}", file=sys.stderr)
    sys.exit(1)


class Bed:
    """The source's xdfsd (the master) and every host's directory, inside the test bed."""

    def __init__(self, a: argparse.Namespace, work: str) -> None:
        self.a = a
        self.k = int(os.environ["XTB_HOSTS"])
        self.work = work
        self.xduc = os.path.join(a.xdfs_bin, "xduc")
        self.xdfsd = os.path.join(a.xdfs_bin, "xdfsd")
        self.env = dict(os.environ, XDFS_CONFIG_DIR=os.path.join(work, "cfg"))
        # Every host the same key (a home directory shared by the nodes), or (--own-keys) each
        # its own, as separate machines have: the master's limits count sessions per key.
        self.envs = {i: self.env for i in range(1, self.k + 1)}
        if a.own_keys:
            self.envs = {i: dict(os.environ, XDFS_CONFIG_DIR=os.path.join(work, f"cfg-{i}")) for i in range(1, self.k + 1)}
        pubs = [subprocess.run([self.xduc, "keygen"], env=e, check=True, capture_output=True, text=True).stdout.strip()
                for e in [self.env, *(self.envs.values() if a.own_keys else [])]]
        self.root = os.path.join(work, "root")
        self.state = os.path.join(work, "state")
        os.makedirs(self.root)
        os.makedirs(self.state)
        with open(os.path.join(self.state, "authorized_keys"), "w") as f:
            f.write("".join(f"{pub} ro\n" for pub in pubs))
        # One file, or a set: a directory of --set files.
        self.name = "set" if a.set else NAME
        self.src = os.path.join(self.root, self.name)
        size = parse_size(a.size)
        if a.set:
            os.makedirs(self.src)
            for n in range(a.set):
                with open(os.path.join(self.src, f"f{n:04d}.bin"), "wb") as f:
                    f.write(os.urandom(size // a.set))
            self.last = f"f{a.set - 1:04d}.bin"  # in the last part
        else:
            with open(self.src, "wb") as f:
                left = size
                while left:
                    n = min(left, 1 << 24)
                    f.write(os.urandom(n))
                    left -= n
        self.want = digest(self.src)
        log = open(os.path.join(work, "master.log"), "ab")
        self.servers = [subprocess.Popen(netns(None) + [self.xdfsd, "--root", self.root, "--state-dir", self.state,
                                                        "--listen", f"{SRC}:7721",
                                                        *(["--pull-pack-size", a.pack_size] if a.pack_size else [])],
                                         stdout=log, stderr=log)]
        self.wait_listening(7721)
        # The master's key pinned once, before the hosts ask at once.
        for e in [self.env, *(self.envs.values() if a.own_keys else [])]:
            subprocess.run(netns(1) + [self.xduc, "-q", "stat", f"xdfs://{SRC}:7721/{self.name}"], env=e, check=True,
                           capture_output=True)
        self.torrent = ""

    def wait_listening(self, port: int) -> None:
        for _ in range(100):
            if subprocess.run(netns(1) + ["python3", "-c", f"import socket; socket.create_connection(('{SRC}', {port}), 0.2)"],
                              capture_output=True).returncode == 0:
                return
            time.sleep(0.05)
        self.stop()
        fail(f"nothing listens on {SRC}:{port}")

    def dest(self, i: int) -> str:
        return os.path.join(self.work, f"h{i}")

    def clear(self) -> None:
        for i in range(1, self.k + 1):
            shutil.rmtree(self.dest(i), ignore_errors=True)
            os.makedirs(self.dest(i))
        # Nothing an earlier run (or the set-up) wrote is left for the kernel to write back during
        # this one: the hosts share this machine's disk, and a host held up by write-back holds up
        # every host after it in the chain.
        os.sync()

    def bittorrent(self) -> None:
        """The file's torrent (256 KiB pieces), and opentracker on the source, which serves only
        torrents on its list (Debian's is built so)."""
        self.torrent = os.path.join(self.work, "data.torrent")
        subprocess.run(["ctorrent", "-t", "-u", TRACKER, "-l", "262144", "-s", self.torrent, self.name], cwd=self.root,
                       check=True, capture_output=True)
        listed = os.path.join(self.work, "whitelist")
        with open(listed, "w") as f:
            f.write(info_hash(self.torrent) + "\n")
        log = open(os.path.join(self.work, "tracker.log"), "ab")
        # (As nobody in a user namespace of its own: it refuses to run as root, and cannot become
        # nobody in the bed's.)
        self.servers.append(subprocess.Popen(netns(None) + ["unshare", "--user", "--map-user=65534", "--map-group=65534",
                                                            "--mount", "opentracker", "-i", SRC, "-p", "6969", "-P", "6969",
                                                            "-u", "nobody", "-w", listed], stdout=log, stderr=log,
                                             cwd=self.work))
        self.wait_listening(6969)

    def stop(self) -> None:
        for s in self.servers:
            s.terminate()
        for s in self.servers:
            try:
                s.wait(10)
            except subprocess.TimeoutExpired:
                s.kill()


def info_hash(torrent: str) -> str:
    """A torrent's info hash: the SHA-1 of its bencoded info dictionary, as it stands in the file."""
    import hashlib
    b = open(torrent, "rb").read()

    def skip(i: int) -> int:  # past the bencoded value at i
        c = b[i:i + 1]
        if c == b"i":
            return b.index(b"e", i) + 1
        if c in (b"l", b"d"):
            i += 1
            while b[i:i + 1] != b"e":
                i = skip(i)
            return i + 1
        colon = b.index(b":", i)
        return colon + 1 + int(b[i:colon])

    i = 1
    while b[i:i + 1] != b"e":
        key_end = skip(i)
        value_end = skip(key_end)
        if b[b.index(b":", i) + 1:key_end] == b"info":
            return hashlib.sha1(b[key_end:value_end]).hexdigest()
        i = value_end
    fail(f"{torrent} has no info dictionary")
    return ""


def digest_of(path: str) -> str:
    """relay.py's digest, without the bookkeeping files this script and the clients leave."""
    return digest(path, skip=lambda n: n == ".done" or n.endswith(".aria2") or n.endswith(".bf"))


def start_times(bed: Bed, k: int) -> list[float]:
    """When each host starts, from the first: at once, or spread evenly over --spread seconds."""
    s = bed.a.spread
    return [0.0 if k == 1 or not s else s * i / (k - 1) for i in range(k)]


def run_tool(bed: Bed, tool: str) -> tuple[float, int, int, float]:
    """One run; returns (seconds from the first start until the last host has the file, bytes the
    source sent, hosts whole, the longest any host took from its own start)."""
    k = 1 if tool == "one" else bed.k
    bed.clear()
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    procs: list[subprocess.Popen] = []
    seeders: list[subprocess.Popen] = []
    hook = os.path.join(bed.work, "done-hook.sh")
    # When is host i done: its file whole under its name (xDFS renames a verified copy into place),
    # or its BitTorrent client's completion command ran.
    # (A set: every file in place for xduc get; xduc -r writes in any order, so plain's marker is
    # a file of the script's own, made when xduc exits.)
    set_ = bool(bed.a.set)
    if tool in ("ctorrent", "aria2") or (set_ and tool == "plain"):
        def marker(i: int) -> str:
            return os.path.join(bed.dest(i), ".done")
    else:
        def marker(i: int) -> str:
            return os.path.join(bed.dest(i), NAME)

    def is_done(i: int) -> bool:
        if set_ and tool in ("one", "pull"):
            # (A set comes in parts, in order, so its last file is among the last written: once it
            # is there, every file is counted.)
            if not os.path.exists(os.path.join(bed.dest(i), bed.last)):
                return False
            return sum(1 for n in os.listdir(bed.dest(i)) if not n.startswith(".")) == bed.a.set
        return os.path.exists(marker(i))

    def copy(i: int) -> str:
        """Where host i's copy is: the file, or the set's directory."""
        if set_:
            return os.path.join(bed.dest(i), "set") if tool in ("ctorrent", "aria2") else bed.dest(i)
        return os.path.join(bed.dest(i), NAME)
    if tool in ("ctorrent", "aria2"):
        # The seed on the source is aria2c for both (ctorrent seeding with -f served nothing here).
        for i in range(1, k + 1):
            with open(f"{hook}.{i}", "w") as f:
                f.write(f'#!/bin/sh\ntouch "{marker(i)}"\n')
            os.chmod(f"{hook}.{i}", 0o755)
        seeders.append(subprocess.Popen(netns(None) + ["aria2c", "-d", bed.root, "--seed-ratio=0.0", "--seed-time=60",
                                                       "--bt-seed-unverified=true", "-V", "--enable-dht=false",
                                                       "--bt-enable-lpd=false", "--listen-port=6881",
                                                       "--summary-interval=0", "--console-log-level=error",
                                                       bed.torrent], **quiet))
        time.sleep(1)

    def command(i: int) -> tuple[list[str], str | None]:
        what = f"xdfs://{SRC}:7721/set/" if set_ else f"xdfs://{SRC}:7721/{NAME}"
        if tool in ("one", "pull"):
            return netns(i) + [bed.xduc, "-q", "--protect", bed.a.protect, "get", what, bed.dest(i) + "/"], None
        if tool == "plain":
            cmd = [bed.xduc, "-q", "--protect", bed.a.protect, "-p", "1", "--retries", "0", "--no-resume",
                   *(["-r"] if set_ else []), what, bed.dest(i) + "/"]
            if set_:  # done when xduc -r is
                return netns(i) + ["sh", "-c", '"$0" "$@" && touch ' + marker(i), *cmd], None
            return netns(i) + cmd, None
        if tool == "ctorrent":
            return netns(i) + ["ctorrent", "-e", "1", "-p", "2706", "-M", "100", "-X", f"touch {marker(i)}",
                               bed.torrent], bed.dest(i)
        if tool == "aria2":
            return netns(i) + ["aria2c", "-d", bed.dest(i), "--seed-time=60", "--enable-dht=false", "--bt-enable-lpd=false",
                               "--listen-port=6881", "--file-allocation=none", "--summary-interval=0",
                               "--console-log-level=error", f"--on-bt-download-complete={hook}.{i}", bed.torrent], None
        fail(f"unknown tool {tool}")
        return [], None

    at = start_times(bed, k)
    before = src_tx()
    t0 = time.monotonic()
    done_at: dict[int, float] = {}
    started: dict[int, float] = {}

    def launch() -> None:
        for i in range(1, k + 1):
            wait = t0 + at[i - 1] - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            cmd, cwd = command(i)
            started[i] = time.monotonic() - t0
            procs.append(subprocess.Popen(cmd, env=bed.envs[i], cwd=cwd, **quiet))

    starter = threading.Thread(target=launch)
    starter.start()
    deadline = t0 + bed.a.timeout
    while len(done_at) < k and time.monotonic() < deadline:
        for i in range(1, k + 1):
            if i not in done_at and is_done(i):
                done_at[i] = time.monotonic() - t0
        time.sleep(0.01)
    starter.join()
    seconds = max(done_at.values()) if len(done_at) == k else float("inf")
    # The longest any host took from its own start (with --spread, the late ones start late).
    own = max(done_at[i] - started[i] for i in done_at) if len(done_at) == k else float("inf")
    sent = src_tx() - before
    for p in procs + seeders:
        p.terminate()
    for p in procs + seeders:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
    reached = sum(1 for i in range(1, k + 1) if os.path.exists(copy(i)) and digest_of(copy(i)) == bed.want)
    if len(done_at) > 1:
        # (How the hosts spread: a chain's last hosts held up together, or one straggler.)
        t = sorted(done_at.values())
        print(f"#   {tool}: hosts done at {t[0]:.2f} s (first), {statistics.median(t):.2f} s (median), "
              f"{t[-2]:.2f} s (last but one)", flush=True)
    return seconds, sent, reached, own


def inside(a: argparse.Namespace) -> None:
    work = tempfile.mkdtemp(prefix="xdfs-pull-perf-", dir=a.dir)
    spread_dirs(work)
    bed = Bed(a, work)
    tools = a.tools.split(",")
    size = parse_size(a.size)
    results: dict[str, list[tuple[float, int, int, float]]] = {t: [] for t in tools}
    try:
        if "ctorrent" in tools or "aria2" in tools:
            bed.bittorrent()
        for rep in range(a.reps):
            for tool in tools:
                r = run_tool(bed, tool)
                results[tool].append(r)
                print(f"# run {rep + 1} {tool}: {r[0]:.2f} s, {r[1] / size:.3f} x the data from the source, "
                      f"{r[2]} hosts whole, {r[3]:.2f} s the longest from a host's own start", flush=True)
    finally:
        bed.stop()
    one = statistics.median(r[0] for r in results["one"]) if "one" in results else None
    when = f"starting spread over {a.spread:g} s" if a.spread else "starting together"
    what = f"A set of {a.set} files ({a.size})" if a.set else f"One file ({a.size})"
    print(f"\n# {what} pulled by {bed.k} hosts {when}, {a.rate} links both ways, xDFS --protect "
          f"{a.protect}; medians of {a.reps} runs taking turns; {os.cpu_count()} CPUs\n")
    print("| tool | hosts whole | time to the last host (s) | x one host alone | longest from a host's start (s) | "
          "source link bytes / data |")
    print("|---|---|---|---|---|---|")
    table = {}
    bad = False
    for tool in tools:
        rs = results[tool]
        t = statistics.median(r[0] for r in rs)
        own = statistics.median(r[3] for r in rs)
        b = statistics.median(r[1] for r in rs) / size
        whole = min(r[2] for r in rs)
        k = 1 if tool == "one" else bed.k
        bad |= tool in ("one", "pull", "plain") and whole != k
        table[tool] = {"seconds": t, "longest_own_seconds": own, "source_bytes_per_data": b, "hosts_whole": whole,
                       "hosts": k, "runs": [list(r) for r in rs]}
        print(f"| {tool} | {whole}/{k} | {t:.2f} | {t / one:.2f} | {own:.2f} | {b:.3f} |" if one else
              f"| {tool} | {whole}/{k} | {t:.2f} | - | {own:.2f} | {b:.3f} |")
    out = {"hosts": bed.k, "rate": a.rate, "size": size, "set_files": a.set, "spread": a.spread, "protect": a.protect,
           "reps": a.reps, "keys": "one a host" if a.own_keys else "one for all", "tools": table}
    if a.set:
        out["pack_size"] = a.pack_size or "128M"
    name = "pull-set" if a.set else "pull-spread" if a.spread else "pull"
    if not a.smoke:
        os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
        with open(os.path.join(HERE, "results", name + ".json"), "w") as f:
            json.dump(out, f, indent=1)
        plot(out, name)
    shutil.rmtree(work, ignore_errors=True)
    if bad:
        fail("an xDFS copy did not reach every host whole")


def plot(out: dict, name: str) -> None:
    when = f"starting over {out['spread']:g} s" if out["spread"] else "starting together"
    what = f"a set of {out['set_files']} files" if out.get("set_files") else "one file"
    bars(out, f"{what}, {out['size'] >> 20} MiB, pulled by {out['hosts']} hosts {when}, {out['rate']} links", name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--xdfs-bin", default=os.path.join(HERE, "..", "build-perf", "examples"))
    p.add_argument("--hosts", type=int, default=16)
    p.add_argument("--rate", default="200mbit")
    p.add_argument("--size", default="128M")
    p.add_argument("--set", type=int, default=0, metavar="FILES")
    p.add_argument("--pack-size", default="", help="the master's --pull-pack-size (default its own, 128M)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--own-keys", action="store_true", help="each host its own key (default: one key for all)")
    p.add_argument("--spread", type=float, default=0.0)
    p.add_argument("--protect", default="clear")
    p.add_argument("--tools", default="one,pull,plain,ctorrent,aria2")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
    p.add_argument("--dir", default=None)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.xdfs_bin = os.path.abspath(a.xdfs_bin)
    if a.smoke:
        a.hosts, a.size, a.reps, a.tools = 4, "8M", 1, "one,pull"
    if a.inside:
        return inside(a)
    for tool in a.tools.split(","):
        for need in {"ctorrent": ["ctorrent", "opentracker"], "aria2": ["aria2c", "opentracker", "ctorrent"]}.get(tool, []):
            if not shutil.which(need):
                fail(f"{need} is missing: perf/install-peers.sh installs it")
    args = [sys.executable, os.path.abspath(__file__), "--inside", "--xdfs-bin", a.xdfs_bin, "--size", a.size, "--reps",
            str(a.reps), "--set", str(a.set), "--spread", str(a.spread), "--protect", a.protect, "--tools", a.tools, "--rate", a.rate,
            "--timeout", str(a.timeout)]
    if a.dir:
        args += ["--dir", a.dir]
    if a.pack_size:
        args += ["--pack-size", a.pack_size]
    if a.own_keys:
        args.append("--own-keys")
    if a.smoke:
        args.append("--smoke")
    r = subprocess.run([BED, "--quiet", "--hosts", str(a.hosts), "--rate", a.rate, "--", *args])
    sys.exit(r.returncode)


if __name__ == "__main__":
    main()
