// File-system work of the path mode, beneath a root directory descriptor.
//
// The server runs these on its session's root (after confinement to a subdirectory); the
// client runs the same code on its local source or destination, so both ends of a tree copy
// create, write, close and rename files the same way: every file is written under a temporary
// dot-name and renamed into place only when whole, with its mode and mtime already set.
// Every function checks its paths (relative, no "..") and opens with RESOLVE_BENEATH.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "xdfs/files.hpp"
#include "xdfs/pathm/messages.hpp"

namespace xdfs::pathm {

using files::Status;

/// Checks a path from a request: relative and without ".."; "" and "." name the root.
Status check_path(const std::string& path);

/// path without trailing slashes and leading "./".
std::string normal(const std::string& path);

/// The entry at path, without following a final symlink.
Status stat_entry(int root, const std::string& path, Entry& out);

/// A flag a long operation checks as it goes (a recursive listing or removal, a checksum):
/// once it is set, the operation stops with errc::cancelled. Null: never.
using Stop = const std::atomic<bool>*;

/// Lists the directory at path (the whole tree below it if recursive, parents before children),
/// handing out chunks of at most `chunk` entries; emit returns false to stop. Entry paths are
/// relative to path. With `follow`, symlinks are listed as what they point to. A subdirectory
/// that cannot be read fails the listing, unless `unreadable` is given: it is told (the
/// directory's path relative to path, and why) and the listing goes on without its contents.
Status list_dir(int root, const std::string& path, bool recursive, bool follow, std::size_t chunk,
                const std::function<bool(std::vector<Entry>&)>& emit, Stop stop = nullptr,
                const std::function<void(const std::string&, const Status&)>& unreadable = {});

Status make_dir(int root, const std::string& path, bool parents, std::uint32_t mode);
/// Removes a file or symlink; a directory only when recursive (with all it holds).
Status remove_path(int root, const std::string& path, bool recursive, Stop stop = nullptr);
Status rename_path(int root, const std::string& from, const std::string& to);
/// SHA-256 of bytes [offset, offset+length) of a regular file (length 0: to the end).
Status checksum(int root, const std::string& path, std::uint64_t offset, std::uint64_t length,
                std::vector<std::uint8_t>& digest, Stop stop = nullptr);

/// The whole-file manifest digest (docs/manifest.md) of a regular file for a block size
/// (wire::min_block_size..wire::max_block_size).
Status manifest_digest(int root, const std::string& path, std::uint32_t block_size, std::vector<std::uint8_t>& digest,
                       Stop stop = nullptr);

/// Opens a regular file beneath root for reading and returns its entry (size, mode, mtime).
Status open_file(int root, const std::string& path, files::Fd& fd, Entry& e);
/// Reads exactly dst.size() bytes at offset; a file that got shorter is a size_mismatch.
Status read_exact(int fd, std::span<std::uint8_t> dst, std::uint64_t offset, const std::string& path);
/// Copies n bytes of `from` at from_offset to `to` at to_offset, in the kernel where the file
/// systems allow it (copy_file_range, else splice through a pipe: no copy through user space),
/// else through a buffer. A
/// source that ends first is a size_mismatch; a destination opened for appending, or a range of
/// the same file that overlaps, is refused. from_name and to_name name them in errors.
Status copy_exact(int from, std::uint64_t from_offset, int to, std::uint64_t to_offset, std::uint64_t n,
                  const std::string& from_name, const std::string& to_name);

/// Creates entries beneath a root: directories, symlinks, whole files and chunks of large
/// files, each file under a temporary name until whole. Safe to call from several threads.
/// The temporary-name tag of a local download writer: "dl-PID-RANDOM", so that what a killed copy
/// left behind can be told from what a running one is writing.
std::string download_tag();

/// Removes, from the directory at path (under root), the temporary files of downloads whose
/// process is gone (a copy killed with SIGKILL cannot clean up). Returns how many went; a
/// directory that cannot be read is left alone.
std::size_t sweep_stale_downloads(int root, const std::string& path);

class TreeWriter {
public:
  /// chunk: the block size large files are split into; max_open: large files in progress at
  /// once; umask: masked off every mode it sets (as the kernel does for a plain create);
  /// max_file_size: largest file it accepts (0: what the file system has free when the file
  /// starts).
  /// made: what the copy (the session) made, shared with its other writers and operations
  /// (null: this writer's own).
  /// Runs of arrived chunks apart from each other a writer keeps track of, over its files in
  /// progress: a peer spreading chunks over large files would otherwise grow those records
  /// without bound, outside the memory budget (a sender's chunks come nearly in order).
  static constexpr std::size_t max_runs_apart = 65536;

