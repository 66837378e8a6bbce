#include "pack.hpp"

#include <unistd.h>

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

constexpr std::size_t fixed = pack_head_before_path;  // path length
constexpr std::size_t after_path = pack_head_after_path;  // mode, mtime, size

}  // namespace

files::Status pack_append(int fd, bool first, const PackEntry& e, int data_fd) {
  if (e.path.empty() || e.path.size() > max_pack_path)
    return {errc::bad_argument, "'" + e.path + "': a pack's path is 1 to 4096 bytes"};
  if (e.size > max_pack_file) return {errc::limit_exceeded, "'" + e.path + "' is too large for a pack"};
  std::string head;
  if (first) head.append(pack_magic);
  put_le<std::uint16_t>(head, static_cast<std::uint16_t>(e.path.size()));
  head += e.path;
  put_le<std::uint32_t>(head, e.mode & 0777);
  put_le<std::int64_t>(head, e.mtime_ns);
  put_le<std::uint64_t>(head, e.size);
  if (auto s = write_all(fd, head.data(), head.size()); !s) return s;
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
                std::uint64_t max_file_size, const std::atomic<bool>* cancel) {
  Unpacked u;
  auto failed = [&](errc code, std::string why) {
    u.code = code;
    u.message = "pack: " + why;
    return u;
  };
  std::array<std::uint8_t, pack_magic.size()> magic{};
  if (pack_size < magic.size() || !read_at(pack_fd, magic.data(), magic.size(), 0) ||
      std::memcmp(magic.data(), pack_magic.data(), magic.size()) != 0)
    return failed(errc::protocol_error, "not a pack (its first bytes are not the pack's)");
  // Two passes: the first checks every header, path and size (reading headers only), the second
  // writes; so a damaged pack writes nothing.
  for (const bool write : {false, true}) {
    std::uint64_t at = magic.size(), files = 0;
    while (at < pack_size) {
      if (cancel && cancel->load()) return failed(errc::cancelled, "cancelled");
      if (++files > max_pack_files)
        return failed(errc::limit_exceeded, "more than " + std::to_string(max_pack_files) + " files");
      // Every length is the peer's: checked against what the pack still holds before it is used.
      std::array<std::uint8_t, fixed + max_pack_path + after_path> head{};
      if (pack_size - at < fixed + after_path || !read_at(pack_fd, head.data(), fixed, at))
        return failed(errc::protocol_error, "an entry cut short at byte " + std::to_string(at));
      const std::size_t path_len = get_le<std::uint16_t>(head.data());
      if (path_len == 0 || path_len > max_pack_path || pack_size - at < fixed + path_len + after_path)
        return failed(errc::protocol_error, "an entry's path of " + std::to_string(path_len) + " bytes at byte " +
                                                std::to_string(at));
      if (!read_at(pack_fd, head.data() + fixed, path_len + after_path, at + fixed))
        return failed(errc::io_error, "read at byte " + std::to_string(at));
      std::string path(reinterpret_cast<const char*>(head.data() + fixed), path_len);
      const std::string named = "'" + text::escape(path) + "'";  // the peer's bytes, shown escaped
      const std::uint8_t* p = head.data() + fixed + path_len;
      pathm::Entry e;
      e.type = pathm::Type::file;
      e.mode = get_le<std::uint32_t>(p);
      e.mtime_ns = get_le<std::int64_t>(p + 4);
      e.size = get_le<std::uint64_t>(p + 12);
      at += fixed + path_len + after_path;
      if (e.mode > 0777) return failed(errc::protocol_error, named + ": mode beyond the permission bits");
      if (e.size > pack_size - at) return failed(errc::protocol_error, named + " runs past the pack's end");
      if (e.size > max_pack_file) return failed(errc::limit_exceeded, named + " is larger than a pack's files may be");
      if (max_file_size && e.size > max_file_size)
        return failed(errc::limit_exceeded, named + " of " + std::to_string(e.size) +
                                                " bytes exceeds this server's limit of " + std::to_string(max_file_size));
      if (auto s = files::check_relative_path(path); !s) return failed(s.code, named + ": " + text::escape(s.message));
      if (!write) {
        at += e.size;
        continue;
      }
      e.path = dir.empty() || dir == "." ? path : dir + "/" + path;
      // Straight from the pack (e.size is within it), in the kernel where it can.
      if (auto s = writer.put_copy(e, pack_fd, at, "the pack"); !s) return failed(s.code, text::escape(s.message));
      at += e.size;
      ++u.files;
      u.bytes += e.size;
    }
  }
  return u;
}

}  // namespace xdfs::relay_detail
