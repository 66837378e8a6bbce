// File-system helpers: RAII descriptors, root confinement and the write-then-rename rule.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "xdfs/error.hpp"

namespace xdfs::files {

/// Large files one session may write at once (path mode: chunks of each arrive over time), each
/// holding two descriptors (its directory and its temporary file) until it is whole or given up.
inline constexpr std::size_t max_files_in_progress = 256;

/// Owns one file descriptor.
class Fd {
public:
  Fd() = default;
  explicit Fd(int fd) noexcept : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  void reset() noexcept;
  int release() noexcept { return std::exchange(fd_, -1); }

private:
  int fd_ = -1;
};

/// An error with its code and one line of context.
struct Status {
  errc code = errc::ok;
  std::string message;
  explicit operator bool() const noexcept { return code == errc::ok; }
  static Status ok() { return {}; }
  static Status from_errno(int err, const std::string& what);
};

/// Checks a client-supplied path before any system call sees it: relative, no "..", no NUL,
/// bounded length. The error names the cause ("absolute path", "'..' component").
Status check_relative_path(const std::string& path);

/// Opens `path` under the directory `root` so that it cannot resolve outside it, even through
/// symlinks or a concurrent rename (openat2 with RESOLVE_BENEATH).
Status open_beneath(int root, const std::string& path, int flags, mode_t mode, Fd& out);

/// What a resumable partial file is a copy of. A partial is continued only for the same source:
/// the same peer and path (`source`), size, mtime and block size.
struct ResumeKey {
  std::string source;
  std::uint64_t size = 0;
  std::int64_t mtime_ns = 0;
  std::uint32_t block_size = 0;
  bool operator==(const ResumeKey&) const = default;
};

/// The record kept beside a partial file: its source and the prefix of it that is written and
/// was verified, block by block, when it arrived.
struct ResumeRecord {
  ResumeKey key;
  std::uint64_t prefix = 0;
};

/// Longest source a record names (a peer's address and a path).
inline constexpr std::size_t max_record_source = 8192;
inline constexpr std::string_view partial_suffix = ".xdfs-partial";
inline constexpr std::string_view record_suffix = ".xdfs-resume";

/// A record's bytes: magic, the key, the prefix, then the SHA-256 of all of it.
std::vector<std::uint8_t> encode_record(const ResumeRecord& r);
/// The record, or none with why in words (truncated, corrupt, not whole blocks).
std::optional<ResumeRecord> decode_record(std::span<const std::uint8_t> b, std::string* why = nullptr);
/// ".NAME.xdfs-partial" and ".NAME.xdfs-resume" (a NAME over 200 bytes: its first 183 bytes, '~'
/// and 16 hex digits of its SHA-256, so that no two names share them).
std::string partial_name(const std::string& name);
std::string record_name(const std::string& name);

/// A file being received: created under a temporary name beside its final name and renamed
/// into place only by commit(). Destroying it without commit() removes the temporary file, so
/// no partial file ever sits under the final name and an existing file stays untouched.
class PendingFile {
public:
  PendingFile() = default;
  ~PendingFile() { discard(); }
  PendingFile(PendingFile&& o) noexcept;
  PendingFile& operator=(PendingFile&& o) noexcept;
  PendingFile(const PendingFile&) = delete;
  PendingFile& operator=(const PendingFile&) = delete;

  /// Creates the temporary file for `name` inside the open directory `dir` (taking ownership
  /// of `dir`). Refuses when `name` exists and is not a regular file.
  static Status create(Fd dir, const std::string& name, const std::string& tag, PendingFile& out);

  int fd() const noexcept { return fd_.get(); }
  /// The directory it is written in.
  int dir() const noexcept { return dir_.get(); }
  const std::string& temp_name() const noexcept { return temp_; }
  const std::string& final_name() const noexcept { return name_; }
  bool active() const noexcept { return static_cast<bool>(fd_); }

