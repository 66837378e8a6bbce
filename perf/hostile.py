#!/usr/bin/env python3
"""What hostile peers cost a running xdfsd, and what many real ones do to its memory.

Part 1 (a flood while a real client works): starts xdfsd with its default limits, measures its
resident memory once idle, then holds --unauth unauthenticated connections (spread over source
addresses on 127/8, every other one having sent a few bytes of a preamble) and --stalled
well-formed openings (a real xduc's opening, captured once, then nothing), and while they are
held times a legitimate upload of --upload-mib MiB (xduc -p 4) --runs times, sampling the
server's resident memory every 10 ms.

Part 2 (many real sessions): restarts xdfsd with --memory-limit and runs --sessions concurrent
xduc uploads of --file-mib MiB each with -p --channels, then checks that every file arrived
byte-identical and reads the server's peak resident memory (VmHWM).

Everything runs on loopback, files live in /dev/shm. Prints a table and one JSON line; it judges
nothing (figures on a shared machine are for people to read, not for a test to assert).
  perf/hostile.py --xdfs-bin build-rel/examples
  perf/hostile.py --xdfs-bin build-test/examples --smoke      # a minute's check that it runs
"""
import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time


def rss_kib(pid, field="VmRSS:"):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Sampler:
    """Samples a process's resident memory every 10 ms while running."""

    def __init__(self, pid):
        self.pid, self.peak, self.stop = pid, 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, rss_kib(self.pid))
            time.sleep(0.01)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


class Server:
    def __init__(self, binary, root, state, extra):
        self.port_file = os.path.join(state, "port")
        if os.path.exists(self.port_file):
            os.unlink(self.port_file)
        self.log = open(os.path.join(state, "xdfsd.log"), "ab")
        self.proc = subprocess.Popen([binary, "--root", root, "--listen", "127.0.0.1:0", "--port-file", self.port_file,
                                      "--state-dir", state] + extra, stdout=self.log, stderr=self.log,
                                     stdin=subprocess.DEVNULL)
        for _ in range(500):
            if os.path.exists(self.port_file):
                with open(self.port_file) as f:
                    text = f.read().strip()
                if text:
                    self.port = int(text)
                    return
            time.sleep(0.01)
        raise SystemExit("xdfsd did not start; see " + self.log.name)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def xduc(binary, env, args, timeout=600):
    t0 = time.monotonic()
    r = subprocess.run([binary] + args, env=env, capture_output=True, text=True, timeout=timeout)
    return r, time.monotonic() - t0


