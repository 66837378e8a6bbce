#!/usr/bin/python3
"""xDFS side-by-side benchmark driver (issue 5).

Runs every selected scenario for xDFS and its peers (GridFTP, iperf3, rsync, tar), taking turns,
repeated, and appends one JSON record per run to OUT/records.jsonl. OUT/meta.json holds the
commit, the machine and the options. perf/report.py turns a results directory into RESULTS.md
and plots. See perf/README.md.

Every run starts a fresh server and stops it after the client has exited, so the server's CPU
time and peak resident memory come from wait4() at its exit and include every process it forked
(GridFTP forks one process per session; the master reaps it, so its time lands in the master's
children's usage, which wait4 reports together with the master's own).

Run with /usr/bin/python3 (Debian's python3-matplotlib is only visible to it); run.sh does.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import math
import os
import platform
import random
import re
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

PERF_DIR = os.path.dirname(os.path.abspath(__file__))
SRC_ROOT = os.path.dirname(PERF_DIR)
sys.path.insert(0, PERF_DIR)
import syscalls  # noqa: E402  (perf stat's count of system calls, shared with zerocopy.py)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

SCENARIOS = ["mem", "disk", "small", "link", "cached"]
ALIASES = {"a": "mem", "b": "disk", "c": "small", "d": "link", "e": "cached",
           "memory": "mem", "memory-to-memory": "mem", "disk-to-disk": "disk",
           "smallfiles": "small", "small-files": "small", "page-cached": "cached"}

# The tools of each scenario, in the order of the first repetition (later ones rotate it).
TOOLS = {
    "mem": ["xdfs", "xdfs-private", "gridftp", "iperf3", "iperf3-z"],
    "disk": ["xdfs", "xdfs-private", "gridftp"],
    "small": ["xdfs", "xdfs-private", "gridftp", "gridftp-pp", "gridftp-pp-cc", "rsync", "tar"],
    "link": ["xdfs", "xdfs-private", "gridftp", "iperf3", "iperf3-z"],
    "cached": ["xdfs", "gridftp", "iperf3-z"],
}
# xdfs runs with --protect clear --no-verify: control frames MACed, data as is, no block digests,
# like GridFTP's anonymous clear data channel without -verify-checksum (the fair comparison).
# xdfs-private is xduc's default, every frame AES-256-GCM (or ChaCha20-Poly1305) and every block
# verified against its digest, what a user gets without options. perf/xsec.py measures what
# verification costs (clear against clear/no-verify). iperf3-z is iperf3 -Z: its sender moves the
# bytes by sendfile(2).
# Scenario (e), cached, is a download of a file in the server's page cache to /dev/null: xDFS
# and GridFTP send the file itself (xdfsd reads it first: to a client on this host it sends by
# sendfile only with --loopback-sendfile, perf/zerocopy.py), against iperf3 -Z -R, which sends
# one small buffer file over and over by sendfile.

# System calls are counted (perf stat; perf/syscalls.py) in one extra run of every point and tool
# after the timed repetitions: perf around a process costs tens of milliseconds of its own and
# a little per call, so counted runs are never timed (records with counted: true).

# Default matrix of a full run (about 40 minutes on the 2-core development machine, and a third
# more with the counted runs; see README).
FULL = dict(
    reps=3,
    mem_size="2G",
    mem_streams="1,2,4,8,16,32,64,128,256,512,1000",
    disk_sizes="256M,1G,2G,4G",
    # (size, streams) pairs: every size at 1 stream (paper figs 12-14), the whole stream sweep at
    # 1 GiB and 4 GiB (figs 15, 17, 18), 256 MiB at 1, 4 and 64, 2 GiB at 1 and 8 (the points
    # the zero-copy issue is judged at).
    disk_matrix="256M:1,4,64;1G:1,4,16,64;2G:1,8;4G:1,4,16,64",
    small_sets="1x1G,1000x1M,10000x100K,100000x10K",
    small_dirs="upload",
    link_rates="1gbit,10gbit",
    link_streams="1,8,64",
    link_size="1gbit:256M,10gbit:1G",
    cached_size="2G",
    cached_streams="1,8",
    block_size="1M",
    cc=2,
    iperf_time=2,
)
SMOKE = dict(
    reps=2,
    mem_size="16M",
    mem_streams="1,4,16",
    disk_sizes="4M,16M",
    disk_matrix="4M:1,4;16M:1,4",
    small_sets="1x4M,64x64K,400x4K",
    small_dirs="upload",
    link_rates="1gbit",
    link_streams="1,4",
    link_size="1gbit:8M",
    cached_size="16M",
    cached_streams="1,4",
    block_size="1M",
    cc=2,
    iperf_time=1,
)


# ----------------------------------------------------------------------------------------------
# small helpers

def parse_size(s: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", s, re.I)
    if not m:
        raise ValueError(f"bad size: {s!r}")
    mult = {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * mult)


def fmt_size(n: int) -> str:
    for unit, m in (("G", GiB), ("M", MiB), ("K", KiB)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Children die with the driver, even if it is killed with SIGKILL (e.g. by a ctest timeout).
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def proc_children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def proc_tree(pid: int) -> list[int]:
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += proc_children(p)
    return seen


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class Usage:
    """CPU seconds and peak RSS of a process (and its reaped descendants) from wait4()."""

    def __init__(self, ru=None, status=0, procs=1):
        self.user = ru.ru_utime if ru else 0.0
        self.sys = ru.ru_stime if ru else 0.0
        self.maxrss_kb = ru.ru_maxrss if ru else 0
        self.status = status
        self.procs = procs

    def add(self, other: "Usage") -> None:
        # Concurrent processes (several iperf3 pairs): CPU adds up, so do the peaks (an upper bound).
        self.user += other.user
        self.sys += other.sys
        self.maxrss_kb += other.maxrss_kb
        self.procs += other.procs
        if other.status and not self.status:
            self.status = other.status

    @classmethod
    def from_file(cls, path: str, fallback: "Usage") -> "Usage":
        """What xrun wrote (exact, small RSS baseline), else what wait4 on xrun said."""
        try:
            with open(path) as f:
                kv = dict(x.split("=", 1) for x in f.read().split())
        except (OSError, ValueError):
            return fallback
        u = cls()
        u.user, u.sys, u.maxrss_kb = float(kv["user"]), float(kv["sys"]), int(kv["maxrss_kb"])
        code = int(kv["exit"])
        u.status = (code & 0xff) << 8 if code < 128 else code - 128  # back to a wait status
        return u

    @property
    def exit_code(self) -> int:
        if os.WIFEXITED(self.status):
            return os.WEXITSTATUS(self.status)
        if os.WIFSIGNALED(self.status):
            return 128 + os.WTERMSIG(self.status)
        return 255


class Harness:
    """Starts processes, remembers them, and tears everything down at exit, even on failure."""

    def __init__(self) -> None:
        self.live: dict[int, str] = {}
        self.netns: list[str] = []
        self.dirs: list[str] = []
        self.lock = threading.Lock()
        self.xrun = ""  # perf/xrun.c, compiled at startup
        self.page_reporting = ""  # page_reporting_order to put back at exit (hold_page_reporting)

    def spawn(self, argv, *, stdout=None, stderr=None, cwd=None, env=None, netns=None, usage=None) -> int:
        """Starts argv (inside netns if given); with usage=PATH it runs under xrun, which writes
        the command's exact rusage to PATH when it ends."""
        if usage:
            argv = [self.xrun, usage] + list(argv)
        if netns:
            argv = ["ip", "netns", "exec", netns] + list(argv)
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, cwd=cwd,
                             env=env, preexec_fn=_die_with_parent, close_fds=True)
        # We reap with os.wait4 ourselves (Popen would swallow the rusage); keep Popen from
        # reaping it later by forgetting it.
        p.returncode = 0
        with self.lock:
            self.live[p.pid] = argv[0]
        return p.pid

    def wait(self, pid: int, timeout: float | None = None) -> tuple[Usage, bool]:
        """Blocks until pid exits (killing its tree after timeout). Returns usage and timed_out."""
        timed_out = threading.Event()

        def kill():
            timed_out.set()
            self.kill_tree(pid, signal.SIGKILL)

        t = threading.Timer(timeout, kill) if timeout else None
        if t:
            t.daemon = True
            t.start()
        try:
            while True:
                try:
                    _, status, ru = os.wait4(pid, 0)
                    break
                except InterruptedError:
                    continue
                except ChildProcessError:
                    status, ru = 0, None
                    break
        finally:
            if t:
                t.cancel()
        with self.lock:
            self.live.pop(pid, None)
        return Usage(ru, status), timed_out.is_set()

    def try_wait(self, pid: int):
        try:
            got, status, ru = os.wait4(pid, os.WNOHANG)
        except ChildProcessError:
            with self.lock:
                self.live.pop(pid, None)
            return Usage()
        if got == 0:
            return None
        with self.lock:
            self.live.pop(pid, None)
        return Usage(ru, status)

    def kill_tree(self, pid: int, sig=signal.SIGTERM) -> None:
        for p in reversed(proc_tree(pid)):
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def cleanup(self) -> None:
        with self.lock:
            pids = list(self.live)
        for pid in pids:
            self.kill_tree(pid, signal.SIGTERM)
        deadline = time.time() + 3
        for pid in pids:
            while time.time() < deadline and self.try_wait(pid) is None:
                time.sleep(0.05)
            if pid in self.live:
                self.kill_tree(pid, signal.SIGKILL)
                self.wait(pid, 5)
        for ns in list(self.netns):
            netns_delete(ns)
        self.netns.clear()
        try:
            os.rmdir("/etc/netns")  # only if empty: ours were the only entries
        except OSError:
            pass
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.dirs.clear()
        if self.page_reporting:
            try:
                with open(PAGE_REPORTING, "w") as f:
                    f.write(self.page_reporting)
            except OSError:
                pass
            self.page_reporting = ""