  TreeWriter(int root, std::string tag, bool fsync, std::uint32_t chunk, std::size_t max_open = 1024,
             mode_t umask = files::process_umask(), std::uint64_t max_file_size = 0,
             std::shared_ptr<files::Made> made = nullptr);
  ~TreeWriter();
  TreeWriter(const TreeWriter&) = delete;
  TreeWriter& operator=(const TreeWriter&) = delete;

  Status put(const Entry& e);
  /// A whole file (e.type file, e.file_id 0) whose e.size bytes are src_fd's from src_offset
  /// (e.data unused): copied by copy_exact, then renamed into place as put does.
  Status put_copy(const Entry& e, int src_fd, std::uint64_t src_offset, const std::string& src_name = "its source");
  /// A whole file (e.type file, e.file_id 0) that is now `from_name` in the directory from_dir,
  /// e.size bytes: its mode and mtime set as put sets them, then renamed into place (copied by
  /// copy_exact where the two are on different file systems, and the original left).
  Status put_move(const Entry& e, int from_dir, const std::string& from_name);
  /// Sets mtime, and the mode of what this writer's copy made (Made: the same thing still at
  /// that path), directories after their contents are in place. What was there before keeps
  /// its mode: a peer must not be able to open up what it did not make.
  Status set_attrs(const Entry& e);
  /// Makes a directory (with its parents), noting what it made.
  Status make_dir(const std::string& path, bool parents, std::uint32_t mode);
  /// Counts what is at `path` as made by this copy (the caller made it for the copy).
  void claim(const std::string& path);
  /// Files in progress (a large file not yet whole).
  std::size_t open_files() const;
  /// Removes every temporary file still in progress (after a failure).
  void discard_all();
  /// Gives up one large file in progress: its temporary file goes, and chunks that still come
  /// for it are refused ("failed earlier"). A file not started yet is left alone.
  void abandon(std::uint64_t file_id);

private:
  struct Partial;
  /// src_fd < 0: the bytes are e.data.
  Status put_file(const Entry& e, int src_fd = -1, std::uint64_t src_offset = 0, const std::string& src_name = {});
  Status put_chunk(const Entry& e);
  Status parent_of(const std::string& path, files::Fd& dir, std::string& name, bool create);
  /// Makes the missing directories of path (relative to the root), noting each one made.
  Status make_parents(const std::string& path);
  /// Notes that `path` (`name` in `dir`) was made by this copy.
  void made(int dir, const std::string& name, const std::string& path);
  /// With mu_ held: the file is no longer in progress (if it still was), and its record of
  /// arrived chunks goes with it.
  void leave(const std::shared_ptr<Partial>& p);
  /// With mu_ held: the file is failed, its temporary file goes, later chunks are refused; it no
  /// longer counts among the files in progress (its descriptors close once no worker holds it).
  void give_up(const std::shared_ptr<Partial>& p);

  int root_;
  std::string tag_;
  bool fsync_;
  std::uint32_t chunk_;
  std::size_t max_open_;
  mode_t umask_;
  std::uint64_t max_file_size_;
  mutable std::mutex mu_;
  std::unordered_map<std::uint64_t, std::shared_ptr<Partial>> partial_;
  std::unordered_set<std::uint64_t> failed_;  // ids given up: their late chunks are refused
  /// The runs apart of chunks that came, over the files in progress (what their records of
  /// arrived chunks cost): at most max_runs_apart, or the file whose chunk goes past it fails.
  std::size_t runs_ = 0;
  std::shared_ptr<files::Made> made_;  // what this writer (or its copy) created
  std::uint64_t counter_ = 0;
};

}  // namespace xdfs::pathm
