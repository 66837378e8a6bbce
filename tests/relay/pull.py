#!/usr/bin/python3
"""Many hosts pulling one file through a master xdfsd (xduc get), on real hosts: network
namespaces on a bridge with tbf-limited links (scripts/testbed.sh), the master's xdfsd on the
source, one `xduc get` per host. Run as the test suite does:

    scripts/testbed.sh --hosts 8 --rate 200mbit -- tests/relay/pull.py BUILD_DIR [CASE...]

Cases: many, kill, late, corrupt, forge, master, set, parts, parts-slow, parts-changed, set-forge, memory, bad.
Each starts its own master and checks what arrived byte by byte, and the bytes that left the
source's link; nothing here judges a timing.
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
MiB = 1 << 20
SRC_ADDR = "10.77.0.1"

work = tempfile.mkdtemp(prefix="xdfs-pull-")
# Where each host's set parts wait (xduc get --memory-stage): a directory of the test's own on
# /dev/shm, a memory file system (elsewhere none: the parts wait beside DST).
shm = tempfile.mkdtemp(prefix="xdfs-pull-test-", dir="/dev/shm") if os.path.isdir("/dev/shm") else None
failures: list[str] = []


def cfg(i: int) -> str:
    return os.path.join(work, f"cfg-h{i}")  # each host a key of its own


def key_of(i: int) -> str:
    env = dict(os.environ, XDFS_CONFIG_DIR=cfg(i))
    return subprocess.run([XDUC, "keygen"], env=env, check=True, capture_output=True, text=True).stdout.strip()


KEYS = {i: key_of(i) for i in range(0, K + 1)}  # 0: a key the master does not know


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


def source_sent() -> int:
    """Bytes the source's link has sent so far."""
    r = subprocess.run([BED, "bytes", "src"], check=True, capture_output=True, text=True)
    return int(r.stdout.split()[0])


class Master:
    """The master: xdfsd on the source, serving a root of its own to every host's key (read-only)."""

    def __init__(self, case: str, args: list[str] | None = None) -> None:
        self.root = os.path.join(work, case, "master")
        self.state = os.path.join(work, "master-state")  # one key for every case (pinned once)
        os.makedirs(self.root, exist_ok=True)
        os.makedirs(self.state, exist_ok=True)
        with open(os.path.join(self.state, "authorized_keys"), "w") as f:
            f.write("".join(f"{KEYS[i]} ro\n" for i in range(1, K + 1)))
        self.log = open(os.path.join(work, case, "master.log"), "ab")
        self.cmd = ["ip", "netns", "exec", os.environ["XTB_SRC"], XDFSD, "--root", self.root, "--state-dir", self.state,
                    "--listen", f"{SRC_ADDR}:7721", "--idle-timeout", "10", *(args or [])]
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=self.log)
        for _ in range(100):
            r = subprocess.run(["ip", "netns", "exec", os.environ["XTB_NS_1"], "python3", "-c",
                                f"import socket; socket.create_connection(('{SRC_ADDR}', 7721), 0.2)"],
                               capture_output=True)
            if r.returncode == 0:
                return
            time.sleep(0.05)
        raise SystemExit(f"the master's xdfsd did not start; see {self.log.name}")

    def file(self, name: str, size: int) -> str:
        path = os.path.join(self.root, name)
        with open(path, "wb") as f:
            f.write(os.urandom(size))
        return path

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


