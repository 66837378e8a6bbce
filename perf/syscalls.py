"""System calls of a command, counted by perf stat (the raw_syscalls:sys_enter tracepoint).

Shared by bench.py (its counted runs) and zerocopy.py. perf costs tens of milliseconds of its own
a process and a little every call: a run it counts is not a run to time.
"""

from __future__ import annotations

import shutil
import subprocess

EVENT = "raw_syscalls:sys_enter"


def works() -> bool:
    """perf stat can count EVENT here (the tool is there and the kernel lets it)."""
    if not shutil.which("perf"):
        return False
    r = subprocess.run(["perf", "stat", "-x", ",", "-e", EVENT, "--", "true"], capture_output=True, text=True)
    return r.returncode == 0 and "not supported" not in r.stderr and "<not" not in r.stderr


def wrap(argv: list[str], out: str) -> list[str]:
    """argv under perf stat, which writes the count of it and its children to the file out."""
    return ["perf", "stat", "-x", ",", "-e", EVENT, "-o", out, "--", *argv]


def parse(text: str) -> int | None:
    """The count in perf stat -x, output, or None."""
    for line in text.splitlines():
        fields = line.strip().split(",")
        if len(fields) > 2 and fields[2] == EVENT:
            try:
                return int(fields[0])
            except ValueError:
                return None
    return None


def read(path: str) -> int | None:
    """The count perf stat -x, -o wrote to path, or None."""
    try:
        with open(path) as f:
            return parse(f.read())
    except OSError:
        return None
