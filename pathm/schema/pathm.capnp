# xPathM: path operations and directory trees, carried in xPathM channel events.
# Every request has an id chosen by the client; replies carry it back and may come in any order,
# on any channel. A request may get several replies (a listing comes in chunks); the last one
# has `last` set.
@0xd2a4f0c6b8e13a57;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("xdfs::schema::pathm");

enum EntryType {
  file @0;
  directory @1;
  symlink @2;
  other @3;
}

# One file-system entry: a listing line, a file to create (with its bytes), or one chunk of a
# large file (fileId non-zero, offset where the chunk starts).
struct Entry {
  path @0 :Text;          # relative to the request's path (list) or to the root (put, get)
  type @1 :EntryType;
  size @2 :UInt64;        # whole file size
  mode @3 :UInt32;        # permission bits
  mtimeNs @4 :Int64;      # modification time, nanoseconds since the epoch
  target @5 :Text;        # symlink target
  offset @6 :UInt64;      # chunk: first byte's offset in the file
  data @7 :Data;          # file bytes (whole small file, or one chunk)
  fileId @8 :UInt64;      # chunk of a large file: the sender's id for that file; 0 = whole file
  # put, get and setAttrs: this one entry failed, the others of the request went on. In a reply:
  # why the server could not write or read it. In a put request: the client could not read the
  # file; the server skips the entry.
  code @9 :UInt32;        # 0 = ok, else an xdfs::errc value
  message @10 :Text;      # one line when code != 0
}

enum Op {
  stat @0;        # path
  list @1;        # path, recursive
  mkdir @2;       # path, recursive (= with parents), mode
  remove @3;      # path, recursive (directories and their contents)
  rename @4;      # path -> to
  checksum @5;    # path, offset, length (0 = to the end); with blockSize: the whole file's
                  # manifest digest (docs/manifest.md) for that block size instead
  put @6;         # entries: directories, symlinks, files with their bytes, chunks
  get @7;         # entries: files to read whole (path only), or one range (path, offset, size)
  setAttrs @8;    # entries: mode and mtime to set (directories, after their contents)
}

struct Request {
  id @0 :UInt64;
  op @1 :Op;
  path @2 :Text;
  to @3 :Text;
  recursive @4 :Bool;
  offset @5 :UInt64;
  length @6 :UInt64;
  mode @7 :UInt32;
  entries @8 :List(Entry);
  blockSize @9 :UInt32;   # checksum: non-zero asks for the manifest digest with this block size
}

struct Reply {
  id @0 :UInt64;
  code @1 :UInt32;        # 0 = ok, else an xdfs::errc value
  message @2 :Text;       # one line when code != 0
  last @3 :Bool;          # no more replies follow for this id
  entries @4 :List(Entry);
  algorithm @5 :Text;     # checksum: "sha256", or "xdfs-manifest-1-sha256" for a blockSize
  digest @6 :Data;
}