def capture_opening(xduc_bin, env, src):
    """A real client's first bytes (preamble, NEGO frame header, opening), read by a listener
    that then hangs up."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    port = lst.getsockname()[1]
    p = subprocess.Popen([xduc_bin, "-q", "--known-hosts", os.path.join(env["XDFS_CONFIG_DIR"], "kh-capture"), src,
                          f"xdfs://127.0.0.1:{port}/x"], env=env, stderr=subprocess.DEVNULL)
    conn, _ = lst.accept()
    data = b""
    while len(data) < 32:
        data += conn.recv(32 - len(data))
    length = struct.unpack_from("<I", data, 8 + 4)[0]
    while len(data) < 32 + length:
        data += conn.recv(32 + length - len(data))
    conn.close()
    lst.close()
    p.wait(30)
    return data[:32 + length]


def hold(port, count, start_net, payload=None):
    """count connections from 127.<start_net>.x.y, each sending payload (every other one, for a
    bare preamble prefix) and then nothing."""
    socks = []
    for i in range(count):
        s = socket.socket()
        s.bind((f"127.{start_net + i // 60000}.{1 + (i // 250) % 240}.{1 + i % 250}", 0))
        s.connect(("127.0.0.1", port))
        if payload is not None:
            s.sendall(payload)
        elif i % 2:
            s.sendall(b"xDF")
        socks.append(s)
    return socks


def dropped(socks):
    """How many of them the server has closed."""
    n = 0
    for s in socks:
        s.setblocking(False)
        try:
            if s.recv(1 << 16) == b"":
                n += 1
        except BlockingIOError:
            pass
        except OSError:
            n += 1
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--xdfs-bin", required=True, help="directory holding xdfsd and xduc")
    ap.add_argument("--unauth", type=int, default=1000)
    ap.add_argument("--stalled", type=int, default=200)
    ap.add_argument("--upload-mib", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--channels", type=int, default=8)
    ap.add_argument("--file-mib", type=int, default=16)
    ap.add_argument("--memory-limit", default="1G")
    ap.add_argument("--protect", default="private")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks that the script runs")
    a = ap.parse_args()
    if a.smoke:
        a.unauth, a.stalled, a.upload_mib, a.runs, a.sessions, a.channels, a.file_mib = 60, 20, 4, 1, 6, 2, 1
    xdfsd = os.path.join(a.xdfs_bin, "xdfsd")
    xduc_bin = os.path.join(a.xdfs_bin, "xduc")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8192)), hard))

    work = tempfile.mkdtemp(prefix="xdfs-hostile-", dir="/dev/shm")
    try:
        root, state, cfg, src = (os.path.join(work, d) for d in ("root", "state", "config", "src"))
        for d in (root, state, cfg, src):
            os.makedirs(d)
        env = dict(os.environ, XDFS_CONFIG_DIR=cfg)
        pub = subprocess.run([xduc_bin, "keygen"], env=env, capture_output=True, text=True, check=True).stdout.strip()
        with open(os.path.join(state, "authorized_keys"), "w") as f:
            f.write(f"{pub} rw sessions=100000 channels=1000000\n")
        up = os.path.join(src, "upload")
        with open(up, "wb") as f:
            f.write(os.urandom(a.upload_mib << 20))

        # Part 1.
        srv = Server(xdfsd, root, state, ["--handshake-timeout", "120"])
        url = f"xdfs://127.0.0.1:{srv.port}/"
        warm, _ = xduc(xduc_bin, env, ["-q", "-p", "4", up, url + "warm"])
        if warm.returncode != 0:
            raise SystemExit("warm-up upload failed: " + warm.stderr)
        time.sleep(0.5)
        idle = rss_kib(srv.proc.pid)
        opening = capture_opening(xduc_bin, env, up)
        t0 = time.monotonic()
        unauth = hold(srv.port, a.unauth, 1)
        stalled = hold(srv.port, a.stalled, 201, opening)
        opened = time.monotonic() - t0
        time.sleep(1.0)
        held_rss = rss_kib(srv.proc.pid)
        times, peaks, ok = [], [], 0
        for i in range(a.runs):
            with Sampler(srv.proc.pid) as s:
                r, wall = xduc(xduc_bin, env, ["-q", "-p", "4", "--json", up, url + f"up{i}"])
            if r.returncode == 0 and open(up, "rb").read() == open(os.path.join(root, f"up{i}"), "rb").read():
                ok += 1
                times.append(wall)
            else:
                print(f"upload {i} failed: {r.stderr.strip()}", file=sys.stderr)
            peaks.append(s.peak)
            os.unlink(os.path.join(root, f"up{i}")) if os.path.exists(os.path.join(root, f"up{i}")) else None
        gone_unauth, gone_stalled = dropped(unauth), dropped(stalled)
        for s in unauth + stalled:
            s.close()
        srv.stop()

        # Part 2.
        limit = a.memory_limit
        srv = Server(xdfsd, root, state, ["--memory-limit", limit, "--max-sessions", str(a.sessions + 16),
                                          "--max-channels", str(max(256, a.channels))])
        url = f"xdfs://127.0.0.1:{srv.port}/"
        base = os.urandom(a.file_mib << 20)
        names = []
        for i in range(a.sessions):
            n = os.path.join(src, f"s{i}")
            with open(n, "wb") as f:
                f.write(struct.pack("<Q", i) + base[8:])
            names.append(n)
        # First contact pins the key once, so the concurrent ones do not race on known_hosts.
        xduc(xduc_bin, env, ["-q", names[0], url + "pin"])
        with Sampler(srv.proc.pid) as s:
            t0 = time.monotonic()
            procs = [subprocess.Popen([xduc_bin, "-q", "-p", str(a.channels), "--protect", a.protect, n, url + f"m{i}"],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                     for i, n in enumerate(names)]
            errors = [p.communicate()[1].strip() for p in procs]
            many_wall = time.monotonic() - t0
        statuses = [p.returncode for p in procs]
        identical = sum(1 for i, n in enumerate(names) if os.path.exists(os.path.join(root, f"m{i}"))
                        and open(n, "rb").read() == open(os.path.join(root, f"m{i}"), "rb").read())
        hwm = rss_kib(srv.proc.pid, "VmHWM:")
        srv.stop()
        with open(os.path.join(state, "xdfsd.log")) as f:
            log = f.read()

        mib = lambda k: k / 1024.0
        limit_mib = {"K": 1 / 1024, "M": 1, "G": 1024}.get(limit[-1].upper(), 1 / (1 << 20)) * float(limit.rstrip("KMGkmg"))
        print("== part 1: a flood while a real client works")
        print(f"held: {a.unauth} unauthenticated connections and {a.stalled} stalled openings "
              f"(opened in {opened:.2f} s); the server dropped {gone_unauth} and {gone_stalled} of them "
              f"(its pending caps: 1024 server-wide, 64 per address)")
        print(f"server resident memory: idle {mib(idle):.1f} MiB, while held {mib(held_rss):.1f} MiB "
              f"(+{mib(held_rss - idle):.1f}), peak during the uploads {mib(max(peaks)):.1f} MiB "
              f"(+{mib(max(peaks) - idle):.1f})")
        if times:
            print(f"{a.upload_mib} MiB upload (xduc -p 4) while held: {ok}/{a.runs} ok, median {statistics.median(times):.3f} s "
                  f"(min {min(times):.3f}, max {max(times):.3f})")
        print("== part 2: many real sessions")
        print(f"{a.sessions} concurrent uploads of {a.file_mib} MiB with -p {a.channels} ({a.protect}): "
              f"{statuses.count(0)} ok, {identical} byte-identical, {many_wall:.2f} s")
        print(f"server peak resident memory {mib(hwm):.1f} MiB against --memory-limit {limit} ({limit_mib:.0f} MiB)")
        failed = [e for e in errors if e]
        if failed:
            print(f"{len(failed)} failed, e.g.: {failed[0]}")
        print(json.dumps({
            "unauth": a.unauth, "stalled": a.stalled, "dropped_unauth": gone_unauth, "dropped_stalled": gone_stalled,
            "idle_rss_kib": idle, "held_rss_kib": held_rss, "upload_peak_rss_kib": max(peaks),
            "upload_mib": a.upload_mib, "upload_ok": ok, "upload_runs": a.runs,
            "upload_seconds": times, "sessions": a.sessions, "channels": a.channels, "file_mib": a.file_mib,
            "sessions_ok": statuses.count(0), "identical": identical, "sessions_seconds": many_wall,
            "peak_rss_kib": hwm, "memory_limit": limit, "memory_limit_refusals": log.count("memory for"),
        }))
        return 0 if ok == a.runs and identical == a.sessions else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