  /// A resumable partial file for `name` in `dir` (".NAME.xdfs-partial", opened for reading
  /// and writing and locked): `found` is its record when there is one that checks out (the
  /// caller compares its key with the source's and calls restart() if they differ); a record
  /// that is truncated, corrupt or counts more than the file holds is discarded, and `notice`
  /// says so in one line. `busy`: another transfer holds it, or the name holds something that
  /// is not one of ours (not a regular file, or one without a record): nothing is opened or
  /// changed, the caller writes a temporary file instead.
  static Status open_resumable(Fd dir, const std::string& name, PendingFile& out, std::optional<ResumeRecord>& found,
                               std::string& notice, bool& busy);
  /// The file to receive `name` in `dir`: with `resumable`, the resumable partial file as
  /// open_resumable() gives it; when that is busy (or not wanted), a temporary file as create()
  /// makes. resumable() then tells which it is.
  static Status open(Fd dir, const std::string& name, const std::string& tag, bool resumable, PendingFile& out,
                     std::optional<ResumeRecord>& found, std::string& notice);
  bool resumable() const noexcept { return resumable_; }
  /// Empties the partial file and drops its record (the source changed).
  void restart() noexcept;
  /// The source that the records written from now on name; a partial file with nothing
  /// recorded yet gets its record now (counting 0 bytes): what marks it as a partial file.
  void set_key(ResumeKey key);
  /// The file's first `prefix` bytes are written and verified: records that beside the file
  /// (a temporary name, then renamed). From the disk thread: nothing else changes the file's
  /// state meanwhile.
  void save(std::uint64_t prefix) noexcept;
  /// The prefix the record on disk counts.
  std::uint64_t saved() const noexcept { return saved_.load(); }
  /// After a failure that may be resumed: leaves a resumable partial file and its record where
  /// they are (true), or removes the file like discard() when nothing of it is recorded.
  bool keep() noexcept;

  /// Checks the size, optionally fsyncs, renames into place (a record goes with it).
  Status commit(std::uint64_t expected_size, bool sync);
  /// Removes the temporary file, and a resumable one's record (idempotent).
  void discard() noexcept;

private:
  Fd dir_;
  Fd fd_;
  std::string name_;
  std::string temp_;
  bool resumable_ = false;
  ResumeKey key_;
  std::atomic<std::uint64_t> saved_{0};
  bool write_record(std::uint64_t count) noexcept;
};

/// Whether `bytes` more fit on the file system of the open directory `dir` (its space available
/// to unprivileged users); disk_full naming `what` and both figures if not.
Status check_room(int dir, std::uint64_t bytes, const std::string& what);
/// Bytes an unprivileged writer may still put on the file system of `dir`; nullopt if it cannot
/// tell.
std::optional<std::uint64_t> room(int dir);

/// Removes, anywhere below the directory `root` (never following a symlink), the temporary
/// files (".NAME.xdfs-TAG.part") whose TAG starts with `tag_prefix`. Stops early once *stop is
/// set. Returns how many went.
std::size_t sweep_temp_files(int root, const std::string& tag_prefix, const std::atomic<bool>* stop = nullptr);

/// Removes, anywhere below the directory `root` (never following a symlink), the resumable
/// partial files and their records that nothing has written for `max_age` and no transfer
/// holds. Stops early once *stop is set. Returns how many partial files went.
std::size_t sweep_partials(int root, std::chrono::seconds max_age, const std::atomic<bool>* stop = nullptr);

/// A file's mtime in nanoseconds since the epoch.
inline std::int64_t mtime_ns(const struct ::stat& st) noexcept {
  return static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

/// The process's umask (read once, without changing it).
mode_t process_umask() noexcept;

/// What one session (or one local copy) made under its root, directories and files, each by its
/// identity (device, inode) and its path: the entries whose modes its peer may set. A name
/// that now holds something else (removed, another renamed onto it) no longer matches.
/// Bounded: past max_bytes of paths it records nothing more (what it made then keeps the mode it
/// was made with). Thread-safe.
class Made {
public:
  explicit Made(std::size_t max_bytes = std::size_t(32) << 20) : max_bytes_(max_bytes) {}
  /// Records what `path` (relative to the root, normalized by the caller) is now: `name` in `dir`.
  void add(int dir, const std::string& name, const std::string& path);
  void add(const struct ::stat& st, const std::string& path);
  bool has(const struct ::stat& st, const std::string& path) const;
  /// The form paths are recorded in: no trailing slash, no leading "./", "." for the root.
  static std::string key(const std::string& path);

private:
  std::size_t max_bytes_;
  std::size_t bytes_ = 0;
  mutable std::mutex mu_;
  std::set<std::tuple<std::uint64_t, std::uint64_t, std::string>> made_;
};

/// "dir/name" -> ("dir", "name"); "name" -> (".", "name").
std::pair<std::string, std::string> split_parent(const std::string& path);

/// The temporary name a file is written under before it is renamed into place: a dot-name that
/// says what it is, ".NAME.xdfs-TAG.part" (NAME cut to 200 bytes), never taken for a finished file.
std::string temp_name(const std::string& name, const std::string& tag);

}  // namespace xdfs::files