H = Harness()

# Free page reporting (virtio-balloon's): the guest hands memory it freed back to the host, and
# the next first touch of it is slow again (on the development VM 2 s a GiB against 0.18). A run
# frees and refills gigabytes of page cache, so which tool got the returned pages would decide
# its disk results. Pages of this order and above are reported; no free page is of order 11.
PAGE_REPORTING = "/sys/module/page_reporting/parameters/page_reporting_order"
NO_REPORTING = "11"


def hold_page_reporting() -> dict:
    """Stops free page reporting for the run where this host does it and may be told (root); the
    order it had goes back at exit (Harness.cleanup). What was done, for meta.json."""
    try:
        with open(PAGE_REPORTING) as f:
            was = f.read().strip()
    except OSError:
        return {}
    if was == NO_REPORTING:
        return dict(order=was, held="already")
    try:
        with open(PAGE_REPORTING, "w") as f:
            f.write(NO_REPORTING)
    except OSError as e:
        return dict(order=was, held=f"no: {e.strerror}")
    H.page_reporting = was
    log(f"bench: free page reporting held off for the run (page_reporting_order {was} -> {NO_REPORTING})")
    return dict(order=was, held="yes")


# ----------------------------------------------------------------------------------------------
# network namespaces (link mode)

NETNS_PREFIX = "xdfsperf-"


def netns_delete(ns: str) -> None:
    subprocess.run(["ip", "netns", "del", ns], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shutil.rmtree(os.path.join("/etc/netns", ns), ignore_errors=True)


def netns_sweep_stale() -> None:
    """Deletes namespaces left by an earlier driver that was killed (its pid is in the name)."""
    try:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    except OSError:
        return
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    if os.path.isdir("/etc/netns"):
        names += os.listdir("/etc/netns")
    for name in names:
        m = re.fullmatch(rf"{NETNS_PREFIX}(\d+)-\w+", name)
        if m and not pid_alive(int(m.group(1))):
            netns_delete(name)
    try:
        os.rmdir("/etc/netns")  # only if empty
    except OSError:
        pass


def sh(*argv: str) -> None:
    r = subprocess.run(list(argv), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or r.returncode}")


class Link:
    """Two namespaces joined by a veth pair whose both directions are shaped with tc tbf.

    Addresses come from 127.0.0.0/8 (with route_localnet, loopback left down in both namespaces),
    so no traffic is ever addressed outside the loopback range, and it never leaves the namespaces.
    Each namespace gets its own /etc/hosts (ip netns exec mounts /etc/netns/NAME/* over /etc), so
    GridFTP's host-name look-ups of these addresses and of the machine's name resolve locally.
    """

    SERVER_IP = "127.10.0.1"
    CLIENT_IP = "127.10.0.2"

    def __init__(self) -> None:
        tag = f"{os.getpid()}"
        self.ns_s = f"{NETNS_PREFIX}{tag}-s"
        self.ns_c = f"{NETNS_PREFIX}{tag}-c"
        # Interface names are at most 15 bytes.
        self.if_s = f"xpv{tag[-8:]}s"
        self.if_c = f"xpv{tag[-8:]}c"
        self.rate: str | None = None

    def up(self) -> None:
        H.netns += [self.ns_s, self.ns_c]
        sh("ip", "netns", "add", self.ns_s)
        sh("ip", "netns", "add", self.ns_c)
        sh("ip", "link", "add", self.if_s, "type", "veth", "peer", "name", self.if_c)
        sh("ip", "link", "set", self.if_s, "netns", self.ns_s)
        sh("ip", "link", "set", self.if_c, "netns", self.ns_c)
        host = socket.gethostname()
        for ns, mine, other in ((self.ns_s, self.SERVER_IP, self.CLIENT_IP), (self.ns_c, self.CLIENT_IP, self.SERVER_IP)):
            etc = os.path.join("/etc/netns", ns)
            os.makedirs(etc, exist_ok=True)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(f"127.0.0.1 localhost\n{mine} {host} xdfsperf-self\n{other} xdfsperf-peer\n")
            with open(os.path.join(etc, "resolv.conf"), "w") as f:
                f.write("nameserver 127.0.0.1\noptions attempts:1 timeout:1\n")
        for ns, ifc, ip in ((self.ns_s, self.if_s, self.SERVER_IP), (self.ns_c, self.if_c, self.CLIENT_IP)):
            sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1")
            sh("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.conf.{ifc}.route_localnet=1")
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", ifc)
            sh("ip", "-n", ns, "link", "set", ifc, "up")

    def shape(self, rate: str) -> None:
        if rate == self.rate:
            return
        bits = parse_rate(rate)
        # Burst: 2 ms worth of bytes at the rate, at least 128 KiB (two GSO super-packets).
        burst = max(128 * KiB, bits // 8 // 500)
        for ns, ifc in ((self.ns_s, self.if_s), (self.ns_c, self.if_c)):
            sh("tc", "-n", ns, "qdisc", "replace", "dev", ifc, "root", "tbf", "rate", rate,
               "burst", str(burst), "latency", "5ms")
        self.rate = rate

    def down(self) -> None:
        for ns in (self.ns_s, self.ns_c):
            netns_delete(ns)
            if ns in H.netns:
                H.netns.remove(ns)


def parse_rate(rate: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        raise ValueError(f"bad rate {rate!r} (e.g. 1gbit)")
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)])


# ----------------------------------------------------------------------------------------------
# servers