class Puller:
    """`xduc get` on host i, into a directory of its own."""

    def __init__(self, i: int, case: str, path: str, args: list[str] | None = None, key: int | None = None,
                 extra_env: dict | None = None, mem: str | None = None) -> None:
        self.i = i
        self.dir = os.path.join(work, case, f"h{i}")
        os.makedirs(self.dir, exist_ok=True)
        # (mem "none": parts wait beside DST.)
        self.mem = mem or (os.path.join(shm, case, f"h{i}") if shm else "none")
        if self.mem != "none":
            os.makedirs(self.mem, exist_ok=True)
        env = dict(os.environ, XDFS_CONFIG_DIR=cfg(i if key is None else key), **(extra_env or {}))
        cmd = ["ip", "netns", "exec", os.environ[f"XTB_NS_{i}"], XDUC, "-q", "--json", *(args or []), "get",
               "--server-log", os.path.join(work, case, f"h{i}.log"), "--memory-stage", self.mem,
               f"xdfs://{SRC_ADDR}:7721/{path}", self.dir + "/"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.rc = None
        self.out = self.err = ""

    def wait(self, timeout: float = 300) -> int:
        if self.rc is None:
            try:
                self.out, self.err = self.proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.out, self.err = self.proc.communicate()
            self.rc = self.proc.returncode
        return self.rc

    def summary(self) -> dict:
        lines = [l for l in self.out.splitlines() if l.startswith("{")]
        return json.loads(lines[-1]) if lines else {}

    def file(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def staged(self, pattern: str) -> list[str]:
        """What matches in its staging directory beside DST, or in memory (a set's parts)."""
        import glob
        dirs = [self.dir] + ([self.mem] if self.mem != "none" else [])
        return [q for d in dirs for q in glob.glob(os.path.join(d, ".xdfs-pull-*", pattern))]

    def have(self, name: str) -> int:
        """Bytes of the file here so far: its partial copy's size in the staging directory beside
        it (or, a set's part, in memory), or the whole."""
        for p in [*self.staged(f".{name}.xdfs-partial"), *self.staged(name), os.path.join(self.dir, name)]:
            if os.path.exists(p):
                return os.path.getsize(p)
        return 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.wait()


def wait_for(cond, limit: float = 120) -> bool:
    deadline = time.time() + limit
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def check_all(case: str, pullers: list, src: str, name: str, but=()) -> None:
    want = sha(src)
    for p in pullers:
        if p in but:
            continue
        rc = p.wait()
        f = p.file(name)
        check(rc == 0 and os.path.exists(f) and sha(f) == want,
              f"{case}: host {p.i} has the file byte for byte (exit {rc}: {p.err.strip()[-300:]})")


def many() -> None:
    m = Master("many")
    size = 24 * MiB + 4321
    src = m.file("data.bin", size)
    try:
        before = source_sent()
        pullers = [Puller(i, "many", "data.bin") for i in range(1, K + 1)]
        check_all("many", pullers, src, "data.bin")
        sent = source_sent() - before
        check(sent <= 1.2 * size, f"many: the source's link carried {sent} bytes for {K} hosts of a {size}-byte file")
        s = pullers[0].summary()
        check(s.get("bytes") == size and s.get("tries") == 1, f"many: the JSON line names the bytes and one try ({s})")
        st = os.stat(src)
        got = os.stat(pullers[-1].file("data.bin"))
        check(int(got.st_mtime) == int(st.st_mtime), "many: the copy keeps the source's mtime")
        left = sorted(os.listdir(pullers[0].dir))
        check(left == ["data.bin"], f"many: the file alone is left in DST, no staging ({left})")
    finally:
        m.stop()


def kill() -> None:
    m = Master("kill")
    size = 64 * MiB
    src = m.file("data.bin", size)
    try:
        pullers = [Puller(i, "kill", "data.bin") for i in range(1, K + 1)]
        victim = pullers[2]
        wait_for(lambda: victim.have("data.bin") >= 0.4 * size or victim.proc.poll() is not None)
        at = victim.have("data.bin")
        victim.kill()
        check(0 < at < size, f"kill: host {victim.i} was killed mid-way ({at} of {size} bytes)")
        check_all("kill", pullers, src, "data.bin", but=(victim,))
        check(not os.path.exists(victim.file("data.bin")), f"kill: host {victim.i} has nothing under the file's name")
    finally:
        m.stop()


def late() -> None:
    m = Master("late")
    size = 48 * MiB
    src = m.file("data.bin", size)
    try:
        before = source_sent()
        pullers = [Puller(i, "late", "data.bin") for i in range(1, K)]
        first = pullers[0]
        wait_for(lambda: first.have("data.bin") >= 0.5 * size or first.proc.poll() is not None)
        at = first.have("data.bin")
        pullers.append(Puller(K, "late", "data.bin"))
        check(0 < at < size, f"late: host {K} asked when host 1 had {at} of {size} bytes")
        check_all("late", pullers, src, "data.bin")
        sent = source_sent() - before
        check(sent <= 1.2 * size, f"late: the source's link carried {sent} bytes: the late host was fed by another host")
    finally:
        m.stop()


def corrupt(how: str = "1", case: str = "corrupt", set_: bool = False) -> None:
    """A pulling host whose server damages every block it forwards (a test hook): the hosts after
    it catch it, the master drops it, and they finish identical from the others. With "forge" the
    damaged blocks go with digests that match them (as a hostile host's would): the hosts after it
    do not keep a copy whose digest is not the master's. With set_, what travels is a set's pack,
    forged so that it still reads as a pack (the hook damages each block's last byte): none of
    its files may reach a host's directory."""
    m = Master(case)
    size = 16 * MiB
    if set_:
        top = os.path.join(m.root, "set")
        os.makedirs(os.path.join(top, "d"))
        for n in range(16):
            with open(os.path.join(top, "d" if n % 2 else "", f"f{n}.bin"), "wb") as f:
                f.write(os.urandom(size // 16 - n))
        want = tree_of(top)
        path, args, name = "set/", ["-r"], ".xdfs-set-0"  # (its part 0: the pack of all its files)
    else:
        src = m.file("data.bin", size)
        path, args, name = "data.bin", [], "data.bin"
    try:
        # It asks first, so that it is the chain's head and feeds the others.
        bad = Puller(2, case, path, args=args, extra_env={"XDFS_TEST_RELAY_CORRUPT": how})
        wait_for(lambda: bad.have(name) > 0 or bad.proc.poll() is not None)
        pullers = [bad] + [Puller(i, case, path, args=args) for i in (1, 3, 4)]
        if set_:
            for p in pullers[1:]:
                rc = p.wait()
                got = tree_of(p.dir)
                check(rc == 0 and got == want, f"{case}: host {p.i} has the set, identical (exit {rc}: "
                                               f"{p.err.strip()[-300:]}; {len(got)} of {len(want)} files)")
            bad.wait()
            got = tree_of(bad.dir)
            check(got in ({}, want), f"{case}: the damaging host has the set whole or nothing ({len(got)} files)")
        else:
            check_all(case, pullers, src, "data.bin", but=(bad,))
            bad.wait()
            f = bad.file("data.bin")
            check(not os.path.exists(f) or sha(f) == sha(src), f"{case}: the damaging host has the file whole or nothing")
        log = open(os.path.join(work, case, "master.log")).read()
        check("10.77.0.12" in log and "is out of the chain" in log, f"{case}: the master says it put host 2 out")
        # The others kept no damaged copy: the host after it refused it, so none of them was put
        # out or had to ask the master again.
        tries = [p.summary().get("tries") for p in pullers[1:]]
        check(tries == [1, 1, 1], f"{case}: the others needed one session to the master each ({tries})")
    finally:
        m.stop()


def master_restart() -> None:
    m = Master("master")
    size = 64 * MiB
    src = m.file("data.bin", size)
    try:
        pullers = [Puller(i, "master", "data.bin") for i in range(1, 4)]
        head = pullers[0]
        wait_for(lambda: head.have("data.bin") >= 0.4 * size or head.proc.poll() is not None)
        m.kill()
        at = head.have("data.bin")
        before = source_sent()
        time.sleep(0.5)
        m.start()
        check(0 < at < size, f"master: the master was killed mid-way (host 1 had {at} of {size} bytes)")
        check_all("master", pullers, src, "data.bin")
        sent = source_sent() - before
        check(sent <= size - at + 8 * MiB,
              f"master: after its restart the source sent {sent} bytes: what was verified before ({at}) stayed")
        tries = [p.summary().get("tries", 0) for p in pullers]
        check(all(t >= 2 for t in tries), f"master: every host asked the master again ({tries})")
    finally:
        m.stop()


def tree_of(root: str) -> dict:
    """Every regular file under root: relative path -> (SHA-256, permission bits)."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            if os.path.isfile(p) and not os.path.islink(p):
                out[os.path.relpath(p, root)] = (sha(p), os.stat(p).st_mode & 0o777)
    return out


def links_of(root: str) -> dict:
    """Every directory and symlink under root: relative path -> ("dir", permission bits, mtime)
    or ("link", target)."""
    out = {}
    for d, dirs, names in os.walk(root):
        for n in dirs + names:
            p = os.path.join(d, n)
            if os.path.islink(p):
                out[os.path.relpath(p, root)] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                st = os.stat(p)
                out[os.path.relpath(p, root)] = ("dir", st.st_mode & 0o777, st.st_mtime_ns)
    return out


def set_case() -> None:
    """A set: 4 hosts pull a directory (nested, an empty file, odd modes, symlinks, an empty
    directory, directories' modes and mtimes) as one pack; one host pulls only a subdirectory of
    it and gets only that."""
    m = Master("set")
    top = os.path.join(m.root, "set")
    for d in ("a", "a/b", "c"):
        os.makedirs(os.path.join(top, d), exist_ok=True)
    sizes = [0, 1, 4095, 65536, 300000, 2 * MiB + 7] * 5
    for n, size in enumerate(sizes):
        p = os.path.join(top, ("a", "a/b", "c", "")[n % 4], f"f{n}.bin")
        with open(p, "wb") as f:
            f.write(os.urandom(size))
        os.chmod(p, (0o644, 0o600, 0o755, 0o640)[n % 4])
    os.symlink("/etc/passwd", os.path.join(top, "c", "link"))  # (kept as it is, as a copy keeps it)
    os.symlink("f2.bin", os.path.join(top, "a", "b", "lib.so"))
    os.symlink("../c", os.path.join(top, "a", "up"))
    os.makedirs(os.path.join(top, "e", "empty"))
    os.chmod(os.path.join(top, "e", "empty"), 0o750)
    os.chmod(os.path.join(top, "a", "b"), 0o700)
    os.chmod(os.path.join(top, "e"), 0o555)  # (made writable while it fills, then given its mode)
    for n, d in enumerate(("a/b", "e/empty", "e", "a", "c")):
        os.utime(os.path.join(top, d), ns=(1_400_000_000_000_000_000 + n, 1_400_000_000_000_000_000 + n))
    want = tree_of(top)
    want_links = links_of(top)
    try:
        before = source_sent()
        pullers = [Puller(i, "set", "set/", args=["-r"]) for i in range(1, 5)]
        for p in pullers:
            rc = p.wait()
            got = tree_of(p.dir)
            check(rc == 0 and got == want, f"set: host {p.i} has the set's {len(want)} files with their modes "
                                           f"(exit {rc}: {p.err.strip()[-300:]}; {len(got)} files)")
            got_links = links_of(p.dir)
            check(got_links == want_links, f"set: host {p.i} has the set's symlinks, and its directories with their "
                                           f"modes and mtimes ({sorted(set(got_links.items()) ^ set(want_links.items()))})")
        total = sum(os.path.getsize(os.path.join(top, f)) for f in want)
        sent = source_sent() - before
        check(sent <= 1.2 * total + MiB, f"set: the source's link carried {sent} bytes for a {total}-byte set")
        s = pullers[0].summary()
        check(s.get("set") is True and s.get("files") == len(want), f"set: the JSON line names the set's files ({s})")
        # The pack's files were copied out while it arrived (by some host at least: a thread at
        # the idle priority does it), and those are in the trees checked above.
        early = [p.summary().get("early_files") for p in pullers]
        check(sum(e or 0 for e in early) > 0, f"set: files copied out of the pack while it arrived, by host ({early})")
        part = Puller(5, "set", "set/a/b/")
        rc = part.wait()
        sub = {k[len("a/b/"):]: v for k, v in want.items() if k.startswith("a/b/")}
        got = tree_of(part.dir)
        check(rc == 0 and got == sub, f"set: a host asking for a/b/ gets its {len(sub)} files and nothing else "
                                      f"({len(got)}; {part.err.strip()[-200:]})")
        check(links_of(part.dir) == {"lib.so": ("link", "f2.bin")}, f"set: a host asking for a/b/ gets its symlink "
                                                                    f"({links_of(part.dir)})")
    finally:
        m.stop()


def parts() -> None:
    """A set larger than a pack: the master deals it into parts (packs of 1 MiB here, and each
    file over 16 MiB alone), each through a chain of its own; 5 hosts pull it, one is killed once
    its first files are in place, the others get every file with its mode and mtime."""
    m = Master("parts", ["--pull-pack-size", "1M"])
    top = os.path.join(m.root, "big")
    for d in ("a", "a/b", "c"):
        os.makedirs(os.path.join(top, d), exist_ok=True)
    large = {"a/huge.bin": 17 * MiB + 5, "c/b/large.iso": 24 * MiB, "top.bin": 16 * MiB + 1}
    for rel, size in large.items():
        os.makedirs(os.path.dirname(os.path.join(top, rel)), exist_ok=True)
        with open(os.path.join(top, rel), "wb") as f:
            f.write(os.urandom(size))
    os.chmod(os.path.join(top, "a/huge.bin"), 0o640)
    os.utime(os.path.join(top, "c/b/large.iso"), ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
    for n in range(40):
        p = os.path.join(top, ("a", "a/b", "c", "")[n % 4], f"s{n}.bin")
        with open(p, "wb") as f:
            f.write(os.urandom((0, 1, 4096, 100_000, 300_001)[n % 5]))
        os.chmod(p, (0o644, 0o600, 0o755)[n % 3])
    os.utime(os.path.join(top, "a/b/s1.bin"), ns=(1_500_000_000_000_000_001, 1_500_000_000_000_000_001))
    want = tree_of(top)
    total = sum(os.path.getsize(os.path.join(top, f)) for f in want)
    try:
        before = source_sent()
        pullers = [Puller(i, "parts", "big/", args=["-r"]) for i in range(1, 6)]
        victim = pullers[3]
        wait_for(lambda: os.path.exists(victim.file("top.bin")) or os.path.exists(victim.file("a/s0.bin"))
                 or victim.proc.poll() is not None)
        victim.kill()
        had = len([f for f in tree_of(victim.dir) if not f.startswith(".xdfs-pull-")])  # (not its staging)
        check(0 < had < len(want), f"parts: host {victim.i} was killed with {had} of {len(want)} files in place")
        for p in pullers:
            if p is victim:
                continue
            rc = p.wait()
            got = tree_of(p.dir)
            check(rc == 0 and got == want, f"parts: host {p.i} has the set's {len(want)} files with their modes "
                                           f"(exit {rc}: {p.err.strip()[-300:]}; {len(got)} files)")
            mt = [os.stat(p.file(f)).st_mtime_ns if os.path.exists(p.file(f)) else None
                  for f in ("c/b/large.iso", "a/b/s1.bin")]
            check(mt == [1_600_000_000_123_456_789, 1_500_000_000_000_000_001],
                  f"parts: host {p.i} keeps the mtimes of a large file and of a packed one ({mt})")
            s = p.summary()
            check(s.get("files") == len(want), f"parts: host {p.i}'s JSON line counts {len(want)} files ({s})")
            left = [n for n in os.listdir(p.dir) if n.startswith(".xdfs-")]
            check(not left, f"parts: host {p.i} has no staging or pack left ({left})")
        sent = source_sent() - before
        check(sent <= 1.2 * total + 2 * MiB, f"parts: the source's link carried {sent} bytes for a {total}-byte set")
        log = open(m.log.name, errors="replace").read()
        check("part 2 of " in log, "parts: the master's log names the set's parts")
    finally:
        m.stop()


def parts_slow() -> None:
    """A host whose link is a quarter of the others' falls further behind them with every part:
    the chain of each part keeps its last host until the slow one has asked for that part too
    (the master knows it pulls the set), so it is fed by the others, never by the source again."""
    m = Master("parts-slow")
    top = os.path.join(m.root, "four")
    os.makedirs(top, exist_ok=True)
    for n in range(4):
        with open(os.path.join(top, f"f{n}.bin"), "wb") as f:
            f.write(os.urandom(16 * MiB + 1 + n))
    want = tree_of(top)
    total = sum(os.path.getsize(os.path.join(top, f)) for f in want)
    rate = os.environ["XTB_RATE"]
    slow = 4
    try:
        subprocess.run([BED, "link", f"h{slow}", f"{int(rate[:-4]) // 4}mbit" if rate.endswith("mbit") else rate],
                       check=True)
        before = source_sent()
        pullers = [Puller(i, "parts-slow", "four/", args=["-r"]) for i in range(1, slow + 1)]
        for p in pullers:
            rc = p.wait()
            got = tree_of(p.dir)
            check(rc == 0 and got == want, f"parts-slow: host {p.i} has the set's {len(want)} files "
                                           f"(exit {rc}: {p.err.strip()[-300:]}; {len(got)} files)")
        sent = source_sent() - before
        check(sent <= 1.2 * total + 2 * MiB,
              f"parts-slow: the source's link carried {sent} bytes for a {total}-byte set (one host 4x slower)")
    finally:
        subprocess.run([BED, "link", f"h{slow}", rate], check=True)
        m.stop()


def parts_changed() -> None:
    """A set that changes while a host pulls it: the host's later parts are refused (their plan is
    gone), it stops with one line and nothing but whole files of the set as it was; pulled again,
    it gets the set as it is now."""
    m = Master("parts-changed")
    top = os.path.join(m.root, "set")
    os.makedirs(top, exist_ok=True)
    for n in "abcd":
        with open(os.path.join(top, f"{n}.bin"), "wb") as f:
            f.write(os.urandom(20 * MiB))
    new = os.path.join(m.root, "d.new")  # (outside the set until it replaces d.bin)
    with open(new, "wb") as f:
        f.write(os.urandom(20 * MiB))
    try:
        p = Puller(1, "parts-changed", "set/")
        # (Part 0 is the pack of the small files, empty here; part 1 is a.bin.)
        wait_for(lambda: p.staged("..xdfs-set-1-*.xdfs-partial") or p.proc.poll() is not None)
        os.rename(new, os.path.join(top, "d.bin"))
        rc = p.wait(120)
        line = p.err.strip()
        check(rc == 1 and "changed" in line and "\n" not in line,
              f"parts-changed: the host stops with one line saying the set changed ({rc}: {line!r})")
        got = {k: v for k, v in tree_of(p.dir).items() if not k.startswith(".xdfs-pull-")}  # (staging keeps partials)
        check(set(got) < {"a.bin", "b.bin", "c.bin"} and all(got[f][0] == sha(os.path.join(top, f)) for f in got),
              f"parts-changed: only whole files of the old set are in DST ({sorted(got)})")
        again = Puller(1, "parts-changed", "set/")
        rc = again.wait()
        check(rc == 0 and tree_of(again.dir) == tree_of(top),
              f"parts-changed: pulled again, the host has the set as it is now ({rc}: {again.err.strip()[-300:]})")
    finally:
        m.stop()


def bad() -> None:
    m = Master("bad")
    m.file("data.bin", MiB)
    os.makedirs(os.path.join(m.root, "dir"), exist_ok=True)
    try:
        keep = os.path.join(work, "bad", "h1", "data.bin")
        os.makedirs(os.path.dirname(keep), exist_ok=True)

        def one(path: str, want: str, key: int | None = None, target: str | None = None) -> None:
            with open(keep, "w") as f:
                f.write("mine\n")
            p = Puller(1, "bad", path, key=key)
            rc = p.wait(60)
            line = p.err.strip()
            kept = open(keep).read() == "mine\n"
            check(rc == 1 and want in line and "\n" not in line and kept,
                  f"bad: get of '{path}' fails with one line naming it ({rc}: {line!r}), DST's file kept")

        one("nothing.bin", "no such file")
        one("dir", "directory")
        one("../outside.bin", "path")
        one("data.bin", "auth", key=0)
        # A large file of a set whose place in DST is a directory: the pull stops with one line
        # naming it, and the directory and what is in it stay.
        blk = os.path.join(m.root, "blk")
        os.makedirs(blk, exist_ok=True)
        with open(os.path.join(blk, "big.bin"), "wb") as f:
            f.write(os.urandom(17 * MiB))
        inside = os.path.join(work, "bad", "h1", "big.bin", "mine")
        os.makedirs(os.path.dirname(inside), exist_ok=True)
        with open(inside, "w") as f:
            f.write("mine\n")
        p = Puller(1, "bad", "blk/", args=["-r"])
        rc = p.wait(120)
        line = p.err.strip()
        check(rc == 1 and "big.bin" in line and "directory" in line and "\n" not in line
              and open(inside).read() == "mine\n",
              f"bad: a set's large file whose place is a directory fails with one line, the directory kept ({rc}: {line!r})")
        # A set of more files than a set takes: refused, naming the limit.
        many = os.path.join(m.root, "many")
        os.makedirs(many, exist_ok=True)
        for n in range(20001):
            open(os.path.join(many, f"{n}"), "wb").close()
        p = Puller(1, "bad", "many/", args=["-r"])
        rc = p.wait(60)
        check(rc == 1 and "20000 files" in p.err and "\n" not in p.err.strip(),
              f"bad: a set of more than 20000 files is refused, naming the limit ({rc}: {p.err.strip()!r})")
    finally:
        m.stop()


def memory() -> None:
    """A set's parts wait in memory (xduc get --memory-stage, a tmpfs), never beside DST, and
    go with the pull. A pull killed before its end leaves its directory there, and the next pull
    there removes it. With --memory-stage none, the parts wait beside DST as before."""
    if not shm:
        print("memory: skipped, no /dev/shm here", flush=True)
        return
    m = Master("memory", ["--pull-pack-size", "1M"])
    top = os.path.join(m.root, "set")
    os.makedirs(os.path.join(top, "d"))
    for n in range(24):
        with open(os.path.join(top, "d" if n % 2 else "", f"f{n}.bin"), "wb") as f:
            f.write(os.urandom(300_000 + n))
    with open(os.path.join(top, "large.bin"), "wb") as f:  # a part of its own, copied from memory
        f.write(os.urandom(17 * MiB + 3))
    want = tree_of(top)
    mine = lambda mem: sorted(n for n in os.listdir(mem) if n.startswith(".xdfs-pull-"))
    try:
        first = Puller(1, "memory", "set/", args=["-r"])
        parts_in = lambda d: [n for q in mine(d) if os.path.isdir(os.path.join(d, q))
                              for n in os.listdir(os.path.join(d, q)) if ".xdfs-set" in n]
        disk = lambda: [n for q in os.listdir(first.dir) if q.startswith(".xdfs-pull-")
                        for n in os.listdir(os.path.join(first.dir, q)) if ".xdfs-set" in n]
        seen = []
        wait_for(lambda: seen.extend(parts_in(first.mem)) or seen or first.proc.poll() is not None)
        on_disk = disk()
        check(bool(seen) and not on_disk, f"memory: a set's part waits in memory, not beside DST ({seen}; {on_disk})")
        first.kill()
        left = mine(first.mem)
        check(len(left) == 1, f"memory: a pull killed before its end leaves its directory in memory ({left})")
        # The next pull there removes it, and its own when it ends.
        second = Puller(2, "memory", "set/", args=["-r"], mem=first.mem)
        rc = second.wait()
        got = tree_of(second.dir)
        check(rc == 0 and got == want, f"memory: a host has the set, identical (exit {rc}: {second.err.strip()[-300:]}; "
                                       f"{len(got)} of {len(want)} files)")
        check(mine(first.mem) == [], f"memory: nothing is left in memory after the next pull ({mine(first.mem)})")
        third = Puller(3, "memory", "set/", args=["-r"], mem="none")
        rc = third.wait()
        got = tree_of(third.dir)
        check(rc == 0 and got == want, f"memory: with --memory-stage none a host has the set, identical (exit {rc}: "
                                       f"{third.err.strip()[-300:]}; {len(got)} of {len(want)} files)")
        # A memory file system that fills up while a host pulls: the parts asked for after that
        # wait beside DST.
        small = os.path.join(shm, "memory", "small")
        os.makedirs(small)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600m", "tmpfs", small]).returncode == 0:
            try:
                fourth = Puller(4, "memory", "set/", args=["-r"], mem=small)
                seen = []
                wait_for(lambda: seen.extend(parts_in(small)) or seen or fourth.proc.poll() is not None)
                st = os.statvfs(small)
                with open(os.path.join(small, "fill"), "wb") as f:
                    # (At once, so that the pull's later parts come after it, however busy the machine.)
                    os.posix_fallocate(f.fileno(), 0, max(st.f_bavail * st.f_frsize - 64 * MiB, 1))
                beside = lambda: [n for q in os.listdir(fourth.dir) if q.startswith(".xdfs-pull-")
                                  for n in os.listdir(os.path.join(fourth.dir, q)) if ".xdfs-set" in n]
                later = []
                wait_for(lambda: later.extend(beside()) or later or fourth.proc.poll() is not None)
                rc = fourth.wait()
                got = tree_of(fourth.dir)
                check(rc == 0 and got == want and bool(seen) and bool(later),
                      f"memory: once the memory file system is full, the parts after wait beside DST (exit {rc}: "
                      f"{fourth.err.strip()[-300:]}; {len(got)} of {len(want)} files; in memory {seen}, beside {later})")
                check(mine(small) == [], f"memory: nothing is left in the full one ({mine(small)})")
            finally:
                subprocess.run(["umount", small])
        else:
            print("memory: the filling memory file system skipped, no mount here", flush=True)
    finally:
        m.stop()


CASES = {"many": many, "kill": kill, "late": late, "corrupt": corrupt, "forge": lambda: corrupt("forge", "forge"),
         "master": master_restart, "set": set_case, "parts": parts,
         "parts-slow": parts_slow, "parts-changed": parts_changed,
         "set-forge": lambda: corrupt("forge", "set-forge", set_=True), "memory": memory, "bad": bad}
try:
    for name in sys.argv[2:] or list(CASES):
        print(f"--- {name}", flush=True)
        CASES[name]()
finally:
    if failures:
        print(f"{len(failures)} check(s) failed; servers' logs in {work}", flush=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    if shm:
        shutil.rmtree(shm, ignore_errors=True)
sys.exit(1 if failures else 0)
