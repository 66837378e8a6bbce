// A pack: many small files as one file, so that a tree's small files go through a relay chain
// as one file (one place, one upload per hop) instead of one chain each, and cross the source's
// link once (docs/relay.md). The master writes it from the tree; each host, once the pack is
// whole there and forwarded, writes its files into the pack's directory and removes it.
//
//   "xdfs-pack 1\n"
//   then per file: u16 path length, path (relative to the pack's directory), u32 mode (0777 at
//   most), i64 mtime (ns), u64 size, and the file's bytes; all little-endian.
//
//   "xdfs-pack 2\n" (part 0 of a set pulled with its directories and symlinks): the same, each
//   entry's mode also giving its kind in its file-type bits: 0100000 a file, 0040000 a
//   directory (no bytes), 0120000 a symlink (its target as its bytes: 1 to 4096, no NUL). No
//   path twice, nothing beneath a file or a symlink of the pack.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "xdfs/files.hpp"
#include "xdfs/pathm/fsops.hpp"

namespace xdfs::relay_detail {

inline constexpr std::string_view pack_magic = "xdfs-pack 1\n";
inline constexpr std::string_view pack_magic_2 = "xdfs-pack 2\n";
static_assert(pack_magic.size() == pack_magic_2.size());
/// The largest file a pack carries (a host reads each whole before writing it).
inline constexpr std::uint64_t max_pack_file = std::uint64_t(16) << 20;
inline constexpr std::size_t max_pack_path = 4096;
/// A pack's bytes and files at most (a host refuses a larger pack; a master makes them smaller:
/// 32 MiB of files, 20000 files).
inline constexpr std::uint64_t max_pack_size = std::uint64_t(128) << 20;
inline constexpr std::uint64_t max_pack_files = 20000;
/// An entry's header around its path: the path's length before it; mode, mtime and size after.
inline constexpr std::size_t pack_head_before_path = 2;
inline constexpr std::size_t pack_head_after_path = 4 + 8 + 8;
/// What an entry takes in a pack: its header, its path and its bytes.
constexpr std::uint64_t pack_entry_size(std::size_t path_len, std::uint64_t size) {
  return pack_head_before_path + path_len + pack_head_after_path + size;
}

/// An entry's header as a pack holds it, read by read_pack_head.
struct PackHead {
  enum Read {
    ok,
    short_head,  ///< fewer bytes before the end than any header takes (or `at` past it)
    bad_path,    ///< a path length of 0 or more than max_pack_path
    short_path,  ///< a path that runs past the end with its header
    io,          ///< the header could not be read (an error, or a file shorter than `end`)
  } read = ok;
  std::size_t path_len = 0;
  std::string_view path{};   ///< in the caller's buffer
  std::uint32_t mode = 0;    ///< as packed (version 2: with the kind in its file-type bits)
  std::int64_t mtime_ns = 0;
  std::uint64_t size = 0;    ///< as packed: not checked against anything
  std::uint64_t data = 0;    ///< where its bytes begin
};
using PackHeadBuffer = std::array<std::uint8_t, pack_head_before_path + max_pack_path + pack_head_after_path>;

/// Reads the header of the entry at `at` from fd, no byte at or past `end`, into buf.
PackHead read_pack_head(int fd, std::uint64_t at, std::uint64_t end, PackHeadBuffer& buf);

struct PackEntry {
  std::string path;  ///< relative to the pack's directory
  std::uint32_t mode = 0644;  ///< permission bits
  std::int64_t mtime_ns = 0;
  std::uint64_t size = 0;  ///< a symlink's: its target's length; a directory's: 0
  pathm::Type type = pathm::Type::file;  ///< a directory or a symlink only in a pack of version 2
  std::string target{};  ///< a symlink's
};

/// Appends to the pack at fd (a regular file, not opened for appending: its magic first, on the
/// first entry, of `version` 1 or 2): the entry and, for a file, `size` bytes read from data_fd.
/// The file must still have its size (one that changed fails, naming it).
files::Status pack_append(int fd, bool first, const PackEntry& e, int data_fd, unsigned version = 1);

struct Unpacked {
  errc code = errc::ok;
  std::string message;   ///< the first failure, naming the entry
  std::uint64_t files = 0, bytes = 0, links = 0;
  std::uint64_t prestaged = 0;  ///< of the files: renamed from a Prestaged copy
  /// Version 2: the directories made (or found), in the pack's order: their modes and mtimes
  /// are the caller's to set (TreeWriter::set_attrs) once what they hold is in place.
  std::vector<pathm::Entry> dirs{};
};

/// A pack's files copied out of it already (a host copies them while the pack arrives): each
/// file entry whose bytes end at or below `upto` is a file in `dir`, named by the decimal offset
/// of its bytes in the pack, that unpack renames into place instead of copying (one that is not
/// there as a file of the entry's size is copied from the pack instead).
struct Prestaged {
  int dir = -1;
  std::uint64_t upto = 0;
};

/// Writes the pack's files (pack_fd, pack_size bytes; and, in a pack of version 2, its
/// directories and symlinks) under `dir` (relative to the writer's root) with `writer`: every
/// path is checked as a client's is, every size against what the pack still holds,
/// max_pack_file and max_file_size (0: none), the entries against max_pack_files; a pack of a
/// version past `max_version` is refused. The whole pack is checked before its first entry is
/// written; a failure while writing stops there.
Unpacked unpack(int pack_fd, std::uint64_t pack_size, pathm::TreeWriter& writer, const std::string& dir,
                std::uint64_t max_file_size, const std::atomic<bool>* cancel = nullptr, unsigned max_version = 1,
                const Prestaged* pre = nullptr);

}  // namespace xdfs::relay_detail
