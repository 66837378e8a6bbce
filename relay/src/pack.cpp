#include "pack.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <vector>

#include "xdfs/text.hpp"

namespace xdfs::relay_detail {
namespace {

template <typename T>
void put_le(std::string& out, T v) {
  for (std::size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<char>((static_cast<std::uint64_t>(v) >> (8 * i)) & 0xff));
}

template <typename T>
T get_le(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return static_cast<T>(v);
}

files::Status write_all(int fd, const void* data, std::size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return files::Status::from_errno(w < 0 ? errno : EIO, "write the pack");
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return files::Status::ok();
}

// Reads exactly n bytes at offset; false at the end of the file or on an error.
bool read_at(int fd, void* data, std::size_t n, std::uint64_t offset) {
  auto* p = static_cast<char*>(data);
  while (n) {
    const ssize_t r = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
    offset += static_cast<std::uint64_t>(r);
  }
  return true;
}

// (The kinds on the wire, as pack.hpp spells them.)
static_assert(S_IFREG == 0100000 && S_IFDIR == 0040000 && S_IFLNK == 0120000 && S_IFMT == 0170000);

constexpr std::size_t fixed = pack_head_before_path;  // path length
constexpr std::size_t after_path = pack_head_after_path;  // mode, mtime, size

}  // namespace

PackHead read_pack_head(int fd, std::uint64_t at, std::uint64_t end, PackHeadBuffer& buf) {
  PackHead h;
  // Every length is the peer's: checked against what the pack still holds before it is used.
  if (at > end || end - at < fixed + after_path) {
    h.read = PackHead::short_head;
    return h;
  }
  if (!read_at(fd, buf.data(), fixed, at)) {
    h.read = PackHead::io;
    return h;
  }
  h.path_len = get_le<std::uint16_t>(buf.data());
  if (h.path_len == 0 || h.path_len > max_pack_path) {
    h.read = PackHead::bad_path;
    return h;
  }
  if (end - at < fixed + h.path_len + after_path) {
    h.read = PackHead::short_path;
    return h;
  }
  if (!read_at(fd, buf.data() + fixed, h.path_len + after_path, at + fixed)) {
    h.read = PackHead::io;
    return h;
  }
  h.path = std::string_view(reinterpret_cast<const char*>(buf.data() + fixed), h.path_len);
  const std::uint8_t* p = buf.data() + fixed + h.path_len;
  h.mode = get_le<std::uint32_t>(p);
  h.mtime_ns = get_le<std::int64_t>(p + 4);
  h.size = get_le<std::uint64_t>(p + 12);
  h.data = at + fixed + h.path_len + after_path;
  return h;
}

files::Status pack_append(int fd, bool first, const PackEntry& e, int data_fd, unsigned version) {
  if (e.path.empty() || e.path.size() > max_pack_path)
    return {errc::bad_argument, "'" + e.path + "': a pack's path is 1 to 4096 bytes"};
  if (e.size > max_pack_file) return {errc::limit_exceeded, "'" + e.path + "' is too large for a pack"};
  if (version != 1 && version != 2) return {errc::bad_argument, "a pack is of version 1 or 2"};
  if (e.type != pathm::Type::file && version < 2)
    return {errc::bad_argument, "'" + e.path + "': a pack of version 1 holds files only"};
  std::uint32_t kind = 0;
  switch (e.type) {
    case pathm::Type::file: kind = version < 2 ? 0 : S_IFREG; break;
    case pathm::Type::directory:
      if (e.size != 0) return {errc::bad_argument, "'" + e.path + "': a directory's entry has no bytes"};
      kind = S_IFDIR;
      break;
    case pathm::Type::symlink:
      if (e.target.empty() || e.target.size() > max_pack_path || e.size != e.target.size() ||
          e.target.find('\0') != std::string::npos)
        return {errc::bad_argument, "'" + e.path + "': a symlink's target is 1 to 4096 bytes"};
      kind = S_IFLNK;
      break;
    case pathm::Type::other: return {errc::bad_argument, "'" + e.path + "' is not a file, a directory nor a symlink"};
  }
  std::string head;
  if (first) head.append(version < 2 ? pack_magic : pack_magic_2);
  put_le<std::uint16_t>(head, static_cast<std::uint16_t>(e.path.size()));
  head += e.path;
  put_le<std::uint32_t>(head, kind | (e.mode & 0777));
  put_le<std::int64_t>(head, e.mtime_ns);
  put_le<std::uint64_t>(head, e.size);
  if (e.type == pathm::Type::symlink) head += e.target;
  if (auto s = write_all(fd, head.data(), head.size()); !s) return s;
  if (e.type != pathm::Type::file) return files::Status::ok();
  const off_t end = ::lseek(fd, 0, SEEK_CUR);
  if (end < 0) return files::Status::from_errno(errno, "the pack's end");
  if (auto s = pathm::copy_exact(data_fd, 0, fd, static_cast<std::uint64_t>(end), e.size, e.path, "the pack"); !s) {
    if (s.code == errc::size_mismatch) s.message = "'" + e.path + "' shrank while it was packed";
    return s;
  }
  if (::lseek(fd, end + static_cast<off_t>(e.size), SEEK_SET) < 0) return files::Status::from_errno(errno, "the pack's end");
  return files::Status::ok();
}

Unpacked unpack(int pack_fd, std::uint64_t pack_size, pathm::TreeWriter& writer, const std::string& dir,
                std::uint64_t max_file_size, const std::atomic<bool>* cancel, unsigned max_version,
                const Prestaged* pre) {
  Unpacked u;
  auto failed = [&](errc code, std::string why) {
    u.code = code;
    u.message = "pack: " + why;
    return u;
  };
  std::array<std::uint8_t, pack_magic.size()> magic{};
  if (pack_size < magic.size() || !read_at(pack_fd, magic.data(), magic.size(), 0))
    return failed(errc::protocol_error, "not a pack (its first bytes are not the pack's)");
  const bool v2 = std::memcmp(magic.data(), pack_magic_2.data(), magic.size()) == 0;
  if (!v2 && std::memcmp(magic.data(), pack_magic.data(), magic.size()) != 0)
    return failed(errc::protocol_error, "not a pack (its first bytes are not the pack's)");
  if (v2 && max_version < 2)
    return failed(errc::protocol_error, "a pack of version 2 (with directories and symlinks) where only files are taken");
  // Version 2: every entry's path and whether it is a file or a symlink (checked once all are
  // read: no path twice, nothing beneath a file or a symlink of the pack, so that no entry is
  // written through a symlink the pack made, nor fails only once others are written).
  std::vector<std::pair<std::string, bool>> paths;
  // Two passes: the first checks every header, path and size (reading headers only), the second
  // writes; so a damaged pack writes nothing.
  for (const bool write : {false, true}) {
    std::uint64_t at = magic.size(), files = 0;
    if (write && v2) {
      // '/' sorts first: whatever is beneath a path comes right after it (and a path twice, twice).
      const auto key = [](char c) { return c == '/' ? 0 : static_cast<unsigned char>(c) + 1; };
      std::sort(paths.begin(), paths.end(), [&](const auto& a, const auto& b) {
        return std::lexicographical_compare(a.first.begin(), a.first.end(), b.first.begin(), b.first.end(),
                                            [&](char x, char y) { return key(x) < key(y); });
      });
      for (std::size_t i = 1; i < paths.size(); ++i) {
        const auto& [a, leaf] = paths[i - 1];
        const auto& b = paths[i].first;
        if (a == b) return failed(errc::protocol_error, "'" + text::escape(a) + "' twice");
        if (leaf && b.size() > a.size() && b.compare(0, a.size(), a) == 0 && b[a.size()] == '/')
          return failed(errc::protocol_error, "'" + text::escape(b) + "' beneath the pack's file or symlink '" +
                                                  text::escape(a) + "'");
      }
      paths = {};
    }
    PackHeadBuffer head{};
    while (at < pack_size) {
      if (cancel && cancel->load()) return failed(errc::cancelled, "cancelled");
      if (++files > max_pack_files)
        return failed(errc::limit_exceeded, "more than " + std::to_string(max_pack_files) + (v2 ? " entries" : " files"));
      const PackHead h = read_pack_head(pack_fd, at, pack_size, head);
      if (h.read == PackHead::short_head)
        return failed(errc::protocol_error, "an entry cut short at byte " + std::to_string(at));
      if (h.read == PackHead::bad_path || h.read == PackHead::short_path)
        return failed(errc::protocol_error, "an entry's path of " + std::to_string(h.path_len) + " bytes at byte " +
                                                std::to_string(at));
      if (h.read == PackHead::io) return failed(errc::io_error, "read at byte " + std::to_string(at));
      std::string path(h.path);
      const std::string named = "'" + text::escape(path) + "'";  // the peer's bytes, shown escaped
      pathm::Entry e;
      e.type = pathm::Type::file;
      e.mode = h.mode;
      e.mtime_ns = h.mtime_ns;
      e.size = h.size;
      at = h.data;
      // Version 2: the kind in the mode's file-type bits (version 1: none, a file).
      const std::uint32_t kind = v2 ? e.mode & S_IFMT : S_IFREG;
      e.mode &= v2 ? ~static_cast<std::uint32_t>(S_IFMT) : ~0u;
      if (e.mode > 0777) return failed(errc::protocol_error, named + ": mode beyond the permission bits");
      if (kind == S_IFDIR) e.type = pathm::Type::directory;
      else if (kind == S_IFLNK) e.type = pathm::Type::symlink;
      else if (kind != S_IFREG) return failed(errc::protocol_error, named + ": neither a file, a directory nor a symlink");
      if (e.size > pack_size - at) return failed(errc::protocol_error, named + " runs past the pack's end");
      if (e.type == pathm::Type::directory && e.size != 0)
        return failed(errc::protocol_error, named + ": a directory with bytes");
      if (e.type == pathm::Type::symlink) {
        if (e.size == 0 || e.size > max_pack_path)
          return failed(errc::protocol_error, named + ": a symlink's target of " + std::to_string(e.size) + " bytes");
        e.target.resize(static_cast<std::size_t>(e.size));
        if (!read_at(pack_fd, e.target.data(), e.target.size(), at))
          return failed(errc::io_error, "read at byte " + std::to_string(at));
        if (e.target.find('\0') != std::string::npos) return failed(errc::protocol_error, named + ": a symlink's target with a NUL");
      }
      if (e.size > max_pack_file) return failed(errc::limit_exceeded, named + " is larger than a pack's files may be");
      if (max_file_size && e.size > max_file_size)
        return failed(errc::limit_exceeded, named + " of " + std::to_string(e.size) +
                                                " bytes exceeds this server's limit of " + std::to_string(max_file_size));
      if (auto s = files::check_relative_path(path); !s) return failed(s.code, named + ": " + text::escape(s.message));
      if (path.back() == '/' || path == "." || path.rfind("./", 0) == 0 || path.find("//") != std::string::npos ||
          path.find("/./") != std::string::npos || (path.size() >= 2 && path.compare(path.size() - 2, 2, "/.") == 0))
        return failed(errc::protocol_error, named + ": an empty or '.' component");
      if (!write) {
        if (v2) paths.emplace_back(path, e.type != pathm::Type::directory);
        at += e.size;
        continue;
      }
      e.path = dir.empty() || dir == "." ? path : dir + "/" + path;
      if (e.type != pathm::Type::file) {
        // (A directory is made with its owner's rwx, so that what it holds can be written: its
        // own mode, and its mtime, come once that is in place.)
        if (auto s = writer.put(e); !s) return failed(s.code, text::escape(s.message));
        at += e.size;
        if (e.type == pathm::Type::directory) u.dirs.push_back(std::move(e));
        else ++u.links;
        continue;
      }
      // Copied out already (renamed into place), or straight from the pack (e.size is within
      // it), in the kernel where it can.
      // (A copy that is not there as a file of its size is made again from the pack.)
      struct stat cs {};
      const std::string copy = pre ? std::to_string(at) : std::string();
      const bool copied = pre && pre->dir >= 0 && e.size <= pre->upto && at <= pre->upto - e.size &&
                          ::fstatat(pre->dir, copy.c_str(), &cs, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(cs.st_mode) &&
                          static_cast<std::uint64_t>(cs.st_size) == e.size;
      const auto s = copied ? writer.put_move(e, pre->dir, copy) : writer.put_copy(e, pack_fd, at, "the pack");
      if (!s) return failed(s.code, text::escape(s.message));
      u.prestaged += copied ? 1 : 0;
      at += e.size;
      ++u.files;
      u.bytes += e.size;
    }
  }
  return u;
}

}  // namespace xdfs::relay_detail
