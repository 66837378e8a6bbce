#!/usr/bin/python3
"""One file to many hosts through a relay chain, on real hosts: network namespaces on a bridge
with tbf-limited links (scripts/testbed.sh), one xdfsd per host, xduc as the master on the
source. Run as the test suite does:

    scripts/testbed.sh --hosts 4 --rate 200mbit -- tests/relay/chain.py BUILD_DIR [CASE...]

Cases: identical, kill, rejoin, slow, corrupt, bad, peers, tree, chains, full. Each starts its own servers and checks what arrived
byte by byte; nothing here judges a timing (the slow host's case checks the order in which the
hosts finished, and that the master says it moved that host).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

BUILD = os.path.abspath(sys.argv[1])
XDUC = os.path.join(BUILD, "examples", "xduc")
XDFSD = os.path.join(BUILD, "examples", "xdfsd")
HERE = os.path.dirname(os.path.abspath(__file__))
BED = os.path.join(HERE, "..", "..", "scripts", "testbed.sh")
K = int(os.environ["XTB_HOSTS"])
RATE = os.environ["XTB_RATE"]
MiB = 1 << 20

work = tempfile.mkdtemp(prefix="xdfs-relay-")
env = dict(os.environ, XDFS_CONFIG_DIR=os.path.join(work, "cfg"))
pub = subprocess.run([XDUC, "keygen"], env=env, check=True, capture_output=True, text=True).stdout.strip()
failures: list[str] = []


def addr(i: int) -> str:
    return os.environ[f"XTB_ADDR_{i}"]


def state_dir(i: int) -> str:
    return os.path.join(work, f"state-h{i}")  # one key per host for every case (pinned once)


def make_peers() -> None:
    """The hosts are one group of servers that may relay to each other: each one's relay_peers
    holds every host's key (docs/relay.md)."""
    keys = []
    empty = os.path.join(work, "empty")
    os.makedirs(empty, exist_ok=True)
    for i in range(1, K + 1):
        os.makedirs(state_dir(i), exist_ok=True)
        keys.append(subprocess.run([XDFSD, "--root", empty, "--state-dir", state_dir(i), "--print-key"],
                                   check=True, capture_output=True, text=True).stdout.strip() + f" {addr(i)}:7721")
    for i in range(1, K + 1):
        with open(os.path.join(state_dir(i), "relay_peers"), "w") as f:
            f.write("".join(k + "\n" for k in keys))


make_peers()


def check(ok: bool, what: str) -> None:
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def url(i: int, path: str = "in/") -> str:
    return f"xdfs://{addr(i)}:7721/{path}"


class Host:
    """xdfsd on host i of the bed, serving a root of its own."""

    def __init__(self, i: int, case: str, extra_env: dict | None = None, args: list[str] | None = None,
                 key: str | None = None) -> None:
        self.i = i
        self.root = os.path.join(work, case, f"h{i}", "root")
        self.state = state_dir(i)
        os.makedirs(os.path.join(self.root, "in"), exist_ok=True)
        os.makedirs(os.path.join(work, case), exist_ok=True)
        os.makedirs(self.state, exist_ok=True)
        with open(os.path.join(self.state, "authorized_keys"), "w") as f:
            f.write(f"{key or pub} rw\n")
        self.log = open(os.path.join(work, case, f"h{i}.log"), "ab")
        self.cmd = ["ip", "netns", "exec", os.environ[f"XTB_NS_{i}"], XDFSD, "--root", self.root, "--state-dir",
                    self.state, "--listen", f"{addr(i)}:7721", "--idle-timeout", "10", *(args or [])]
        self.env = dict(os.environ, **(extra_env or {}))
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=self.log, env=self.env)
        self.wait_listening()

    def wait_listening(self) -> None:
        for _ in range(100):
            r = subprocess.run(["ip", "netns", "exec", os.environ["XTB_SRC"], "python3", "-c",
                                f"import socket; socket.create_connection(('{addr(self.i)}', 7721), 0.2)"],
                               capture_output=True)
            if r.returncode == 0:
                return
            time.sleep(0.05)
        raise SystemExit(f"xdfsd on host {self.i} did not start; see {self.log.name}")

    def file(self, name: str) -> str:
        return os.path.join(self.root, "in", name)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def master(args: list[str], wait: bool = True):
    cmd = ["ip", "netns", "exec", os.environ["XTB_SRC"], XDUC, "-q", "--json", "-p", "2", *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=work)
    if not wait:
        return p
    out, err = p.communicate(timeout=600)
    return p.returncode, out, err