class Server:
    """A fresh server process for one run. `ready` parses its log into a port (or None yet)."""

    def __init__(self, name, argv, log_path, ready, netns=None, self_exits=False, settled=None, repick=None):
        self.name = name
        self.repick = repick  # () -> a new argv on another port, for a server told its port is taken
        self.settled = settled  # (server) -> True once what its clients did is in its log
        self.argv = argv
        self.netns = netns
        self.log_path = log_path
        self.usage_path = log_path + ".rusage"
        self.ready = ready
        self.self_exits = self_exits
        self.pid = 0
        self.port = 0
        self.usage: Usage | None = None
        self.perf_out: str | None = None  # counted run: perf stat sits between xrun and the server

    def count_syscalls(self, out: str) -> None:
        self.perf_out = out
        self.argv = syscalls.wrap(self.argv, out)

    def servers(self) -> list[int]:
        """The server processes themselves (below perf stat in a counted run)."""
        top = proc_children(self.pid)
        return [g for c in top for g in proc_children(c)] if self.perf_out else top

    def start(self, timeout=20.0) -> "Server":
        for attempt in range(5):
            try:
                return self._start(timeout)
            except RuntimeError as e:
                if not self.repick or attempt == 4 or "Address already in use" not in str(e):
                    raise
                log(f"bench: {self.name}: port taken, starting it on another ({e})")
                self.usage = None
                self.argv = self.repick()
                if self.perf_out:
                    self.argv = syscalls.wrap(self.argv, self.perf_out)
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> "Server":
        with open(self.log_path, "wb") as lf:
            self.pid = H.spawn(self.argv, stdout=lf, stderr=subprocess.STDOUT, netns=self.netns,
                               usage=self.usage_path)
        deadline = time.time() + timeout
        while time.time() < deadline:
            port = self.ready(self)
            if port:
                self.port = port
                return self
            u = H.try_wait(self.pid)
            if u is not None:
                self.usage = Usage.from_file(self.usage_path, u)
                raise RuntimeError(f"{self.name} exited ({u.exit_code}) before listening: {self.log_tail()}")
            time.sleep(0.01)
        raise RuntimeError(f"{self.name} did not start within {timeout}s: {self.log_tail()}")

    def log_text(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def log_tail(self, n=400) -> str:
        return self.log_text()[-n:].strip().replace("\n", " | ")

    def stop(self, grace=10.0) -> Usage:
        """Waits for forked session processes to finish, then ends the server and reaps it.

        self.pid is xrun; its one child is the server; the server's children are sessions."""
        if self.usage is not None:
            return self.usage
        # A client may exit a moment before the server logs the end of its session: a server
        # stopped then would never write it.
        deadline = time.time() + 5
        while self.settled and not self.settled(self) and time.time() < deadline:
            time.sleep(0.01)
        deadline = time.time() + 5
        while time.time() < deadline:
            if self.self_exits and (u := H.try_wait(self.pid)) is not None:
                self.usage = Usage.from_file(self.usage_path, u)
                return self.usage
            if not any(proc_children(c) for c in self.servers()):
                break
            time.sleep(0.01)
        if not self.self_exits:
            # Sessions still running after 5 s are a hung server: end the whole tree.
            if self.perf_out:
                # perf stat writes its count once the server has ended: the server goes first.
                for p in self.servers():
                    H.kill_tree(p, signal.SIGTERM)
            elif any(proc_children(c) for c in self.servers()):
                H.kill_tree(self.pid, signal.SIGTERM)
            else:
                os.kill(self.pid, signal.SIGTERM)  # xrun passes it on to the server
        u, _ = H.wait(self.pid, grace)
        self.usage = Usage.from_file(self.usage_path, u)
        return self.usage


def ready_port_file(path):
    def ready(_srv):
        try:
            with open(path) as f:
                s = f.read().strip()
            return int(s) if s else 0
        except (OSError, ValueError):
            return 0
    return ready


def ready_log(pattern):
    rx = re.compile(pattern)

    def ready(srv):
        m = rx.search(srv.log_text())
        return int(m.group(1)) if m else 0
    return ready


def free_port(host="127.0.0.1") -> int:
    """A port that binds now, below the kernel's ephemeral range (ip_local_port_range) where it
    can. bind(0) picks one inside that range, where any outgoing connection may take it before the
    server binds it: iperf3 failed to listen ("Address already in use") at 1000 streams."""
    lo = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    candidates = [random.randrange(10000, lo) for _ in range(64)] if lo > 10100 else []
    for port in candidates + [0]:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port on {host}")


# ----------------------------------------------------------------------------------------------
# the run context

class Ctx:
    def __init__(self, args) -> None:
        self.args = args
        self.no_verify: list[str] = []
        self.work = args.work
        self.bin = args.xdfs_bin
        self.xdfsd = os.path.join(self.bin, "xdfsd")
        self.xduc = os.path.join(self.bin, "xduc")
        self.srv = os.path.join(self.work, "srv")      # served by xdfsd (root) and GridFTP (absolute paths)
        self.cli = os.path.join(self.work, "cli")      # client-side files
        self.tmp = os.path.join(self.work, "run")      # logs of the current run
        self.block = parse_size(args.block_size)
        self.root = os.geteuid() == 0
        self.link: Link | None = None
        self.records = open(os.path.join(args.out, "records.jsonl"), "w")
        self.seq = 0
        self.total = 0
        self.xduc_extra = shlex.split(args.xduc_extra or "")
        self.xdfsd_extra = shlex.split(args.xdfsd_extra or "")
        self.failures = 0
        self.count = False  # counting system calls (perf stat) in one extra run of each point

    def write(self, rec: dict) -> None:
        self.records.write(json.dumps(rec, sort_keys=True) + "\n")
        self.records.flush()

    def runlog(self, name: str) -> str:
        return os.path.join(self.tmp, name)


# ----------------------------------------------------------------------------------------------
# servers of each tool

def xsec_setup(ctx: Ctx) -> None:
    """xSec: a client key for the benchmark, authorized rw on a server state of its own."""
    ctx.xduc_auth, ctx.xdfsd_auth, ctx.xsec = [], [], False
    helptext = subprocess.run([ctx.xduc, "--help"], capture_output=True, text=True).stdout
    # An xDFS with the content manifest verifies every block by default; GridFTP's transfers here
    # do not, so the like-for-like "xdfs" runs without it (xdfs-private keeps the default).
    ctx.no_verify = ["--no-verify"] if "--no-verify" in helptext else []
    if "--identity" not in helptext:
        return  # an xDFS from before xSec
    kd = os.path.join(ctx.work, "keys")
    os.makedirs(kd, mode=0o700, exist_ok=True)
    ident, known = os.path.join(kd, "id_x25519"), os.path.join(kd, "known_hosts")
    r = subprocess.run([ctx.xduc, "keygen", "--identity", ident], capture_output=True, text=True)
    pub = [ln for ln in r.stdout.splitlines() if ln.startswith("xdfs-")]
    if r.returncode != 0 or not pub:
        raise SystemExit(f"bench: xduc keygen failed: {r.stderr.strip()}")
    auth = os.path.join(kd, "authorized_keys")
    with open(auth, "w") as f:
        f.write(pub[0].strip() + " rw\n")
    ctx.xduc_auth = ["--identity", ident, "--known-hosts", known]
    ctx.xdfsd_auth = ["--state-dir", os.path.join(kd, "xdfsd"), "--authorized-keys", auth]
    ctx.xsec = True


def xduc_args(ctx: Ctx, tool: str) -> list[str]:
    if tool == "xdfs-private":
        if not ctx.xsec:
            raise Unsupported("this xDFS has no xSec protection modes")
        prot = ["--protect", "private"]
    else:
        prot = (["--protect", "clear"] if ctx.xsec else []) + ctx.no_verify
    return ctx.xduc_auth + prot + ctx.xduc_extra


def xdfsd_server(ctx: Ctx, host: str, netns=None, streams=1, memory=False) -> Server:
    pf = ctx.runlog("xdfsd.port")
    if os.path.exists(pf):
        os.unlink(pf)
    argv = [ctx.xdfsd, "--root", ctx.srv, "--listen", f"{host}:0", "--port-file", pf,
            "--max-channels", str(max(256, streams)), "--max-block-size", str(max(16 * MiB, ctx.block))]
    if memory:
        argv.append("--allow-memory-mode")
    argv += ctx.xdfsd_auth + ctx.xdfsd_extra
    return Server("xdfsd", argv, ctx.runlog("xdfsd.log"), ready_port_file(pf), netns, settled=xdfsd_settled)


def gridftp_server(ctx: Ctx, host: str, netns=None) -> Server:
    xfer = ctx.runlog("gridftp.xfer")
    if os.path.exists(xfer):
        os.unlink(xfer)
    argv = ["globus-gridftp-server", "-p", "0", "-control-interface", host, "-data-interface", host,
            "-aa", "-disable-usage-stats", "-bs", str(ctx.block), "-Z", xfer,
            "-d", "error,warn", "-control-idle-timeout", "120"]
    if ctx.root:
        # Anonymous sessions setuid to this user; the work tree is made world-accessible for it.
        argv += ["-anonymous-user", "nobody"]
    srv = Server("globus-gridftp-server", argv, ctx.runlog("gridftp.log"),
                 ready_log(r"Server listening at \S*:(\d+)"), netns)
    srv.xfer = xfer
    return srv


def gridftp_xfer_bytes(srv: Server) -> tuple[int, int, list[str]]:
    """Sum of NBYTES, number of transfers and non-226 codes in the server's transfer log."""
    total, n, bad = 0, 0, []
    try:
        with open(srv.xfer) as f:
            for line in f:
                m = re.search(r"NBYTES=(\d+)", line)
                c = re.search(r"CODE=(\d+)", line)
                if m:
                    total += int(m.group(1))
                    n += 1
                if c and c.group(1) != "226":
                    bad.append(c.group(1))
    except OSError:
        pass
    return total, n, bad


def iperf3_server(ctx: Ctx, host: str, port: int, idx: int, netns=None) -> Server:
    """An iperf3 server for one test. On loopback (no namespace) its port is picked here, and
    picked again should another socket take it first."""
    def argv(p: int) -> list[str]:
        return ["iperf3", "-s", "-1", "-B", host, "-p", str(p), "--forceflush"]
    repick = (lambda: argv(free_port(host))) if netns is None else None
    srv = Server("iperf3", argv(port if netns is not None else free_port(host)), ctx.runlog(f"iperf3-{idx}.log"),
                 ready_log(r"Server listening on (\d+)"), netns, self_exits=True, repick=repick)
    return srv


# ----------------------------------------------------------------------------------------------
# one measured run

class RunError(Exception):
    pass


class Unsupported(Exception):
    pass


def run_clients(ctx: Ctx, argvs: list[list[str]], timeout: float, netns=None) -> tuple[float, Usage, list[str]]:
    """Starts the clients together, waits for all; returns wall seconds, summed usage, stdouts."""
    outs = []
    pids = []
    t0 = time.perf_counter()
    for i, argv in enumerate(argvs):
        op = ctx.runlog(f"client-{i}.out")
        ep = ctx.runlog(f"client-{i}.err")
        with open(op, "wb") as o, open(ep, "wb") as e:
            pids.append(H.spawn(argv, stdout=o, stderr=e, netns=netns, usage=ctx.runlog(f"client-{i}.rusage")))
        outs.append((op, ep))
    total: Usage | None = None
    timed_out = False
    for i, pid in enumerate(pids):
        u, to = H.wait(pid, max(1.0, timeout - (time.perf_counter() - t0)))
        u = Usage.from_file(ctx.runlog(f"client-{i}.rusage"), u)
        timed_out |= to
        if total is None:
            total = u
        else:
            total.add(u)
    wall = time.perf_counter() - t0
    texts = []
    errs = []
    for op, ep in outs:
        with open(op, errors="replace") as f:
            texts.append(f.read())
        with open(ep, errors="replace") as f:
            errs.append(f.read())
    if timed_out:
        raise RunError(f"client timed out after {timeout:.0f}s; stderr: {' | '.join(e.strip()[-300:] for e in errs)}")
    if total.exit_code != 0:
        raise RunError(f"client exit {total.exit_code}: {' | '.join((e or t).strip()[-400:] for e, t in zip(errs, texts))}")
    return wall, total, texts


def timeout_for(nbytes: int, files: int = 1) -> float:
    # Generous: 20 MB/s floor plus 20 ms a file plus a fixed allowance; never asserted on.
    return 60 + nbytes / 20e6 + files * 0.02


def measure(ctx: Ctx, rec: dict, servers: list[Server], clients: list[list[str]], *,
            nbytes: int, files: int = 1, netns_c=None, check=None) -> dict:
    """Starts the servers, runs the clients, stops the servers, fills rec."""
    started = []
    counted = bool(rec.get("counted"))
    try:
        for i, s in enumerate(servers):
            if counted:
                s.count_syscalls(ctx.runlog(f"server-{i}.perf"))
            started.append(s.start())
        argvs = [c(started) if callable(c) else c for c in clients]
        rec["cmd"] = [shlex.join(a) for a in argvs]
        if counted:
            argvs = [syscalls.wrap(a, ctx.runlog(f"client-{i}.perf")) for i, a in enumerate(argvs)]
        wall, cu, outs = run_clients(ctx, argvs, timeout_for(nbytes, files), netns_c)
    finally:
        su = Usage(procs=0)
        stop_errors = []
        for s in started:
            try:
                su.add(s.stop())
            except Exception as e:  # noqa: BLE001 - recorded
                stop_errors.append(f"{s.name}: {e}")
    rec.update(
        seconds=round(wall, 6),
        bytes_per_second=round(nbytes / wall, 1) if wall > 0 else None,
        client_user_s=round(cu.user, 4), client_sys_s=round(cu.sys, 4),
        client_cpu_s=round(cu.user + cu.sys, 4), client_maxrss_kb=cu.maxrss_kb, client_procs=cu.procs,
    )
    if servers:
        rec.update(server_user_s=round(su.user, 4), server_sys_s=round(su.sys, 4),
                   server_cpu_s=round(su.user + su.sys, 4), server_maxrss_kb=su.maxrss_kb,
                   server_procs=su.procs)
    if stop_errors:
        raise RunError("; ".join(stop_errors))
    if counted:
        c = [syscalls.read(ctx.runlog(f"client-{i}.perf")) for i in range(len(argvs))]
        s = [syscalls.read(ctx.runlog(f"server-{i}.perf")) for i in range(len(started))]
        if None in c or None in s:
            raise RunError("perf stat wrote no count of system calls")
        rec["client_syscalls"] = sum(c)
        if started:
            rec["server_syscalls"] = sum(s)
    if check:
        check(started, outs)
    return rec


def parse_xduc_json(out: str, expect: int, rec: dict | None = None) -> float:
    """xduc's own seconds. With rec, also its data phase: the seconds after set-up (every channel
    connected, secured and accepted), which is what iperf3 reports its rate over."""
    line = [ln for ln in out.strip().splitlines() if ln.startswith("{")]
    if not line:
        raise RunError(f"xduc printed no JSON summary: {out[-200:]!r}")
    j = json.loads(line[-1])
    if j.get("bytes") != expect:
        raise RunError(f"xduc moved {j.get('bytes')} bytes, expected {expect}")
    secs = float(j["seconds"])
    setup = j.get("setup_seconds")
    if rec is not None and isinstance(setup, (int, float)) and 0 <= setup < secs:
        rec["setup_seconds"] = round(setup, 6)
        rec["data_seconds"] = round(secs - setup, 6)
        rec["data_bytes_per_second"] = round(expect / (secs - setup), 1)
    return secs


def xdfsd_settled(srv: Server) -> bool:
    """The xdfsd has logged the end of a session (a run's client opens one)."""
    return re.search(r"session \S+ end ", srv.log_text()) is not None


def xdfsd_check(srv: Server, expect: int) -> float:
    # The whole status ("ok", or "error: <code>: <message>"), so a failed run says why.
    m = re.findall(r"session \S+ end .* bytes=(\d+) seconds=([\d.]+) .*status=(.+)$", srv.log_text(), re.M)
    if not m:
        raise RunError(f"xdfsd logged no session end: {srv.log_tail()}")
    b, secs, status = m[-1]
    status = status.strip()
    if status != "ok" or int(b) != expect:
        raise RunError(f"xdfsd session: bytes={b} status={status}")
    return float(secs)


# ----------------------------------------------------------------------------------------------
# scenario (a) memory to memory, and (d) link mode, which is the same transfers across a shaped link

def mem_run(ctx: Ctx, rec: dict, tool: str, direction: str, streams: int, nbytes: int,
            host="127.0.0.1", netns_s=None, netns_c=None) -> dict:
    up = direction == "upload"
    if tool in ("xdfs", "xdfs-private"):
        srv = xdfsd_server(ctx, host, netns_s, streams, memory=True)
        xargs = xduc_args(ctx, tool)

        def client(started):
            url = f"xdfs://{host}:{started[0].port}/m"
            a = [ctx.xduc, "--memory", str(nbytes), "-p", str(streams), "--block-size", str(ctx.block),
                 "-q", "--json"] + xargs
            return a + (["/dev/zero", url] if up else [url, "/dev/null"])

        def check(started, outs):
            rec["tool_seconds"] = parse_xduc_json(outs[0], nbytes, rec)
            rec["server_seconds"] = xdfsd_check(started[0], nbytes)
        return measure(ctx, rec, [srv], [client], nbytes=nbytes, netns_c=netns_c, check=check)

    if tool == "gridftp":
        srv = gridftp_server(ctx, host, netns_s)

        def client(started):
            url = f"ftp://{host}:{started[0].port}"
            a = ["globus-url-copy", "-fast", "-p", str(streams), "-bs", str(ctx.block), "-len", str(nbytes)]
            return a + (["file:///dev/zero", f"{url}/dev/null"] if up else [f"{url}/dev/zero", "file:///dev/null"])

        def check(started, outs):
            got, n, bad = gridftp_xfer_bytes(started[0])
            if got != nbytes or bad:
                raise RunError(f"gridftp server logged {got} bytes in {n} transfers (codes {bad}), expected {nbytes}")
        return measure(ctx, rec, [srv], [client], nbytes=nbytes, netns_c=netns_c, check=check)

    if tool in ("iperf3", "iperf3-z"):
        # The ceiling. iperf3 is timed (-t), not sized: with -n the sender stops at its last
        # write() and the receiver stops counting at that moment, so up to a socket buffer per
        # stream (megabytes; most of a small transfer) is never counted. Its throughput is the
        # receiver's own: bytes received / receiver seconds, excluding connection set-up.
        # iperf3 takes at most 128 streams a test: above that, ceil(n/128) client/server pairs
        # run at once, splitting the streams evenly; bytes, CPU and peak RSS are summed.
        pairs = max(1, math.ceil(streams / 128))
        split = [streams // pairs + (1 if i < streams % pairs else 0) for i in range(pairs)]
        servers = [iperf3_server(ctx, host, 5201 + i, i, netns_s) for i in range(pairs)]
        secs = str(ctx.args.iperf_time)

        def client(i):  # the port each server listens on: known once it started
            return lambda started: (["iperf3", "-c", host, "-p", str(started[i].port), "-P", str(split[i]), "-t", secs,
                                     "-J"] + ([] if up else ["-R"]) + (["-Z"] if tool == "iperf3-z" else []))
        clients = [client(i) for i in range(pairs)]
        rec["processes"] = pairs

        def check(started, outs):
            secs, got = 0.0, 0
            for i, o in enumerate(outs):
                j = json.loads(o)
                if "error" in j:
                    raise RunError(f"iperf3: {j['error']}")
                g = j["end"]["sum_received"]["bytes"]
                if g <= 0:
                    raise RunError("iperf3 received nothing")
                got += g
                secs = max(secs, j["end"]["sum_received"]["seconds"])
            rec["wall_seconds"] = rec["seconds"]
            rec["wall_bytes_per_second"] = round(got / rec["seconds"], 1)
            rec["bytes"] = got
            rec["seconds"] = round(secs, 6)
            rec["bytes_per_second"] = round(got / secs, 1)
        return measure(ctx, rec, servers, clients, nbytes=nbytes, netns_c=netns_c, check=check)

    raise Unsupported(f"{tool} has no memory-to-memory mode")


# ----------------------------------------------------------------------------------------------
# scenario (b) disk to disk

def write_file(path: str, size: int) -> None:
    chunk = os.urandom(min(size, 16 * MiB)) if size else b""
    with open(path, "wb") as f:
        left = size
        while left > 0:
            n = min(left, len(chunk))
            f.write(chunk[:n])
            left -= n


def same_sample(a: str, b: str, size: int) -> bool:
    if os.path.getsize(b) != size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        for off in {0, max(0, size // 2 - 2048), max(0, size - 4096)}:
            fa.seek(off)
            fb.seek(off)
            if fa.read(4096) != fb.read(4096):
                return False
    return True


def disk_setup(ctx: Ctx, sizes: list[int]) -> None:
    os.makedirs(os.path.join(ctx.srv, "in"), exist_ok=True)
    os.chmod(os.path.join(ctx.srv, "in"), 0o1777)
    os.makedirs(os.path.join(ctx.cli, "dl"), exist_ok=True)
    os.chmod(os.path.join(ctx.cli, "dl"), 0o1777)
    for s in sizes:
        p = os.path.join(ctx.srv, f"f_{fmt_size(s)}")
        if not os.path.exists(p):
            log(f"bench: writing {fmt_size(s)} test file")
            write_file(p, s)
            os.chmod(p, 0o644)
        c = os.path.join(ctx.cli, f"f_{fmt_size(s)}")
        if not os.path.exists(c):
            os.link(p, c)  # same bytes, same page cache, a client-side name
    os.sync()


def disk_run(ctx: Ctx, rec: dict, tool: str, direction: str, streams: int, size: int) -> dict:
    name = f"f_{fmt_size(size)}"
    up = direction == "upload"
    src = os.path.join(ctx.cli if up else ctx.srv, name)
    dst = os.path.join(ctx.srv, "in", name) if up else os.path.join(ctx.cli, "dl", name)
    for p in (dst,):
        if os.path.exists(p):
            os.unlink(p)

    def verify():
        if not os.path.exists(dst) or not same_sample(src, dst, size):
            raise RunError(f"destination {dst} missing or different")

    try:
        if tool in ("xdfs", "xdfs-private"):
            srv = xdfsd_server(ctx, "127.0.0.1", streams=streams)
            xargs = xduc_args(ctx, tool)

            def client(started):
                url = f"xdfs://127.0.0.1:{started[0].port}/" + (f"in/{name}" if up else name)
                a = [ctx.xduc, "-p", str(streams), "--block-size", str(ctx.block), "-q", "--json"] + xargs
                return a + ([src, url] if up else [url, dst])

            def check(started, outs):
                rec["tool_seconds"] = parse_xduc_json(outs[0], size)
                rec["server_seconds"] = xdfsd_check(started[0], size)
                verify()
            return measure(ctx, rec, [srv], [client], nbytes=size, check=check)

        if tool == "gridftp":
            srv = gridftp_server(ctx, "127.0.0.1")

            def client(started):
                url = f"ftp://127.0.0.1:{started[0].port}"
                a = ["globus-url-copy", "-fast", "-p", str(streams), "-bs", str(ctx.block)]
                return a + ([f"file://{src}", f"{url}{dst}"] if up else [f"{url}{src}", f"file://{dst}"])

            def check(started, outs):
                got, n, bad = gridftp_xfer_bytes(started[0])
                if got != size or bad:
                    raise RunError(f"gridftp server logged {got} bytes (codes {bad}), expected {size}")
                verify()
            return measure(ctx, rec, [srv], [client], nbytes=size, check=check)
        raise Unsupported(f"{tool} is not a disk-to-disk peer")
    finally:
        if os.path.exists(dst):
            os.unlink(dst)
        os.sync()  # the deleted file's dirty pages are dropped; start each run with a clean cache


# ----------------------------------------------------------------------------------------------
# scenario (e) a page-cached file to /dev/null

def cached_name(size: int) -> str:
    return f"c_{fmt_size(size)}"


def cached_setup(ctx: Ctx, sizes: list[int]) -> None:
    for s in sizes:
        p = os.path.join(ctx.srv, cached_name(s))
        if not os.path.exists(p):
            log(f"bench: writing {fmt_size(s)} file for the page-cached downloads")
            write_file(p, s)
            os.chmod(p, 0o644)
    os.sync()  # no writeback of the new file during the timed runs


def read_through(path: str) -> None:
    """Reads a file once, untimed, so that a run finds all of it in the page cache."""
    buf = bytearray(16 * MiB)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def cached_run(ctx: Ctx, rec: dict, tool: str, streams: int, size: int) -> dict:
    """The server sends a file from its page cache; the client writes it to /dev/null."""
    if tool == "iperf3-z":
        return mem_run(ctx, rec, tool, "download", streams, size)
    name = cached_name(size)
    src = os.path.join(ctx.srv, name)
    read_through(src)
    if tool == "xdfs":
        srv = xdfsd_server(ctx, "127.0.0.1", streams=streams)
        xargs = xduc_args(ctx, tool)

        def client(started):
            return [ctx.xduc, "-p", str(streams), "--block-size", str(ctx.block), "-q", "--json"] + xargs + [
                f"xdfs://127.0.0.1:{started[0].port}/{name}", "/dev/null"]

        def check(started, outs):
            rec["tool_seconds"] = parse_xduc_json(outs[0], size, rec)
            rec["server_seconds"] = xdfsd_check(started[0], size)
        return measure(ctx, rec, [srv], [client], nbytes=size, check=check)
    if tool == "gridftp":
        srv = gridftp_server(ctx, "127.0.0.1")

        def client(started):
            return ["globus-url-copy", "-fast", "-p", str(streams), "-bs", str(ctx.block),
                    f"ftp://127.0.0.1:{started[0].port}{src}", "file:///dev/null"]

        def check(started, outs):
            got, n, bad = gridftp_xfer_bytes(started[0])
            if got != size or bad:
                raise RunError(f"gridftp server logged {got} bytes (codes {bad}), expected {size}")
        return measure(ctx, rec, [srv], [client], nbytes=size, check=check)
    raise Unsupported(f"{tool} has no page-cached download here")


# ----------------------------------------------------------------------------------------------
# scenario (c) lots of small files

def parse_set(s: str) -> tuple[int, int]:
    count, size = s.lower().split("x")
    return int(count), parse_size(size.upper())


def set_name(count: int, size: int) -> str:
    return f"{count}x{fmt_size(size)}"


def small_setup(ctx: Ctx, sets: list[tuple[int, int]]) -> None:
    base = os.path.join(ctx.srv, "small")
    os.makedirs(base, exist_ok=True)
    os.makedirs(os.path.join(ctx.srv, "in"), exist_ok=True)
    os.chmod(os.path.join(ctx.srv, "in"), 0o1777)
    os.makedirs(os.path.join(ctx.cli, "copy"), exist_ok=True)
    for count, size in sets:
        d = os.path.join(base, set_name(count, size))
        if os.path.exists(d):
            continue
        log(f"bench: writing tree {set_name(count, size)}")
        data = os.urandom(min(size, 16 * MiB))
        for i in range(count):
            sub = os.path.join(d, f"d{i // 1000:04d}")
            if i % 1000 == 0:
                os.makedirs(sub, exist_ok=True)
            p = os.path.join(sub, f"f{i:07d}")
            if size <= len(data):
                with open(p, "wb") as f:
                    f.write(data[:size])
            else:
                write_file(p, size)
        for root, dirs, fnames in os.walk(d):
            os.chmod(root, 0o755)
            for fn in fnames:
                os.chmod(os.path.join(root, fn), 0o644)
    os.sync()


def tree_stats(d: str) -> tuple[int, int]:
    n = b = 0
    for root, _dirs, fnames in os.walk(d):
        for fn in fnames:
            n += 1
            b += os.lstat(os.path.join(root, fn)).st_size
    return n, b


def xdfs_tree_support(ctx: Ctx) -> str | None:
    """xDFS copies directory trees in path mode (xduc -r); an xduc without it is skipped."""
    try:
        helptext = subprocess.run([ctx.xduc, "--help"], capture_output=True, text=True).stdout
    except OSError as e:
        return str(e)
    if re.search(r"(^|\s)(-r|--recursive)\b", helptext):
        return None
    return "xDFS has no directory-tree (path) mode yet (xduc has no -r); issue: path mode"


def small_run(ctx: Ctx, rec: dict, tool: str, direction: str, count: int, size: int) -> dict:
    name = set_name(count, size)
    src = os.path.join(ctx.srv, "small", name)
    nbytes = count * size
    if tool in ("rsync", "tar"):
        dst = os.path.join(ctx.cli, "copy", name)
        rec["direction"] = "local"
    elif direction == "upload":
        dst = os.path.join(ctx.srv, "in", name)
    else:
        raise Unsupported("small files are measured in upload direction only")
    shutil.rmtree(dst, ignore_errors=True)

    def verify(started=None, outs=None):
        n, b = tree_stats(dst)
        if (n, b) != (count, nbytes):
            raise RunError(f"copy holds {n} files / {b} bytes, expected {count} / {nbytes}")

    try:
        if tool in ("xdfs", "xdfs-private"):
            why = xdfs_tree_support(ctx)
            if why:
                raise Unsupported(why)
            # A tree copy spreads its batches over a few channels (the peers run their own
            # defaults: rsync and tar one stream, globus-url-copy -pp/-cc as labelled).
            rec["streams"] = ctx.args.small_streams
            srv = xdfsd_server(ctx, "127.0.0.1", streams=rec["streams"])

            def client(started):
                return [ctx.xduc, "-r", "-p", str(rec["streams"]), "-q", "--json"] + xduc_args(ctx, tool) + [
                    src + "/", f"xdfs://127.0.0.1:{started[0].port}/in/{name}/"]
            return measure(ctx, rec, [srv], [client], nbytes=nbytes, files=count, check=verify)

        if tool.startswith("gridftp"):
            srv = gridftp_server(ctx, "127.0.0.1")
            opts = ["-fast", "-r", "-cd", "-bs", str(ctx.block)]
            if tool in ("gridftp-pp", "gridftp-pp-cc"):
                opts.append("-pp")
            if tool == "gridftp-pp-cc":
                opts += ["-cc", str(ctx.args.cc)]
                rec["concurrency"] = ctx.args.cc

            def client(started):
                return ["globus-url-copy"] + opts + [f"file://{src}/", f"ftp://127.0.0.1:{started[0].port}{dst}/"]

            def check(started, outs):
                got, n, bad = gridftp_xfer_bytes(started[0])
                if bad:
                    raise RunError(f"gridftp server logged failing transfers: {bad[:5]}")
                verify()
            return measure(ctx, rec, [srv], [client], nbytes=nbytes, files=count, check=check)

        os.makedirs(dst)
        if tool == "rsync":
            client = ["rsync", "-a", src + "/", dst + "/"]
        elif tool == "tar":
            client = ["sh", "-c", f"tar -C {shlex.quote(src)} -cf - . | tar -C {shlex.quote(dst)} -xf -"]
        else:
            raise Unsupported(tool)
        return measure(ctx, rec, [], [client], nbytes=nbytes, files=count, check=verify)
    finally:
        shutil.rmtree(dst, ignore_errors=True)
        os.sync()


# ----------------------------------------------------------------------------------------------
# the plan

def build_plan(args) -> list[tuple[str, dict]]:
    """[(scenario, point)] for one repetition, in run order. A point has everything but tool."""
    plan: list[tuple[str, dict]] = []
    for sc in args.scenarios:
        if sc == "mem":
            size = parse_size(args.mem_size)
            for n in ints(args.mem_streams):
                for d in ("upload", "download"):
                    plan.append((sc, dict(direction=d, streams=n, size=size, files=1, bytes=size)))
        elif sc == "disk":
            for part in args.disk_matrix.split(";"):
                if not part.strip():
                    continue
                s, ns = part.split(":")
                size = parse_size(s)
                for n in ints(ns):
                    for d in ("upload", "download"):
                        plan.append((sc, dict(direction=d, streams=n, size=size, files=1, bytes=size)))
        elif sc == "small":
            for st in args.small_sets.split(","):
                count, size = parse_set(st)
                for d in args.small_dirs.split(","):
                    plan.append((sc, dict(direction=d, streams=1, size=size, files=count,
                                          bytes=count * size, set=set_name(count, size))))
        elif sc == "link":
            sizes = dict(p.split(":") for p in args.link_size.split(","))
            for rate in args.link_rates.split(","):
                size = parse_size(sizes.get(rate, sizes.get("*", "256M")))
                for n in ints(args.link_streams):
                    for d in ("upload", "download"):
                        plan.append((sc, dict(direction=d, streams=n, size=size, files=1, bytes=size, link=rate)))
        elif sc == "cached":
            size = parse_size(args.cached_size)
            for n in ints(args.cached_streams):
                plan.append((sc, dict(direction="download", streams=n, size=size, files=1, bytes=size)))
    return plan


def tools_for(args, sc: str) -> list[str]:
    tools = TOOLS[sc]
    if args.tools:
        keep = set(args.tools.split(","))
        tools = [t for t in tools if t in keep or t.split("-")[0] in keep]
    return tools


def rotated(xs: list, k: int) -> list:
    if not xs:
        return xs
    k %= len(xs)
    return xs[k:] + xs[:k]


def run_one(ctx: Ctx, sc: str, point: dict, tool: str, rep: int, counted: bool = False) -> dict:
    rec = dict(scenario=sc, tool=tool, rep=rep, status="ok", **point)
    if counted:
        rec["counted"] = True
    rec["started_at"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    for f in os.listdir(ctx.tmp):
        os.unlink(os.path.join(ctx.tmp, f))
    t0 = time.time()
    try:
        if sc == "mem":
            mem_run(ctx, rec, tool, point["direction"], point["streams"], point["bytes"])
        elif sc == "disk":
            disk_run(ctx, rec, tool, point["direction"], point["streams"], point["size"])
        elif sc == "small":
            small_run(ctx, rec, tool, point["direction"], point["files"], point["size"])
        elif sc == "link":
            if ctx.link is None:
                raise Unsupported(ctx.link_why)
            ctx.link.shape(point["link"])
            mem_run(ctx, rec, tool, point["direction"], point["streams"], point["bytes"],
                    host=Link.SERVER_IP, netns_s=ctx.link.ns_s, netns_c=ctx.link.ns_c)
        elif sc == "cached":
            cached_run(ctx, rec, tool, point["streams"], point["size"])
    except Unsupported as e:
        rec["status"] = "unsupported"
        rec["error"] = str(e)
    except Exception as e:  # noqa: BLE001 - a failed run is a record, the driver goes on
        rec["status"] = "failed"
        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        ctx.failures += 1
    rec["elapsed_s"] = round(time.time() - t0, 3)
    return rec


def describe(rec: dict) -> str:
    extra = f" {rec['link']}" if rec.get("link") else ""
    what = rec.get("set") or fmt_size(rec.get("size", rec["bytes"]))
    head = f"{rec['scenario']}{extra} {rec['tool']:<13} {rec['direction']:<8} p={rec['streams']:<4} {what:<11} rep {rec['rep']}"
    if rec["status"] == "ok" and rec.get("counted"):
        return f"{head}: counted: {rec['client_syscalls']} / {rec.get('server_syscalls', 0)} system calls (client / server)"
    if rec["status"] == "ok":
        return f"{head}: {rec['bytes_per_second'] / 1e6:9.1f} MB/s  cpu c/s {rec['client_cpu_s']:.2f}/{rec.get('server_cpu_s', 0):.2f} s"
    return f"{head}: {rec['status']}: {rec.get('error', '')[:200]}"


def git(*a: str) -> str:
    try:
        return subprocess.run(["git", "-C", SRC_ROOT, *a], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def version_of(argv: list[str]) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        return (r.stdout + r.stderr).strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unavailable"


def machine_info() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_kb = 0
    try:
        with open("/proc/meminfo") as f:
            mem_kb = int(f.readline().split()[1])
    except (OSError, ValueError, IndexError):
        pass
    osr = ""
    try:
        with open("/etc/os-release") as f:
            osr = dict(line.rstrip().split("=", 1) for line in f if "=" in line).get("PRETTY_NAME", "").strip('"')
    except OSError:
        pass
    return dict(nproc=os.cpu_count(), cpu_model=model, kernel=platform.release(), mem_gib=round(mem_kb / 1024 / 1024, 1),
                os=osr, hostname=socket.gethostname())


def write_meta(ctx: Ctx, args, extra: dict) -> None:
    meta = dict(
        commit=git("rev-parse", "HEAD"), commit_short=git("rev-parse", "--short", "HEAD"),
        dirty=bool(git("status", "--porcelain", "--untracked-files=no")),
        branch=git("rev-parse", "--abbrev-ref", "HEAD"),
        machine=machine_info(),
        versions=dict(
            xduc=ctx.xduc, iperf3=version_of(["iperf3", "--version"]),
            gridftp_server=version_of(["globus-gridftp-server", "-version"]),
            globus_url_copy=version_of(["globus-url-copy", "-version"]),
            rsync=version_of(["rsync", "--version"]), tar=version_of(["tar", "--version"]),
        ),
        options={k: v for k, v in vars(args).items() if k not in ("out",)},
        smoke=args.smoke,
        xsec=ctx.xsec,
        **extra,
    )
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)


REQUIRED = {"scenario": str, "tool": str, "direction": str, "streams": int, "bytes": int, "files": int,
            "rep": int, "status": str}
REQUIRED_OK = {"seconds": (int, float), "bytes_per_second": (int, float), "client_cpu_s": (int, float),
               "client_maxrss_kb": int}


def check_records(path: str, scenarios: list[str], counted: bool = False) -> list[str]:
    """Problems with a records file: malformed records, failed runs, scenarios without a result
    (and, when system calls were counted, without a counted one)."""
    problems = []
    seen_ok: dict[str, int] = {sc: 0 for sc in scenarios}
    seen_counted: dict[str, int] = {sc: 0 for sc in scenarios}
    seen_any: dict[str, int] = {sc: 0 for sc in scenarios}
    with open(path) as f:
        for i, line in enumerate(f, 1):
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append(f"line {i}: not JSON: {e}")
                continue
            for k, t in REQUIRED.items():
                if not isinstance(r.get(k), t):
                    problems.append(f"line {i}: field {k} missing or not {t.__name__}")
            if r.get("status") == "ok":
                for k, t in REQUIRED_OK.items():
                    if not isinstance(r.get(k), t):
                        problems.append(f"line {i}: ok record without {k}")
                if r.get("bytes_per_second", 0) <= 0:
                    problems.append(f"line {i}: non-positive throughput")
                if r.get("scenario") in ("mem", "disk", "link", "cached") and not isinstance(r.get("server_cpu_s"), (int, float)):
                    problems.append(f"line {i}: ok record without server_cpu_s")
                if r.get("counted"):
                    if not isinstance(r.get("client_syscalls"), int):
                        problems.append(f"line {i}: counted record without client_syscalls")
                    seen_counted[r.get("scenario")] = seen_counted.get(r.get("scenario"), 0) + 1
                seen_ok[r.get("scenario")] = seen_ok.get(r.get("scenario"), 0) + 1
            elif r.get("status") == "failed":
                problems.append(f"line {i}: failed run: {r.get('scenario')} {r.get('tool')}: {r.get('error')}")
            elif r.get("status") != "unsupported":
                problems.append(f"line {i}: unknown status {r.get('status')!r}")
            seen_any[r.get("scenario")] = seen_any.get(r.get("scenario"), 0) + 1
    for sc in scenarios:
        if not seen_any.get(sc):
            problems.append(f"scenario {sc}: no records")
        elif not seen_ok.get(sc) and sc != "link":
            problems.append(f"scenario {sc}: no successful run")
        elif counted and seen_ok.get(sc) and not seen_counted.get(sc):
            problems.append(f"scenario {sc}: no run counted its system calls")
    return problems


def build_xrun(work: str) -> str:
    src = os.path.join(PERF_DIR, "xrun.c")
    exe = os.path.join(work, "xrun")
    errs = []
    for cc in (["cc", "-static"], ["cc"], ["c++", "-x", "c++", "-static"], ["c++", "-x", "c++"]):
        r = subprocess.run(cc + ["-O2", "-o", exe, src], capture_output=True, text=True)
        if r.returncode == 0:
            os.chmod(exe, 0o755)
            return exe
        errs.append(r.stderr.strip()[-300:])
    raise SystemExit(f"bench: cannot compile {src}: {errs}")


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def warm_memory(nbytes: int) -> None:
    """Touches nbytes of anonymous memory and frees it again, untimed.

    On a virtual machine whose host backs guest memory lazily, the first touch of a guest page
    is expensive: on the development VM, writing 1 GiB into the page cache costs 2.8 s of system
    time in never-touched memory and 0.18 s in memory the guest has used and freed before. Which
    tool happens to get fresh pages would otherwise decide disk results. Freed pages go back to
    the guest kernel, which hands them out again to the page cache and to the next processes
    (and keeps them while free page reporting is held off: hold_page_reporting).
    """
    import mmap
    nbytes = min(nbytes, mem_available() // 3)
    if nbytes <= 0:
        return
    t0 = time.time()
    m = mmap.mmap(-1, nbytes)
    page = b"\1" * (1 << 20)
    for _ in range(nbytes >> 20):
        m.write(page)
    m.close()
    log(f"bench: warmed {nbytes >> 20} MiB of memory in {time.time() - t0:.1f}s")


def world_accessible(path: str) -> str | None:
    """GridFTP sessions run as 'nobody': every directory above the work tree must let it through."""
    p = os.path.abspath(path)
    while True:
        st = os.stat(p)
        if not st.st_mode & 0o001:
            return p
        if p == "/":
            return None
        p = os.path.dirname(p)


def sweep_stale_work(parent: str) -> None:
    for name in os.listdir(parent):
        m = re.fullmatch(r"xdfs-perf\.(\d+)\.\w+", name)
        if m and not pid_alive(int(m.group(1))):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


# ----------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="results directory (records.jsonl, meta.json)")
    ap.add_argument("--xdfs-bin", required=True, help="directory holding xdfsd and xduc")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition (the test suite's run)")
    ap.add_argument("--scenarios", default="mem,disk,small,link,cached",
                    help="comma list of mem,disk,small,link,cached (or a,b,c,d,e)")
    ap.add_argument("--tools", default="", help="only these tools (e.g. xdfs,iperf3; 'gridftp' selects every variant)")
    ap.add_argument("--reps", type=int, help="repetitions of every point (default 3, smoke 1)")
    ap.add_argument("--work", default="", help="scratch directory for test data (default: a fresh one in /var/tmp)")
    ap.add_argument("--keep-work", action="store_true", help="leave the scratch directory behind")
    ap.add_argument("--mem-size", help="bytes per memory-to-memory and link run (default 4G)")
    ap.add_argument("--mem-streams", help="stream counts (default 1,2,4,...,512,1000)")
    ap.add_argument("--disk-matrix", help="SIZE:STREAMS,...;SIZE:... (default: see README)")
    ap.add_argument("--small-sets", help="COUNTxSIZE,... (default 1x1G,1000x1M,10000x100K,100000x10K)")
    ap.add_argument("--small-dirs", help=argparse.SUPPRESS)
    ap.add_argument("--small-streams", type=int, default=4, help="xduc -p for tree copies (default 4)")
    ap.add_argument("--link-rates", help="tbf rates (default 1gbit,10gbit)")
    ap.add_argument("--link-streams", help="stream counts in link mode (default 1,8,64)")
    ap.add_argument("--link-size", help="RATE:SIZE,... bytes per link run (default 1gbit:256M,10gbit:1G)")
    ap.add_argument("--cached-size", help="bytes of the page-cached file downloaded to /dev/null (default 2G)")
    ap.add_argument("--cached-streams", help="stream counts of the page-cached downloads (default 1,8)")
    ap.add_argument("--block-size", help="block size for xduc and globus-url-copy/-server (default 1M)")
    ap.add_argument("--iperf-time", type=int, help="seconds per iperf3 run (-t; default 2, smoke 1)")
    ap.add_argument("--no-syscalls", action="store_true",
                    help="no extra run of each point counting system calls (perf stat)")
    ap.add_argument("--cc", type=int, help="globus-url-copy -cc for the gridftp-pp-cc variant (default 2)")
    ap.add_argument("--xduc-extra", default="", help="extra xduc arguments (e.g. a protection mode once xSec lands)")
    ap.add_argument("--xdfsd-extra", default="", help="extra xdfsd arguments")
    ap.add_argument("--warm", help="memory to touch and free before each scenario (default: largest "
                    "disk/small run + 1G, at least 2G; 0 turns it off); see warm_memory()")
    ap.add_argument("--sweep-only", action="store_true", help="remove what dead drivers left behind, then exit")
    ap.add_argument("--check-only", action="store_true", help="only validate OUT/records.jsonl")
    args = ap.parse_args(argv)

    defaults = SMOKE if args.smoke else FULL
    for k, v in defaults.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    scen = []
    for s in args.scenarios.split(","):
        s = ALIASES.get(s.strip(), s.strip())
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}")
        if s not in scen:
            scen.append(s)
    args.scenarios = scen
    # A bad size or stream list is a one-line usage error naming the option, not a traceback later.
    for opt, parse in (("mem_size", parse_size), ("cached_size", parse_size), ("block_size", parse_size),
                       ("mem_streams", ints), ("cached_streams", ints), ("link_streams", ints)):
        try:
            parse(getattr(args, opt))
        except ValueError as e:
            ap.error(f"--{opt.replace('_', '-')}: {e}")
    os.makedirs(args.out, exist_ok=True)
    args.out = os.path.abspath(args.out)

    if args.sweep_only:
        # What a driver killed outright (SIGKILL) leaves: its namespaces and scratch directory.
        if os.geteuid() == 0:
            netns_sweep_stale()
        sweep_stale_work(args.work or "/var/tmp")
        return 0

    if args.check_only:
        probs = check_records(os.path.join(args.out, "records.jsonl"), args.scenarios)
        for p in probs:
            log(f"check: {p}")
        return 1 if probs else 0

    # Die with run.sh (e.g. when ctest's timeout kills it): SIGTERM runs the cleanup below.
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    def on_signal(sig, _frm):
        raise SystemExit(128 + sig)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 65536) if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))

    args.xdfs_bin = os.path.abspath(args.xdfs_bin)
    for exe in ("xdfsd", "xduc"):
        if not os.access(os.path.join(args.xdfs_bin, exe), os.X_OK):
            ap.error(f"{exe} not found in {args.xdfs_bin}")

    need = {"mem": ["globus-gridftp-server", "globus-url-copy", "iperf3"],
            "disk": ["globus-gridftp-server", "globus-url-copy"],
            "small": ["globus-gridftp-server", "globus-url-copy", "rsync", "tar"],
            "link": ["globus-gridftp-server", "globus-url-copy", "iperf3", "ip", "tc"],
            "cached": ["globus-gridftp-server", "globus-url-copy", "iperf3"]}
    missing = sorted({t for sc in args.scenarios for t in need[sc] if not shutil.which(t)})
    if missing:
        log(f"bench: missing {', '.join(missing)}: run perf/install-peers.sh (or perf/run.sh without --no-install)")
        return 2

    parent = "/var/tmp"
    if args.work:
        os.makedirs(args.work, exist_ok=True)
        args.work = tempfile.mkdtemp(prefix=f"xdfs-perf.{os.getpid()}.", dir=args.work)
    else:
        sweep_stale_work(parent)
        args.work = tempfile.mkdtemp(prefix=f"xdfs-perf.{os.getpid()}.", dir=parent)
    if not args.keep_work:
        H.dirs.append(args.work)
    os.chmod(args.work, 0o755)
    blocked = world_accessible(args.work) if os.geteuid() == 0 else None
    if blocked:
        log(f"bench: GridFTP sessions run as 'nobody', which cannot enter {blocked}; pick --work elsewhere")
        return 2

    ctx = Ctx(args)
    for d in (ctx.srv, ctx.cli, ctx.tmp):
        os.makedirs(d, exist_ok=True)
        os.chmod(d, 0o755)
    H.xrun = build_xrun(args.work)
    xsec_setup(ctx)
    ctx.link_why = None

    plan = build_plan(args)
    started = time.time()
    reporting = hold_page_reporting()
    write_meta(ctx, args, dict(started_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                               page_reporting=reporting))
    ctx.count = not args.no_syscalls and syscalls.works()
    if not args.no_syscalls and not ctx.count:
        log("bench: perf cannot count system calls here (perf stat -e raw_syscalls:sys_enter): none counted")
    rounds = args.reps + (1 if ctx.count else 0)  # the last one counted, when counting
    total = sum(len(tools_for(args, sc)) for sc, _ in plan) * rounds
    log(f"bench: {total} runs ({args.reps} reps) of {', '.join(args.scenarios)}; work {args.work}; out {args.out}")
    done = 0
    scen_secs: dict[str, float] = {}
    try:
        for sc in args.scenarios:
            points = [p for s, p in plan if s == sc]
            tools = tools_for(args, sc)
            t_sc = time.time()
            if sc == "disk":
                disk_setup(ctx, sorted({p["size"] for p in points}))
            elif sc == "small":
                small_setup(ctx, sorted({(p["files"], p["size"]) for p in points}))
            elif sc == "cached":
                cached_setup(ctx, sorted({p["size"] for p in points}))
            elif sc == "link":
                if os.geteuid() != 0:
                    ctx.link_why = "link mode needs root (network namespaces, tc)"
                else:
                    netns_sweep_stale()
                    try:
                        ctx.link = Link()
                        ctx.link.up()
                    except Exception as e:  # noqa: BLE001
                        ctx.link_why = f"cannot build the namespaces: {e}"
                        if ctx.link:
                            ctx.link.down()
                        ctx.link = None
            if args.warm is None:
                # Destination page cache of the largest run, plus room for the processes.
                biggest = max((p["bytes"] for p in points), default=0) if sc in ("disk", "small") else 0
                warm = max(biggest + GiB, 2 * GiB) if not args.smoke else 64 * MiB
            else:
                warm = parse_size(args.warm)
            warm_memory(warm)
            for rep in range(rounds):
                for i, point in enumerate(points):
                    # Taking turns: the tool order rotates with the point and the repetition.
                    for tool in rotated(tools, rep + i):
                        rec = run_one(ctx, sc, point, tool, rep, counted=rep == args.reps)
                        ctx.write(rec)
                        done += 1
                        log(f"[{done}/{total}] {describe(rec)}")
            if sc == "link" and ctx.link:
                ctx.link.down()
                ctx.link = None
            if sc == "small":
                shutil.rmtree(os.path.join(ctx.srv, "small"), ignore_errors=True)
            if sc == "cached":
                for f in os.listdir(ctx.srv):
                    if f.startswith("c_"):
                        os.unlink(os.path.join(ctx.srv, f))
            if sc == "disk":
                for f in os.listdir(ctx.srv):
                    if f.startswith("f_"):
                        os.unlink(os.path.join(ctx.srv, f))
                for f in os.listdir(ctx.cli):
                    if f.startswith("f_"):
                        os.unlink(os.path.join(ctx.cli, f))
            scen_secs[sc] = round(time.time() - t_sc, 1)
    finally:
        ctx.records.close()
        H.cleanup()
        try:
            with open(os.path.join(args.out, "meta.json")) as f:
                meta = json.load(f)
            meta["finished_at"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
            meta["wall_seconds"] = round(time.time() - started, 1)
            meta["scenario_seconds"] = scen_secs
            meta["runs_done"] = done
            meta["runs_planned"] = total
            with open(os.path.join(args.out, "meta.json"), "w") as f:
                json.dump(meta, f, indent=2, sort_keys=True)
        except (OSError, ValueError):
            pass

    log(f"bench: {done} runs in {time.time() - started:.0f}s, {ctx.failures} failed")
    probs = check_records(os.path.join(args.out, "records.jsonl"), args.scenarios, ctx.count)
    for p in probs:
        log(f"check: {p}")
    return 1 if probs else 0


if __name__ == "__main__":
    sys.exit(main())
