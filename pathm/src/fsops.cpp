#include "xdfs/pathm/fsops.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <botan/hash.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <vector>

#include "xdfs/ranges.hpp"
#include "xdfs/types.hpp"
#include "xdfs/manifest.hpp"
#include "xdfs/wire.hpp"

namespace xdfs::pathm {
namespace {

using files::Fd;
using files::temp_name;

std::string quoted(const std::string& p) { return "'" + p + "'"; }

std::int64_t mtime_of(const struct stat& st) {
  return static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

timespec to_timespec(std::int64_t ns) {
  timespec t{};
  t.tv_sec = ns / 1000000000;
  t.tv_nsec = ns % 1000000000;
  if (t.tv_nsec < 0) {
    t.tv_nsec += 1000000000;
    t.tv_sec -= 1;
  }
  return t;
}

Type type_of(mode_t m) {
  if (S_ISREG(m)) return Type::file;
  if (S_ISDIR(m)) return Type::directory;
  if (S_ISLNK(m)) return Type::symlink;
  return Type::other;
}

// Permission bits we set: set-user-ID and set-group-ID never travel (a peer must not be able to
// make a privileged executable appear).
mode_t safe_mode(std::uint32_t m) { return static_cast<mode_t>(m & 01777); }

void fill_entry(Entry& e, const struct stat& st) {
  e.type = type_of(st.st_mode);
  e.size = e.type == Type::file || e.type == Type::symlink ? static_cast<std::uint64_t>(st.st_size) : 0;
  e.mode = st.st_mode & 07777;
  e.mtime_ns = mtime_of(st);
}

Status read_link(int dir, const std::string& name, const std::string& shown, std::string& target) {
  char buf[wire::max_path_bytes + 1];
  const ssize_t n = ::readlinkat(dir, name.c_str(), buf, sizeof buf);
  if (n < 0) return Status::from_errno(errno, "readlink " + quoted(shown));
  if (static_cast<std::size_t>(n) > wire::max_path_bytes)
    return {errc::bad_argument, "symlink " + quoted(shown) + " has a target longer than 4096 bytes"};
  target.assign(buf, static_cast<std::size_t>(n));
  return Status::ok();
}

std::string join(const std::string& dir, const std::string& name) {
  if (dir.empty() || dir == ".") return name;
  return dir + "/" + name;
}

// Opens the directory containing `path` and returns the last component. "." and "" have none.
Status open_parent(int root, const std::string& path, Fd& dir, std::string& name) {
  auto [parent, last] = files::split_parent(path);
  if (last.empty() || last == ".")
    return {errc::bad_argument, quoted(path) + " names the root itself"};
  name = last;
  return files::open_beneath(root, parent, O_PATH | O_DIRECTORY, 0, dir);
}

Status stopped(const std::string& what) { return {errc::cancelled, what + " stopped: the session ended"}; }

// A recursive remove holds, per level it is in, one directory stream and the name it is in: what
// a peer can make it hold is bounded by the depth limit, not by the shape of the tree the peer
// built (renames nest a tree arbitrarily deep) or the size of its directories.
constexpr int max_remove_depth = 128;
// Passes over one directory: the first removes what it reads as it reads it; another from the
// start catches what that one may have missed. A directory that still has entries after this
// many is being filled as fast as it is emptied.
constexpr int max_remove_passes = 8;

std::string shown_path(const std::string& top, const std::vector<std::string>& below) {
  std::string s = top;
  for (const auto& n : below) s += "/" + n;
  return s;
}

// Removes name (under the open directory dir) and everything below it. `below` is the path of
// name under top, component by component (for messages only).
Status remove_tree(int dir, const std::string& name, const std::string& top, std::vector<std::string>& below,
                   Stop stop) {
  if (stop && stop->load(std::memory_order_relaxed)) return stopped("remove " + quoted(top));
  if (::unlinkat(dir, name.c_str(), 0) == 0) return Status::ok();
  if (errno == EPERM) {  // a directory (Linux answers unlink of one so), or a file that may not go
    struct stat st {};
    if (::fstatat(dir, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode))
      return Status::from_errno(EPERM, "remove " + quoted(shown_path(top, below)));
  } else if (errno != EISDIR) {
    return Status::from_errno(errno, "remove " + quoted(shown_path(top, below)));
  }
  if (below.size() >= max_remove_depth)
    return {errc::limit_exceeded, quoted(top) + " is nested more than " + std::to_string(max_remove_depth) +
                                      " levels deep: remove its deepest parts first"};
  int fd = ::openat(dir, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return Status::from_errno(errno, "open " + quoted(shown_path(top, below)));
  DIR* d = ::fdopendir(fd);
  if (!d) {
    ::close(fd);
    return Status::from_errno(errno, "open " + quoted(shown_path(top, below)));
  }
  Status st;
  bool removed = true;
  for (int pass = 0; st && removed; ++pass) {
    if (pass == max_remove_passes) {
      st = {errc::io_error, quoted(shown_path(top, below)) + " kept getting new entries while it was removed"};
      break;
    }
    removed = false;
    ::rewinddir(d);
    while (auto* ent = ::readdir(d)) {
      const char* n = ent->d_name;
      if (std::strcmp(n, ".") == 0 || std::strcmp(n, "..") == 0) continue;
      removed = true;
      const std::string child(n);  // its own copy: `below` grows (and moves) in the call
      below.push_back(child);
      st = remove_tree(::dirfd(d), child, top, below, stop);
      below.pop_back();
      if (!st) break;
    }
  }
  ::closedir(d);
  if (!st) return st;
  if (::unlinkat(dir, name.c_str(), AT_REMOVEDIR) != 0)
    return Status::from_errno(errno, "remove " + quoted(shown_path(top, below)));
  return Status::ok();
}

std::atomic<std::uint64_t> writer_ids{1};

}  // namespace

Status check_path(const std::string& path) {
  if (path.empty() || path == ".") return Status::ok();
  return files::check_relative_path(path);
}

std::string normal(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  while (p.size() > 2 && p[0] == '.' && p[1] == '/') p.erase(0, 2);
  return p;
}

Status stat_entry(int root, const std::string& raw, Entry& out) {
  const std::string path = normal(raw);
  if (auto s = check_path(path); !s) return s;
  struct stat st {};
  out.path = path.empty() ? "." : path;
  if (path.empty() || path == ".") {
    if (::fstat(root, &st) != 0) return Status::from_errno(errno, "stat the root");
    fill_entry(out, st);
    return Status::ok();
  }
  Fd dir;
  std::string name;
  if (auto s = open_parent(root, path, dir, name); !s) return s;
  if (::fstatat(dir.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0)
    return Status::from_errno(errno, "stat " + quoted(path));
  fill_entry(out, st);
  if (out.type == Type::symlink) return read_link(dir.get(), name, path, out.target);
  return Status::ok();
}

// A recursive listing keeps the names of the directories it has still to read: at most this
// many bytes of them (a directory of a million subdirectories with 60-byte paths fits).
constexpr std::size_t max_list_pending = std::size_t(64) << 20;

Status list_dir(int root, const std::string& raw, bool recursive, bool follow, std::size_t chunk,
                const std::function<bool(std::vector<Entry>&)>& emit, Stop stop,
                const std::function<void(const std::string&, const Status&)>& unreadable) {
  const std::string path = normal(raw);
  if (auto s = check_path(path); !s) return s;
  std::vector<std::string> todo{""};  // directories still to read, relative to path
  std::size_t todo_bytes = 0;         // their names' bytes, bounded: a peer shapes the tree
  std::set<std::pair<dev_t, ino_t>> seen;  // with follow: directories met, so a loop ends
  std::vector<Entry> out;
  out.reserve(std::min<std::size_t>(chunk, 1024));
  const std::string base = path.empty() ? "." : path;
  while (!todo.empty()) {
    const std::string rel = std::move(todo.back());
    todo.pop_back();
    todo_bytes -= rel.size();
    Fd fd;
    const std::string where = rel.empty() ? base : join(base, rel);
    if (auto s = files::open_beneath(root, where, O_RDONLY | O_DIRECTORY, 0, fd); !s) {
      if (!rel.empty() && unreadable) {  // below the top: the rest of the tree goes on without it
        unreadable(rel, s);
        continue;
      }
      if (s.code == errc::io_error || s.message.find("Not a directory") != std::string::npos)
        return {errc::not_regular_file, quoted(where) + " is not a directory"};
      return s;
    }
    if (follow) {
      struct stat st {};
      if (::fstat(fd.get(), &st) == 0 && !seen.insert({st.st_dev, st.st_ino}).second) continue;
    }
    DIR* d = ::fdopendir(fd.get());
    if (!d) return Status::from_errno(errno, "list " + quoted(where));
    fd.release();
    std::vector<std::string> subdirs;
    Status st;
    errno = 0;
    while (auto* ent = ::readdir(d)) {
      if (stop && stop->load(std::memory_order_relaxed)) {
        st = stopped("list " + quoted(base));
        break;
      }
      const char* n = ent->d_name;
      if (std::strcmp(n, ".") == 0 || std::strcmp(n, "..") == 0) continue;
      Entry e;
      e.path = join(rel, n);
      if (e.path.size() > wire::max_path_bytes) {
        st = {errc::limit_exceeded, "a path below " + quoted(where) + " is longer than 4096 bytes"};
        break;
      }
      struct stat sb {};
      int flags = follow ? 0 : AT_SYMLINK_NOFOLLOW;
      if (::fstatat(::dirfd(d), n, &sb, flags) != 0 && (!follow || ::fstatat(::dirfd(d), n, &sb, AT_SYMLINK_NOFOLLOW) != 0)) {
        if (errno == ENOENT) continue;  // removed while we read
        st = Status::from_errno(errno, "stat " + quoted(join(where, n)));
        break;
      }
      fill_entry(e, sb);
      if (e.type == Type::symlink) {
        if (st = read_link(::dirfd(d), n, join(where, n), e.target); !st) break;
      }
      if (recursive && e.type == Type::directory) {
        if (todo_bytes + e.path.size() > max_list_pending) {
          st = {errc::limit_exceeded, "more than " + std::to_string(max_list_pending >> 20) +
                                          " MiB of directory names wait to be listed below " + quoted(base) +
                                          ": list its parts one at a time"};
          break;
        }
        todo_bytes += e.path.size();
        subdirs.push_back(e.path);
      }
      out.push_back(std::move(e));
      if (out.size() >= chunk) {
        if (!emit(out)) {
          ::closedir(d);
          return Status::ok();
        }
        out.clear();
      }
    }
    ::closedir(d);
    if (!st) return st;
    // Read children in name order, first child on top of the stack.
    std::sort(subdirs.begin(), subdirs.end(), std::greater<>());
    for (auto& s : subdirs) todo.push_back(std::move(s));
  }
  emit(out);
  return Status::ok();
}

Status make_dir(int root, const std::string& raw, bool parents, std::uint32_t mode) {
  const std::string path = normal(raw);
  if (auto s = check_path(path); !s) return s;
  if (path.empty() || path == ".") return parents ? Status::ok() : Status{errc::bad_argument, "the root exists"};
  const mode_t m = mode ? safe_mode(mode) : 0777;
  if (parents) {
    std::size_t pos = 0;
    while ((pos = path.find('/', pos + 1)) != std::string::npos) {
      const std::string prefix = path.substr(0, pos);
      if (prefix.empty() || prefix.back() == '/') continue;
      Fd dir;
      std::string name;
      if (auto s = open_parent(root, prefix, dir, name); !s) return s;
      if (::mkdirat(dir.get(), name.c_str(), 0777) != 0 && errno != EEXIST)
        return Status::from_errno(errno, "mkdir " + quoted(prefix));
    }
  }
  Fd dir;
  std::string name;
  if (auto s = open_parent(root, path, dir, name); !s) return s;
  if (::mkdirat(dir.get(), name.c_str(), m) == 0) return Status::ok();
  const int err = errno;
  struct stat st {};
  if (err == EEXIST && parents && ::fstatat(dir.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode))
    return Status::ok();
  return Status::from_errno(err, "mkdir " + quoted(path));
}

Status remove_path(int root, const std::string& raw, bool recursive, Stop stop) {
  const std::string path = normal(raw);
  if (auto s = check_path(path); !s) return s;
  Fd dir;
  std::string name;
  if (auto s = open_parent(root, path, dir, name); !s) return s;
  struct stat st {};
  if (::fstatat(dir.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0)
    return Status::from_errno(errno, "remove " + quoted(path));
  if (!S_ISDIR(st.st_mode)) {
    if (::unlinkat(dir.get(), name.c_str(), 0) != 0) return Status::from_errno(errno, "remove " + quoted(path));
    return Status::ok();
  }
  if (!recursive) {
    if (::unlinkat(dir.get(), name.c_str(), AT_REMOVEDIR) == 0) return Status::ok();
    if (errno == ENOTEMPTY || errno == EEXIST)
      return {errc::is_directory, quoted(path) + " is a directory that is not empty (remove it recursively)"};
    return Status::from_errno(errno, "remove " + quoted(path));
  }
  Fd real;  // O_PATH descriptors cannot be read: reopen the parent for the walk
  auto [parent, last] = files::split_parent(path);
  if (auto s = files::open_beneath(root, parent, O_RDONLY | O_DIRECTORY, 0, real); !s) return s;
  std::vector<std::string> below;
  return remove_tree(real.get(), name, path, below, stop);
}

Status rename_path(int root, const std::string& from_raw, const std::string& to_raw) {
  const std::string from = normal(from_raw), to = normal(to_raw);
  if (auto s = check_path(from); !s) return s;
  if (auto s = check_path(to); !s) return s;
  Fd a, b;
  std::string na, nb;
  if (auto s = open_parent(root, from, a, na); !s) return s;
  if (auto s = open_parent(root, to, b, nb); !s) return s;
  if (::renameat(a.get(), na.c_str(), b.get(), nb.c_str()) != 0)
    return Status::from_errno(errno, "rename " + quoted(from) + " to " + quoted(to));
  return Status::ok();
}

Status open_file(int root, const std::string& raw, Fd& fd, Entry& e) {
  const std::string path = normal(raw);
  if (auto s = check_path(path); !s) return s;
  if (auto s = files::open_beneath(root, path.empty() ? "." : path, O_RDONLY | O_NONBLOCK | O_NOCTTY, 0, fd); !s) return s;
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return Status::from_errno(errno, "stat " + quoted(path));
  if (S_ISDIR(st.st_mode)) return {errc::is_directory, quoted(path) + " is a directory"};
  if (!S_ISREG(st.st_mode)) return {errc::not_regular_file, quoted(path) + " is not a regular file"};
  e.path = path;
  fill_entry(e, st);
  return Status::ok();
}

Status read_exact(int fd, std::span<std::uint8_t> dst, std::uint64_t offset, const std::string& path) {
  std::size_t done = 0;
  while (done < dst.size()) {
    const ssize_t n = ::pread(fd, dst.data() + done, dst.size() - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::from_errno(errno, "read " + quoted(path));
    }
    if (n == 0) return {errc::size_mismatch, quoted(path) + " got shorter while it was being read"};
    done += static_cast<std::size_t>(n);
  }
  return Status::ok();
}

Status copy_exact(int from, std::uint64_t from_offset, int to, std::uint64_t to_offset, std::uint64_t n,
                  const std::string& from_name, const std::string& to_name) {
  constexpr auto off_max = static_cast<std::uint64_t>(std::numeric_limits<off_t>::max());
  if (from_offset > off_max || to_offset > off_max || n > off_max - std::max(from_offset, to_offset))
    return {errc::bad_argument, "a copy into " + quoted(to_name) + " past the largest offset"};
  // Where it writes must be where it was told: not an appending descriptor (pwrite would append),
  // not a range of the same file it reads (the buffer would copy over what it has yet to read).
  const int flags = ::fcntl(to, F_GETFL);
  if (flags < 0) return Status::from_errno(errno, "write " + quoted(to_name));
  if (flags & O_APPEND) return {errc::bad_argument, "a copy into " + quoted(to_name) + " opened for appending"};
  struct stat a {}, b {};
  if (n && ::fstat(from, &a) == 0 && ::fstat(to, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino &&
      from_offset < to_offset + n && to_offset < from_offset + n)
    return {errc::bad_argument, "a copy of " + quoted(from_name) + " onto itself"};
  auto in = static_cast<off_t>(from_offset), out = static_cast<off_t>(to_offset);
  std::uint64_t left = n;
  // In the kernel first: page cache to page cache, or the file system's own copy.
  while (left) {
    const ssize_t c = ::copy_file_range(from, &in, to, &out, static_cast<std::size_t>(std::min<std::uint64_t>(left, 1u << 30)), 0);
    if (c < 0 && errno == EINTR) continue;
    if (c <= 0) {
      // Where the file systems cannot (EXDEV, EINVAL, EOPNOTSUPP, ENOSYS...), or at what looks
      // like the source's end: the buffer decides, and tells an error from a short source.
      if (c < 0 && (errno == EIO || errno == ENOSPC || errno == EDQUOT || errno == EFBIG))
        return Status::from_errno(errno, "copy " + quoted(from_name) + " into " + quoted(to_name));
      break;
    }
    left -= static_cast<std::uint64_t>(c);
  }
  if (!left) return Status::ok();
  // Where copy_file_range will not join the two (a file on tmpfs into one on a disk): through a
  // pipe, which holds the source's pages themselves, so that each byte is copied once, into the
  // destination's page cache. What the pipe still holds when a write fails is read again below.
  if (int p[2]; ::pipe2(p, O_CLOEXEC) == 0) {
    Fd pr(p[0]), pw(p[1]);
    (void)::fcntl(pw.get(), F_SETPIPE_SZ, 1 << 20);  // (else its default: more calls, same copy)
    while (left) {
      const ssize_t got = ::splice(from, &in, pw.get(), nullptr, static_cast<std::size_t>(std::min<std::uint64_t>(left, 1u << 20)), 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) break;  // the source's end, or a file system that cannot: the buffer decides
      auto held = static_cast<std::size_t>(got);
      int failed = 0;
      while (held) {
        const ssize_t put = ::splice(pr.get(), nullptr, to, &out, held, 0);
        if (put < 0 && errno == EINTR) continue;
        if (put <= 0) {
          failed = put < 0 ? errno : EIO;
          break;
        }
        held -= static_cast<std::size_t>(put);
      }
      left -= static_cast<std::uint64_t>(got) - held;
      if (!held) continue;
      if (failed == ENOSPC || failed == EDQUOT || failed == EFBIG || failed == EIO)
        return Status::from_errno(failed, "write " + quoted(to_name));
      in -= static_cast<off_t>(held);
      break;
    }
  }
  if (!left) return Status::ok();
  std::vector<std::uint8_t> buf(static_cast<std::size_t>(std::min<std::uint64_t>(left, 1u << 20)));
  while (left) {
    const auto want = static_cast<std::size_t>(std::min<std::uint64_t>(left, buf.size()));
    if (auto s = read_exact(from, std::span(buf.data(), want), static_cast<std::uint64_t>(in), from_name); !s) return s;
    std::size_t done = 0;
    while (done < want) {
      const ssize_t w = ::pwrite(to, buf.data() + done, want - done, out + static_cast<off_t>(done));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return Status::from_errno(w < 0 ? errno : EIO, "write " + quoted(to_name));
      done += static_cast<std::size_t>(w);
    }
    in += static_cast<off_t>(want);
    out += static_cast<off_t>(want);
    left -= want;
  }
  return Status::ok();
}

Status checksum(int root, const std::string& path, std::uint64_t offset, std::uint64_t length,
                std::vector<std::uint8_t>& digest, Stop stop) {
  Fd fd;
  Entry e;
  if (auto s = open_file(root, path, fd, e); !s) return s;
  if (offset > e.size) return {errc::bad_argument, "offset " + std::to_string(offset) + " is past the end of " + quoted(path)};
  std::uint64_t left = length == 0 ? e.size - offset : std::min(length, e.size - offset);
  auto hash = Botan::HashFunction::create_or_throw("SHA-256");
  // Up to 1 MiB at a time, and no more than the range: a tree's --checksum asks this for many
  // small files, and each one zeroing a whole megabyte cost more than hashing it.
  std::vector<std::uint8_t> buf(static_cast<std::size_t>(std::min<std::uint64_t>(left, 1 << 20)));
  while (left > 0) {
    if (stop && stop->load(std::memory_order_relaxed)) return stopped("checksum of " + quoted(path));
    auto n = static_cast<std::size_t>(std::min<std::uint64_t>(left, buf.size()));
    if (auto s = read_exact(fd.get(), {buf.data(), n}, offset, path); !s) return s;
    hash->update(buf.data(), n);
    offset += n;
    left -= n;
  }
  auto d = hash->final();
  digest.assign(d.begin(), d.end());
  return Status::ok();
}

Status manifest_digest(int root, const std::string& path, std::uint32_t block_size, std::vector<std::uint8_t>& digest,
                       Stop stop) {
  if (block_size < wire::min_block_size || block_size > wire::max_block_size)
    return {errc::bad_argument, "block size " + std::to_string(block_size) + " is outside " +
                                    std::to_string(wire::min_block_size) + ".." + std::to_string(wire::max_block_size)};
  Fd fd;
  Entry e;
  if (auto s = open_file(root, path, fd, e); !s) return s;
  const auto r = manifest::of_file(fd.get(), e.size, block_size, stop);
  if (r.code == errc::cancelled) return stopped("manifest of " + quoted(path));
  if (r.code != errc::ok) return {r.code, quoted(path) + ": " + r.message};
  digest.assign(r.digest.begin(), r.digest.end());
  return Status::ok();
}

// ---- TreeWriter ----

struct TreeWriter::Partial {
  std::uint64_t id = 0;
  Fd dir;
  Fd fd;
  std::string name, temp, path;
  std::uint64_t size = 0;
  std::uint32_t mode = 0;
  std::int64_t mtime = 0;
  RangeSet seen;  // chunks that came (grows with them, not with the size announced)
  std::uint64_t written = 0;
  bool failed = false;
  // Buffered writes to one file serialise on its inode lock anyway: a worker waiting here sleeps
  // instead of spinning on that lock (which cost an eighth of the server's CPU on a 1 GiB file).
  std::mutex write_mu;
};

namespace {

// Each worker thread remembers the last directory it wrote into: the files of a tree arrive
// grouped by directory, so most files skip resolving their parent again.
struct ParentCache {
  std::uint64_t writer = 0;
  std::string path;
  Fd fd;
};
thread_local ParentCache parent_cache;

Status finish_file(int fd, const std::string& path, std::uint32_t mode, mode_t umask, std::int64_t mtime, bool sync) {
  if (::fchmod(fd, safe_mode(mode) & ~umask) != 0) return Status::from_errno(errno, "chmod " + quoted(path));
  const timespec ts[2] = {to_timespec(mtime), to_timespec(mtime)};
  if (::futimens(fd, ts) != 0) return Status::from_errno(errno, "set the mtime of " + quoted(path));
  if (sync && ::fdatasync(fd) != 0) return Status::from_errno(errno, "fdatasync " + quoted(path));
  return Status::ok();
}

Status write_all(int fd, std::span<const std::uint8_t> d, std::uint64_t offset, const std::string& path) {
  std::size_t done = 0;
  while (done < d.size()) {
    const ssize_t n = ::pwrite(fd, d.data() + done, d.size() - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::from_errno(n < 0 ? errno : EIO, "write " + quoted(path));
    done += static_cast<std::size_t>(n);
  }
  return Status::ok();
}

// A file's rename into `path` failed with err (a directory there: is_directory).
Status rename_failed(int err, const std::string& path) {
  auto s = Status::from_errno(err, "rename into " + quoted(path));
  if (err == EISDIR) s.code = errc::is_directory;
  return s;
}

}  // namespace

TreeWriter::TreeWriter(int root, std::string tag, bool fsync, std::uint32_t chunk, std::size_t max_open, mode_t umask,
                       std::uint64_t max_file_size, std::shared_ptr<files::Made> made)
    : root_(root),
      tag_(std::move(tag)),
      fsync_(fsync),
      chunk_(chunk),
      max_open_(max_open),
      umask_(umask & 0777),
      max_file_size_(max_file_size),
      made_(made ? std::move(made) : std::make_shared<files::Made>()),
      counter_(writer_ids++) {}

namespace {
std::string made_key(const std::string& path) { return files::Made::key(path); }
}  // namespace

void TreeWriter::made(int dir, const std::string& name, const std::string& path) {
  made_->add(dir, name, made_key(path));
}

Status TreeWriter::make_parents(const std::string& path) {
  std::size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    const std::string prefix = path.substr(0, pos);
    if (prefix.empty() || prefix.back() == '/' || prefix == ".") continue;
    Fd dir;
    std::string name;
    if (auto s = open_parent(root_, prefix, dir, name); !s) return s;
    if (::mkdirat(dir.get(), name.c_str(), 0777) == 0) made(dir.get(), name, prefix);
    else if (errno != EEXIST) return Status::from_errno(errno, "mkdir " + quoted(prefix));
  }
  return Status::ok();
}

TreeWriter::~TreeWriter() { discard_all(); }

std::size_t TreeWriter::open_files() const {
  std::lock_guard lk(mu_);
  return partial_.size();
}

void TreeWriter::discard_all() {
  std::lock_guard lk(mu_);
  // (Workers may still hold these files: what they write next is refused as failed earlier.)
  for (auto& [id, p] : partial_) {
    if (!p->temp.empty()) ::unlinkat(p->dir.get(), p->temp.c_str(), 0);
    p->temp.clear();
    p->failed = true;
    p->seen.clear();
  }
  partial_.clear();
  runs_ = 0;
}

void TreeWriter::abandon(std::uint64_t file_id) {
  // Only a file in progress: ids that name nothing must not grow the table (a peer picks them).
  // Chunks of a file not started yet start it; what never completes goes at the end.
  std::lock_guard lk(mu_);
  auto it = partial_.find(file_id);
  if (it != partial_.end()) give_up(std::shared_ptr<Partial>(it->second));
}

void TreeWriter::leave(const std::shared_ptr<Partial>& p) {
  if (auto it = partial_.find(p->id); it != partial_.end() && it->second == p) partial_.erase(it);
  runs_ -= p->seen.runs();  // (none once it has left: its record goes with it)
  p->seen.clear();
}

void TreeWriter::give_up(const std::shared_ptr<Partial>& p) {
  p->failed = true;
  if (!p->temp.empty()) ::unlinkat(p->dir.get(), p->temp.c_str(), 0);
  p->temp.clear();
  leave(p);
  // Remembered so that its late chunks do not start it again; a peer that gives up more files
  // than this makes the oldest forgotten (a late chunk of one then starts a file that never
  // completes and goes at the end, counted among the files in progress meanwhile).
  if (failed_.size() >= (std::size_t(1) << 16)) failed_.clear();
  failed_.insert(p->id);
}

std::string download_tag() {
  return "dl-" + std::to_string(::getpid()) + "-" + SessionId::random().short_hex();
}

namespace {
// The PID in ".NAME.xdfs-dl-PID-HEX[-ID].part", or 0 when name is not such a temporary file.
pid_t download_temp_pid(const std::string& name) {
  static const std::string mark = ".xdfs-dl-", tail = ".part";
  if (name.size() < 2 || name[0] != '.' || name.size() <= tail.size() ||
      name.compare(name.size() - tail.size(), tail.size(), tail) != 0)
    return 0;
  const auto at = name.rfind(mark);
  if (at == std::string::npos || at == 0) return 0;
  std::size_t i = at + mark.size();
  long long pid = 0;
  const std::size_t digits = i;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9' && pid < (1LL << 31)) pid = pid * 10 + (name[i++] - '0');
  if (i == digits || i >= name.size() || name[i] != '-' || pid <= 0 || pid >= (1LL << 31)) return 0;
  for (++i; i < name.size() - tail.size(); ++i)
    if (!std::isxdigit(static_cast<unsigned char>(name[i])) && name[i] != '-') return 0;
  return static_cast<pid_t>(pid);
}
}  // namespace

std::size_t sweep_stale_downloads(int root, const std::string& path) {
  Fd dir;
  if (!files::open_beneath(root, path.empty() ? "." : path, O_RDONLY | O_DIRECTORY, 0, dir)) return 0;
  const int fd = ::dup(dir.get());
  DIR* d = fd < 0 ? nullptr : ::fdopendir(fd);
  if (!d) {
    if (fd >= 0) ::close(fd);
    return 0;
  }
  std::size_t removed = 0;
  while (const dirent* e = ::readdir(d)) {
    const pid_t pid = download_temp_pid(e->d_name);
    // Another live process (or this one) may be writing it: only a gone writer's file goes.
    if (pid == 0 || pid == ::getpid() || ::kill(pid, 0) == 0 || errno != ESRCH) continue;
    if (::unlinkat(dir.get(), e->d_name, 0) == 0) ++removed;
  }
  ::closedir(d);
  return removed;
}

// The parent directory of path (made, with its parents, when create is set and it is missing).
Status TreeWriter::parent_of(const std::string& path, Fd& dir, std::string& name, bool create) {
  auto [parent, last] = files::split_parent(path);
  if (last.empty() || last == ".") return {errc::bad_argument, quoted(path) + " names the root itself"};
  name = last;
  auto& c = parent_cache;
  if (c.writer == counter_ && c.path == parent && c.fd) {
    dir = Fd(::dup(c.fd.get()));
    if (dir) return Status::ok();
  }
  auto st = files::open_beneath(root_, parent, O_PATH | O_DIRECTORY, 0, dir);
  if (!st && create && st.code == errc::no_such_file) {
    if (auto m = make_parents(parent); !m) return m;
    st = files::open_beneath(root_, parent, O_PATH | O_DIRECTORY, 0, dir);
  }
  if (!st) return st;
  c.writer = counter_;
  c.path = parent;
  c.fd = Fd(::dup(dir.get()));
  return Status::ok();
}

namespace {

// A path a writer may create an entry at: beneath its root, and a name, not the root itself.
Status creatable(const std::string& path) {
  if (auto s = check_path(path); !s) return s;
  if (path.empty() || path == "." || path.back() == '/') return {errc::bad_argument, "'" + path + "' is not a name to create"};
  return Status::ok();
}

}  // namespace

Status TreeWriter::put(const Entry& e) {
  if (auto s = creatable(e.path); !s) return s;
  switch (e.type) {
    case Type::file: return e.file_id == 0 ? put_file(e) : put_chunk(e);
    case Type::directory: {
      Fd dir;
      std::string name;
      if (auto s = parent_of(e.path, dir, name, true); !s) return s;
      // Made with its own mode plus the owner's rwx (so that its contents can be written; the
      // exact mode comes with set_attrs), less the umask.
      if (::mkdirat(dir.get(), name.c_str(), (safe_mode(e.mode) | S_IRWXU) & ~umask_ & 07777) == 0) {
        made(dir.get(), name, e.path);
        return Status::ok();
      }
      const int err = errno;
      struct stat st {};
      if (err == EEXIST && ::fstatat(dir.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
        if (S_ISDIR(st.st_mode)) return Status::ok();
        return {errc::not_regular_file, quoted(e.path) + " exists and is not a directory"};
      }
      return Status::from_errno(err, "mkdir " + quoted(e.path));
    }
    case Type::symlink: {
      if (e.target.empty() || e.target.size() > wire::max_path_bytes)
        return {errc::bad_argument, "symlink " + quoted(e.path) + " has an empty or oversized target"};
      Fd dir;
      std::string name;
      if (auto s = parent_of(e.path, dir, name, true); !s) return s;
      const std::string temp = temp_name(name, tag_);
      if (::symlinkat(e.target.c_str(), dir.get(), temp.c_str()) != 0)
        return Status::from_errno(errno, "symlink " + quoted(e.path));
      const timespec ts[2] = {to_timespec(e.mtime_ns), to_timespec(e.mtime_ns)};
      ::utimensat(dir.get(), temp.c_str(), ts, AT_SYMLINK_NOFOLLOW);
      struct stat st {};
      if (::fstatat(dir.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode)) {
        ::unlinkat(dir.get(), temp.c_str(), 0);
        return {errc::is_directory, quoted(e.path) + " is a directory"};
      }
      if (::renameat(dir.get(), temp.c_str(), dir.get(), name.c_str()) != 0) {
        const int err = errno;
        ::unlinkat(dir.get(), temp.c_str(), 0);
        return Status::from_errno(err, "symlink " + quoted(e.path));
      }
      return Status::ok();
    }
    case Type::other: break;
  }
  return {errc::not_regular_file, quoted(e.path) + " is neither a file, a directory nor a symlink"};
}

Status TreeWriter::put_copy(const Entry& e, int src_fd, std::uint64_t src_offset, const std::string& src_name) {
  if (auto s = creatable(e.path); !s) return s;
  if (e.type != Type::file || e.file_id != 0 || src_fd < 0)
    return {errc::bad_argument, "'" + e.path + "' is not a whole file to create"};
  return put_file(e, src_fd, src_offset, src_name);
}

Status TreeWriter::put_move(const Entry& e, int from_dir, const std::string& from_name) {
  if (auto s = creatable(e.path); !s) return s;
  if (e.type != Type::file || e.file_id != 0) return {errc::bad_argument, quoted(e.path) + " is not a whole file to create"};
  Fd from(::openat(from_dir, from_name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
  struct stat st {};
  if (!from || ::fstat(from.get(), &st) != 0) return Status::from_errno(errno, "open " + quoted(from_name));
  if (!S_ISREG(st.st_mode) || static_cast<std::uint64_t>(st.st_size) != e.size)
    return {errc::size_mismatch, quoted(from_name) + " is not the " + std::to_string(e.size) + "-byte file " + quoted(e.path)};
  Fd dir;
  std::string name;
  if (auto s = parent_of(e.path, dir, name, true); !s) return s;
  if (auto s = finish_file(from.get(), e.path, e.mode, umask_, e.mtime_ns, fsync_); !s) return s;
  if (::renameat(from_dir, from_name.c_str(), dir.get(), name.c_str()) == 0) return Status::ok();
  if (errno != EXDEV) return rename_failed(errno, e.path);
  return put_file(e, from.get(), 0, from_name);
}

Status TreeWriter::put_file(const Entry& e, int src_fd, std::uint64_t src_offset, const std::string& src_name) {
  if (src_fd < 0 && e.data.size() != e.size)
    return {errc::size_mismatch, quoted(e.path) + " announced " + std::to_string(e.size) + " bytes and carries " +
                                     std::to_string(e.data.size())};
  Fd dir;
  std::string name;
  if (auto s = parent_of(e.path, dir, name, true); !s) return s;
  const std::string temp = temp_name(name, tag_);
  Fd fd(::openat(dir.get(), temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd) return Status::from_errno(errno, "create " + quoted(e.path));
  Status st = src_fd < 0 ? write_all(fd.get(), e.data, 0, e.path) : copy_exact(src_fd, src_offset, fd.get(), 0, e.size, src_name, e.path);
  if (st) st = finish_file(fd.get(), e.path, e.mode, umask_, e.mtime_ns, fsync_);
  fd.reset();
  if (st && ::renameat(dir.get(), temp.c_str(), dir.get(), name.c_str()) != 0) st = rename_failed(errno, e.path);
  if (!st) ::unlinkat(dir.get(), temp.c_str(), 0);
  return st;
}

Status TreeWriter::put_chunk(const Entry& e) {
  // Every number here is the peer's: bounded before it is used, and no allocation follows it.
  if (e.size > wire::max_file_size) return {errc::limit_exceeded, quoted(e.path) + " is larger than 2^62 bytes"};
  if (max_file_size_ && e.size > max_file_size_)
    return {errc::limit_exceeded, quoted(e.path) + " of " + std::to_string(e.size) + " bytes exceeds the limit of " +
                                      std::to_string(max_file_size_)};
  if (e.offset % chunk_ != 0 || e.offset >= e.size ||
      e.data.size() != std::min<std::uint64_t>(chunk_, e.size - e.offset))
    return {errc::protocol_error, "chunk of " + quoted(e.path) + " at offset " + std::to_string(e.offset) +
                                      " does not fit its file"};
  std::shared_ptr<Partial> p;
  const auto failed_earlier = [&] { return Status{errc::io_error, quoted(e.path) + " failed earlier"}; };
  {
    std::unique_lock lk(mu_);
    if (failed_.count(e.file_id)) return failed_earlier();
    auto it = partial_.find(e.file_id);
    if (it == partial_.end()) {
      // The parent first (making it notes directories, which takes the lock), then the file
      // under the lock: two workers holding the first chunks of one file must not both create
      // it. This happens once per large file.
      lk.unlock();
      Fd dir;
      std::string name;
      auto s = parent_of(e.path, dir, name, true);
      lk.lock();
      if (!s) return s;
      if (failed_.count(e.file_id)) return failed_earlier();
      it = partial_.find(e.file_id);
      if (it == partial_.end()) {
        if (partial_.size() >= max_open_)
          return {errc::limit_exceeded, "more than " + std::to_string(max_open_) + " large files in progress"};
        if (max_file_size_ == 0)
          if (auto room = files::check_room(dir.get(), e.size, quoted(e.path)); !room) return room;
        p = std::make_shared<Partial>();
        p->id = e.file_id;
        p->path = e.path;
        p->size = e.size;
        p->mode = e.mode;
        p->mtime = e.mtime_ns;
        p->name = name;
        p->temp = temp_name(name, tag_ + "-" + std::to_string(e.file_id));
        p->fd = Fd(::openat(dir.get(), p->temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600));
        if (!p->fd) return Status::from_errno(errno, "create " + quoted(e.path));
        p->dir = std::move(dir);
        partial_.emplace(e.file_id, p);
      } else {
        p = it->second;
      }
    } else {
      p = it->second;
    }
    if (p->failed) return failed_earlier();
    if (p->path != e.path || p->size != e.size)
      return {errc::protocol_error, "chunk of file id " + std::to_string(e.file_id) + " names another file"};
    const std::size_t runs = p->seen.runs();
    if (!p->seen.insert(e.offset, e.offset + e.data.size()))
      return {errc::protocol_error, "chunk at offset " + std::to_string(e.offset) + " of " + quoted(e.path) + " came twice"};
    runs_ = runs_ - runs + p->seen.runs();
    if (runs_ > max_runs_apart) {
      give_up(p);
      return {errc::limit_exceeded, "chunks of the large files in progress arrive in more than " +
                                        std::to_string(max_runs_apart) + " runs apart (the last of " + quoted(e.path) + ")"};
    }
  }
  Status st;
  {
    std::lock_guard wl(p->write_mu);
    st = write_all(p->fd.get(), e.data, e.offset, e.path);
  }
  std::unique_lock lk(mu_);
  if (!st) {
    give_up(p);  // its other chunks are refused from now on; the temporary file goes at once
    return st;
  }
  if (p->failed) return failed_earlier();  // given up while this chunk was written
  p->written += e.data.size();
  if (p->written < p->size) return Status::ok();
  leave(p);
  lk.unlock();
  st = finish_file(p->fd.get(), e.path, p->mode, umask_, p->mtime, fsync_);
  p->fd.reset();
  if (st && ::renameat(p->dir.get(), p->temp.c_str(), p->dir.get(), p->name.c_str()) != 0)
    st = Status::from_errno(errno, "rename into " + quoted(e.path));
  if (!st) ::unlinkat(p->dir.get(), p->temp.c_str(), 0);
  p->temp.clear();
  return st;
}

Status TreeWriter::set_attrs(const Entry& e) {
  if (auto s = check_path(e.path); !s) return s;
  const timespec ts[2] = {to_timespec(e.mtime_ns), to_timespec(e.mtime_ns)};
  Fd fd;
  if (e.path.empty() || e.path == ".") {
    if (auto s = files::open_beneath(root_, ".", O_RDONLY | O_DIRECTORY, 0, fd); !s) return s;
  } else {
    Fd dir;
    std::string name;
    if (auto s = open_parent(root_, e.path, dir, name); !s) return s;
    struct stat st {};
    if (::fstatat(dir.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0)
      return Status::from_errno(errno, "stat " + quoted(e.path));
    if (S_ISLNK(st.st_mode)) {
      if (::utimensat(dir.get(), name.c_str(), ts, AT_SYMLINK_NOFOLLOW) != 0)
        return Status::from_errno(errno, "set the mtime of " + quoted(e.path));
      return Status::ok();
    }
    fd = Fd(::openat(dir.get(), name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
    if (!fd) return Status::from_errno(errno, "open " + quoted(e.path));
  }
  // The mode only of what this copy made (still the same thing at that path): what was there
  // before (the user's own destination, say) keeps its mode whatever the peer says.
  struct stat now {};
  if (::fstat(fd.get(), &now) != 0) return Status::from_errno(errno, "stat " + quoted(e.path));
  const bool mine = made_->has(now, made_key(e.path));
  if (mine && ::fchmod(fd.get(), safe_mode(e.mode) & ~umask_) != 0)
    return Status::from_errno(errno, "chmod " + quoted(e.path));
  if (::futimens(fd.get(), ts) != 0) return Status::from_errno(errno, "set the mtime of " + quoted(e.path));
  return Status::ok();
}

Status TreeWriter::make_dir(const std::string& raw, bool parents, std::uint32_t mode) {
  const std::string path = normal(raw);
  if (auto s = check_path(path); !s) return s;
  if (path.empty() || path == ".") return parents ? Status::ok() : Status{errc::bad_argument, "the root exists"};
  if (parents)
    if (auto [parent, last] = files::split_parent(path); parent != ".")
      if (auto s = make_parents(parent); !s) return s;
  Fd dir;
  std::string name;
  if (auto s = open_parent(root_, path, dir, name); !s) return s;
  if (::mkdirat(dir.get(), name.c_str(), mode ? safe_mode(mode) & ~umask_ : 0777) == 0) {
    made(dir.get(), name, path);
    return Status::ok();
  }
  const int err = errno;
  struct stat st {};
  if (err == EEXIST && parents && ::fstatat(dir.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode))
    return Status::ok();
  return Status::from_errno(err, "mkdir " + quoted(path));
}

void TreeWriter::claim(const std::string& path) {
  const std::string p = normal(path);
  if (p.empty() || p == ".") return made(root_, ".", p);
  Fd dir;
  std::string name;
  if (open_parent(root_, p, dir, name)) made(dir.get(), name, p);
}

}  // namespace xdfs::pathm
