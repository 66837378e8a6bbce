#!/usr/bin/env python3
"""Writes the hand-made seeds of fuzz_session into tests/fuzz/corpus/fuzz_session: whole, valid
sessions in each mode and protection level, so that the fuzzer starts from inputs that reach
deep into the engines (see the input format at the top of fuzz_session.cpp)."""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus", "fuzz_session")

XFTSMU, XFTSMD, XPATHM, EOFR, EOFT, NOOP, ACK, EXCEPTION = 3, 4, 5, 6, 7, 8, 11, 12
UPLOAD, DOWNLOAD, PATH, MEMORY = 0, 1, 2, 3


def head(kind, protect, two, size, block_shift=0):
    cfg = kind | (protect << 2) | (0x20 if two else 0)
    return bytes([cfg]) + struct.pack("<Q", size) + bytes([62, block_shift])


def rec(ch, ev, payload=b"", off=0, flags=0):
    return bytes([ch, ev, flags]) + struct.pack("<HQ", len(payload), off) + payload


NAMES = ["", ".", "f", "big", "d", "d/g", "d/e", "new", "d/new", "out", "out/passwd", "../x", "/etc/x",
         "d/../f", "a/b/c", "f/x", "new/deeper/file"]


def name(n, extra=b""):
    """A name as make_request reads it: a dictionary index, then maybe bytes appended."""
    if not extra:
        return bytes([NAMES.index(n), 1])
    return bytes([NAMES.index(n), 0, len(extra)]) + extra


def request(op, path="f", to="new", recursive=0, offset=b"\x00", length=b"\x00", entries=()):
    body = struct.pack("<H", 7) + bytes([op]) + name(path) + name(to) + bytes([recursive])
    body += offset + length + struct.pack("<H", 0o644) + bytes([len(entries)])
    for e in entries:
        body += e
    return body


def entry(path, typ=0, size=b"\x02\x10\x00", data=b"", file_id=0, target="f", extra=b""):
    e = name(path, extra) + bytes([typ]) + size + struct.pack("<H", 0o644) + struct.pack("<Q", 1600000000000000000)
    e += name(target) + b"\x00" + bytes([file_id]) + struct.pack("<H", len(data)) + data + b"\x01"
    return e


seeds = {}
data = bytes(range(256)) * 16  # 4096 bytes
for protect in range(3):
    s = head(UPLOAD, protect, False, 10000)
    s += rec(0, XFTSMU, data, 0) + rec(0, XFTSMU, data, 4096) + rec(0, XFTSMU, data[:1808], 8192) + rec(0, EOFR)
    seeds[f"upload-p{protect}"] = s
    s = head(UPLOAD, protect, True, 8192)
    s += rec(1, XFTSMU, data, 4096) + rec(0, XFTSMU, data, 0) + rec(0, EOFR) + rec(1, EOFR)
    seeds[f"upload2-p{protect}"] = s
    s = head(DOWNLOAD, protect, False, 0) + rec(0, ACK, off=4096) + rec(0, ACK, off=40000) + rec(0, NOOP)
    seeds[f"download-p{protect}"] = s
    s = head(MEMORY, protect, True, 3 * 4096) + rec(0, XFTSMU, data, 0) + rec(1, XFTSMU, data, 8192)
    s += rec(0, XFTSMU, data, 4096) + rec(0, EOFR) + rec(1, EOFR)
    seeds[f"memory-p{protect}"] = s
    s = head(PATH, protect, protect == 1, 0)
    s += rec(0, XPATHM, request(0, "f"), flags=4)                       # stat
    s += rec(0, XPATHM, request(1, "d", recursive=1), flags=4)          # list
    s += rec(0, XPATHM, request(2, "new"), flags=4)                     # mkdir
    s += rec(0, XPATHM, request(5, "big"), flags=4)                     # checksum
    s += rec(0, XPATHM, request(6, entries=[entry("new", extra=b"/x", size=b"\x01\x05", data=b"hello"),
                                            entry("d/e", extra=b"/y", typ=1),
                                            entry("d", extra=b"/l", typ=2, target="f")]), flags=4)   # put
    s += rec(0, XPATHM, request(6, entries=[entry("big", extra=b"2", size=b"\x02\x00\x20", data=data, file_id=1)]), flags=4)
    s += rec(0, XPATHM, request(7, entries=[entry("big"), entry("f")]), flags=4)          # get
    s += rec(0, XPATHM, request(8, entries=[entry("d", typ=1)]), flags=4)                # setattrs
    s += rec(0, XPATHM, request(4, "f", "d/new"), flags=4)            # rename
    s += rec(0, XPATHM, request(3, "d", recursive=1), flags=4)          # remove
    s += rec(0, EOFT)
    seeds[f"path-p{protect}"] = s

os.makedirs(OUT, exist_ok=True)
for n, s in seeds.items():
    with open(os.path.join(OUT, "seed-" + n), "wb") as f:
        f.write(s)
print(f"{len(seeds)} seeds in {OUT}")