def summary(out: str) -> dict:
    lines = [l for l in out.splitlines() if l.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def source(case: str, size: int) -> str:
    path = os.path.join(work, case, "src.bin")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(os.urandom(size))
    return path


def manifest_digest(path: str, block_size: int) -> str:
    r = subprocess.run([XDUC, "sum", "--block-size", str(block_size), path], capture_output=True, text=True, env=env,
                       check=True)
    return r.stdout.split()[0]


def check_copies(case: str, hosts: list, src: str, but=None) -> None:
    """Every host but `but` has the source byte for byte."""
    want = sha(src)
    for h in hosts:
        if h is not but:
            f = h.file("src.bin")
            check(os.path.exists(f) and sha(f) == want, f"{case}: host {h.i} has the file byte for byte")


def identical() -> None:
    hosts = [Host(i, "identical") for i in range(1, K + 1)]
    src = source("identical", 48 * MiB + 12345)
    try:
        rc, out, err = master([src, *[url(i) for i in range(1, K + 1)]])
        s = summary(out)
        check(rc == 0, f"identical: xduc exits 0 (got {rc}: {err.strip()})")
        check_copies("identical", hosts, src)
        check(s.get("block_size") == 256 * 1024, "identical: a chain's blocks are 256K by default")
        check(s.get("digest") == manifest_digest(src, s.get("block_size", 0)),
              "identical: the reported digest is the source's manifest digest")
        check(all(x["ok"] and x["digest"] == s.get("digest") for x in s.get("hosts", [])) and len(s.get("hosts", [])) == K,
              "identical: every host reports the source's digest")
        sent = s.get("source_bytes", 0)
        check(sent <= 1.05 * os.path.getsize(src), f"identical: the source sent {sent} bytes, about the file once")
    finally:
        for h in hosts:
            h.stop()


def zerocopy() -> None:
    """In clear mode every hop forwards its copy by sendfile, with the digests its source sent."""
    hosts = [Host(i, "zerocopy", args=["--debug"]) for i in range(1, K + 1)]
    size = 24 * MiB + 777
    src = source("zerocopy", size)
    try:
        rc, out, err = master(["--protect", "clear", src, *[url(i) for i in range(1, K + 1)]])
        check(rc == 0, f"zerocopy: xduc exits 0 (got {rc}: {err.strip()})")
        check_copies("zerocopy", hosts, src)
        for h in hosts[:-1]:
            h.log.flush()
            with open(h.log.name, errors="replace") as f:
                log = f.read()
            check(f"debug: zero copy: {size} bytes by sendfile" in log,
                  f"zerocopy: host {h.i} forwarded all {size} bytes by sendfile")
    finally:
        for h in hosts:
            h.stop()


def kill() -> None:
    hosts = [Host(i, "kill") for i in range(1, K + 1)]
    src = source("kill", 64 * MiB)
    size = os.path.getsize(src)
    victim = hosts[1]  # a middle one
    partial = os.path.join(victim.root, "in", ".src.bin.xdfs-partial")
    try:
        p = master(["--limit-rate", "8M", "--failed-hosts", os.path.join(work, "kill", "failed"), src,
                    *[url(i) for i in range(1, K + 1)]], wait=False)
        deadline = time.time() + 120
        while time.time() < deadline and p.poll() is None:
            if os.path.exists(partial) and os.path.getsize(partial) >= 0.4 * size:
                break
            time.sleep(0.05)
        at = os.path.getsize(partial) if os.path.exists(partial) else 0
        victim.kill()
        out, err = p.communicate(timeout=600)
        s = summary(out)
        check(p.returncode == 1, f"kill: xduc exits 1 naming the failed host (got {p.returncode})")
        check(0 < at < size, f"kill: host {victim.i} was killed mid-way ({at} of {size} bytes)")
        check_copies("kill", hosts, src, but=victim)
        want = sha(src)
        bad = [x["host"] for x in s.get("hosts", []) if not x["ok"]]
        check(bad == [url(victim.i)], f"kill: only host {victim.i} is reported failed ({bad})")
        with open(os.path.join(work, "kill", "failed")) as f:
            listed = f.read().split()
        check(listed == [url(victim.i)], f"kill: the failed-hosts file lists it ({listed})")
        # It comes back: the list given back finishes it, from what it had verified.
        victim.start()
        rc, out, err = master(["--hosts", os.path.join(work, "kill", "failed"), src])
        s2 = summary(out)
        check(rc == 0 and sha(victim.file("src.bin")) == want, f"kill: --hosts finishes host {victim.i} ({err.strip()})")
        check(0 < s2.get("source_bytes", size) < size,
              f"kill: and sends only what it lacked ({s2.get('source_bytes')} of {size} bytes)")
    finally:
        for h in hosts:
            h.stop()


def rejoin() -> None:
    # A middle host killed at 40% and started again a moment later: the master registers it
    # again, at the end of the chain, and it goes on from what it had; every host ends whole.
    hosts = [Host(i, "rejoin") for i in range(1, K + 1)]
    src = source("rejoin", 64 * MiB)
    size = os.path.getsize(src)
    victim = hosts[1]
    partial = os.path.join(victim.root, "in", ".src.bin.xdfs-partial")
    try:
        p = master(["--limit-rate", "8M", src, *[url(i) for i in range(1, K + 1)]], wait=False)
        deadline = time.time() + 120
        while time.time() < deadline and p.poll() is None:
            if os.path.exists(partial) and os.path.getsize(partial) >= 0.4 * size:
                break
            time.sleep(0.05)
        victim.kill()
        time.sleep(0.5)
        victim.start()
        out, err = p.communicate(timeout=600)
        s = summary(out)
        check(p.returncode == 0, f"rejoin: xduc exits 0 ({err.strip()})")
        check_copies("rejoin", hosts, src)
        notes = " / ".join(s.get("notes", []))
        check(f"{addr(victim.i)}:7721 answers again" in notes, f"rejoin: the master took host {victim.i} back ({notes})")
        check(s.get("source_bytes", 0) <= 1.05 * size, f"rejoin: the source sent the file about once ({s.get('source_bytes')})")
    finally:
        for h in hosts:
            h.stop()


def slow() -> None:
    hosts = [Host(i, "slow") for i in range(1, K + 1)]
    src = source("slow", 32 * MiB)
    slow_host = hosts[1]
    rate_bits = int("".join(c for c in RATE if c.isdigit()))
    unit = "".join(c for c in RATE if not c.isdigit())
    subprocess.run([BED, "link", f"h{slow_host.i}", f"{max(rate_bits // 10, 1)}{unit}"], check=True)
    try:
        rc, out, err = master([src, *[url(i) for i in range(1, K + 1)]])
        s = summary(out)
        check(rc == 0, f"slow: xduc exits 0 ({err.strip()})")
        check_copies("slow", hosts, src)
        notes = " / ".join(s.get("notes", []))
        check(f"{addr(slow_host.i)}:7721 gets" in notes and "end of the chain" in notes,
              f"slow: the master moved host {slow_host.i} to the end ({notes})")
        t = {x["host"]: x["seconds"] for x in s.get("hosts", [])}
        others = [t[url(h.i)] for h in hosts if h is not slow_host]
        check(others and max(others) < t.get(url(slow_host.i), 0),
              f"slow: every other host finished before it ({t})")
    finally:
        subprocess.run([BED, "link", f"h{slow_host.i}", RATE], check=True)
        for h in hosts:
            h.stop()


def corrupt() -> None:
    bad = 2
    hosts = [Host(i, "corrupt", {"XDFS_TEST_RELAY_CORRUPT": "1"} if i == bad else None) for i in range(1, K + 1)]
    src = source("corrupt", 24 * MiB)
    try:
        rc, out, err = master(["--protect", "clear", src, *[url(i) for i in range(1, K + 1)]])
        s = summary(out)
        check(rc == 1, f"corrupt: xduc exits 1 (got {rc})")
        check_copies("corrupt", hosts, src, but=hosts[bad - 1])
        failed = {x["host"]: x.get("error", {}) for x in s.get("hosts", []) if not x["ok"]}
        check(list(failed) == [url(bad)] and "damaged" in failed[url(bad)].get("message", ""),
              f"corrupt: host {bad} is named, its copy damaged ({failed})")
    finally:
        for h in hosts:
            h.stop()


def bad_input() -> None:
    # Host 1 fine; 2 does not know our key; 3 takes files of 1 MiB at most; 4 runs no server; and
    # host 1 once more.
    other = subprocess.run([XDUC, "--identity", os.path.join(work, "other_id"), "keygen"], env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    hosts = [Host(1, "bad"), Host(2, "bad", key=other), Host(3, "bad", args=["--max-file-size", "1M"])]
    src = source("bad", 8 * MiB)
    try:
        targets = [url(1), url(2), url(3), url(4), url(1)]
        rc, out, err = master(["--failed-hosts", os.path.join(work, "bad", "failed"), src, *targets])
        s = summary(out)
        check(rc == 1, f"bad: xduc exits 1 (got {rc})")
        check(sha(hosts[0].file("src.bin")) == sha(src), "bad: host 1 has the file byte for byte")
        msgs = [(x["host"], x.get("error", {}).get("code", ""), x.get("error", {}).get("message", ""))
                for x in s.get("hosts", [])]
        print("     " + "\n     ".join(map(str, msgs)))
        ok = [m for m in msgs if not m[1]]
        check(len(ok) == 1 and ok[0][0] == url(1), "bad: only the first host 1 succeeds")
        check(msgs[1][1] == "authentication failed" or "authorized" in msgs[1][2], "bad: host 2 refuses the key")
        check("limit" in msgs[2][2], "bad: host 3's size limit is named")
        check(msgs[3][1] in ("connection refused", "connection failed"), "bad: host 4 is unreachable")
        check("same host and file" in msgs[4][2], "bad: the duplicate is named")
    finally:
        for h in hosts:
            h.stop()


def full() -> None:
    # Host 2's disk is full (its root a 2 MiB tmpfs, in the bed's own mount namespace): it is
    # named, nothing is left half-written under the file's name there, and the others finish.
    # (Mounted before its server starts: `ip netns exec` gives the server a copy of the mounts.)
    small_disk = os.path.join(work, "full", "h2", "root")
    os.makedirs(small_disk, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", small_disk], check=True)
    hosts = [Host(i, "full") for i in range(1, K + 1)]
    src = source("full", 8 * MiB)
    try:
        rc, out, err = master(["--failed-hosts", os.path.join(work, "full", "failed"), src,
                               *[url(i) for i in range(1, K + 1)]])
        s = summary(out)
        check(rc == 1, f"full: xduc exits 1 (got {rc})")
        check_copies("full", hosts, src, but=hosts[1])
        failed = {x["host"]: x.get("error", {}) for x in s.get("hosts", []) if not x["ok"]}
        msg = failed.get(url(2), {}).get("message", "")
        check(list(failed) == [url(2)] and ("space" in msg or "full" in msg),
              f"full: host 2 is named, its disk full ({failed})")
        check(not os.path.exists(hosts[1].file("src.bin")), "full: host 2 has no half-written file under the name")
    finally:
        for h in hosts:
            h.stop()
        subprocess.run(["umount", small_disk], check=False)


def peers() -> None:
    # Host 1 may not forward to host 2 (its relay peers are not set up): named, and host 2 is
    # fed by the source instead.
    hosts = [Host(1, "peers", args=["--relay-peers", os.path.join(work, "no-such-file")]), Host(2, "peers")]
    src = source("peers", 4 * MiB)
    try:
        rc, out, err = master(["--failed-hosts", os.path.join(work, "peers", "failed"), src, url(1), url(2)])
        s = summary(out)
        check(rc == 1, f"peers: xduc exits 1 (got {rc})")
        check_copies("peers", hosts, src, but=hosts[0])
        h1 = s.get("hosts", [{}])[0]
        check(not h1.get("ok", True) and "relay peers" in h1.get("error", {}).get("message", ""),
              f"peers: host 1 is named, with its relay peers ({h1})")
    finally:
        for h in hosts:
            h.stop()


def make_tree(root: str) -> int:
    """A tree as people have them: nested directories, an empty one, a symlink, many small files,
    a few large ones (that go by chain), odd modes and old mtimes. Returns the large files' bytes."""
    large = 0
    for d in ["a/b/c", "a/d", "empty", "e f"]:
        os.makedirs(os.path.join(root, d), exist_ok=True)
    for n in range(60):
        with open(os.path.join(root, ["a", "a/b", "a/b/c", "e f"][n % 4], f"small-{n}.txt"), "wb") as f:
            f.write(os.urandom(n * 997))
    for n, size in enumerate([3 * MiB + 7, 5 * MiB, 2 * MiB + 4097]):
        with open(os.path.join(root, ["a/d", "a/b/c", "."][n], f"large-{n}.bin"), "wb") as f:
            f.write(os.urandom(size))
        large += size
    os.chmod(os.path.join(root, "a/d/large-0.bin"), 0o640)
    os.chmod(os.path.join(root, "a/small-0.txt"), 0o600)
    os.symlink("../a/d/large-0.bin", os.path.join(root, "e f", "link"))
    for dirpath, dirs, names in os.walk(root, topdown=False):
        for n in names + dirs:
            os.utime(os.path.join(dirpath, n), ns=(1_500_000_000_123_456_789, 1_500_000_000_123_456_789),
                     follow_symlinks=False)
    os.utime(root, ns=(1_400_000_000_000_000_000, 1_400_000_000_000_000_000))
    return large


def tree_listing(root: str) -> dict:
    """Every entry under root: kind, mode, mtime, and content digest or link target."""
    out = {}
    for dirpath, dirs, names in os.walk(root):
        for n in dirs + names:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("dir", oct(st.st_mode & 0o7777), st.st_mtime_ns)
            else:
                out[rel] = ("file", oct(st.st_mode & 0o7777), st.st_mtime_ns, sha(p))
    return out


def tree() -> None:
    # A tree and a file to every host: directories and symlinks to each host, small files in a
    # pack and large files by chain; host 4 takes files of 2 MiB at most, so it fails on a large
    # one, named, and the others finish.
    hosts = [Host(i, "tree", args=["--max-file-size", "2M"] if i == K else None) for i in range(1, K + 1)]
    root = os.path.join(work, "tree", "src", "data")
    large = make_tree(root)
    extra = source("tree", 4 * MiB + 3)
    small = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(root) for n in ns
                if not os.path.islink(os.path.join(d, n)) and os.path.getsize(os.path.join(d, n)) < MiB)
    try:
        rc, out, err = master(["-r", "--failed-hosts", os.path.join(work, "tree", "failed"), root, extra,
                               *[url(i) for i in range(1, K + 1)]])
        s = summary(out)
        check(rc == 1, f"tree: xduc exits 1, host {K} failing (got {rc}: {err.strip()})")
        want = tree_listing(root)
        for h in hosts[:-1]:
            got = tree_listing(os.path.join(h.root, "in", "data"))
            diff = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
            check(not diff, f"tree: host {h.i} has the tree, modes and mtimes too (differs: {diff[:5]})")
            check(sha(h.file("src.bin")) == sha(extra), f"tree: host {h.i} has the file beside it")
        hs = s.get("hosts", [])
        check([x["ok"] for x in hs] == [True] * (K - 1) + [False], f"tree: only host {K} failed ({hs})")
        msg = hs[-1].get("error", {}).get("message", "") if hs else ""
        check("large-" in msg or "src.bin" in msg, f"tree: host {K}'s failure names the file ({msg})")
        check(s.get("sources") == 2 and s.get("bytes") == large + small + os.path.getsize(extra),
              f"tree: the set's bytes are counted ({s.get('bytes')} of {large + small + os.path.getsize(extra)})")
        sent = s.get("source_bytes", 0)
        data = large + small + os.path.getsize(extra)
        check(data <= sent <= 1.05 * data,
              f"tree: every file left the source about once, the small ones in packs ({sent} bytes for {data})")
        for h in hosts:
            left = [n for _, _, ns in os.walk(os.path.join(h.root, "in")) for n in ns if n.startswith(".xdfs-pack-")]
            check(not left, f"tree: host {h.i} kept no pack ({left})")
    finally:
        for h in hosts:
            h.stop()


def chains() -> None:
    # Two chains of two hosts each, both fed by the source: every host identical, and the source
    # sent the file twice (once per chain).
    hosts = [Host(i, "chains") for i in range(1, K + 1)]
    src = source("chains", 16 * MiB + 5)
    size = os.path.getsize(src)
    try:
        rc, out, err = master(["--chains", "2", src, *[url(i) for i in range(1, K + 1)]])
        s = summary(out)
        check(rc == 0, f"chains: xduc exits 0 ({err.strip()})")
        check_copies("chains", hosts, src)
        check(s.get("digest") == manifest_digest(src, s.get("block_size", 0)) and
              all(x["digest"] == s.get("digest") for x in s.get("hosts", [])),
              "chains: every host reports the source's digest")
        sent = s.get("source_bytes", 0)
        check(1.9 * size <= sent <= 2.1 * size, f"chains: the source sent the file once per chain ({sent} of {size})")
    finally:
        for h in hosts:
            h.stop()


CASES = {"identical": identical, "zerocopy": zerocopy, "kill": kill, "rejoin": rejoin, "slow": slow, "corrupt": corrupt, "bad": bad_input, "peers": peers,
         "tree": tree, "chains": chains, "full": full}


def main() -> int:
    wanted = sys.argv[2:] or list(CASES)
    try:
        for name in wanted:
            CASES[name]()
    finally:
        if not failures:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"logs kept in {work}")
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
