#include "xdfs/files.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <functional>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#include "xdfs/manifest.hpp"
#include "xdfs/wire.hpp"

namespace xdfs::files {

void Fd::reset() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Status Status::from_errno(int err, const std::string& what) {
  return {errc_from_errno(err), what + ": " + std::strerror(err)};
}

Status check_relative_path(const std::string& path) {
  if (path.empty()) return {errc::bad_argument, "empty path"};
  if (path.size() > wire::max_path_bytes) return {errc::bad_argument, "path longer than 4096 bytes"};
  if (path.find('\0') != std::string::npos) return {errc::bad_argument, "path contains a NUL byte"};
  if (path.front() == '/') return {errc::path_escape, "absolute path '" + path + "'"};
  std::size_t start = 0;
  while (start <= path.size()) {
    auto end = path.find('/', start);
    if (end == std::string::npos) end = path.size();
    if (path.compare(start, end - start, "..") == 0 && end - start == 2)
      return {errc::path_escape, "'..' component in '" + path + "'"};
    start = end + 1;
  }
  return Status::ok();
}

Status open_beneath(int root, const std::string& path, int flags, mode_t mode, Fd& out) {
  open_how how{};
  how.flags = static_cast<std::uint64_t>(flags | O_CLOEXEC);
  how.mode = (flags & O_CREAT) ? mode : 0;
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
  // EAGAIN: a rename or mount raced the resolution, which the kernel then refuses to vouch for.
  // Retried, but not for ever: a peer renaming in a loop must not keep a thread spinning here.
  constexpr int attempts = 64;
  long fd = -1;
  for (int i = 0; i < attempts; ++i) {
    fd = ::syscall(SYS_openat2, root, path.c_str(), &how, sizeof how);
    if (fd >= 0 || (errno != EINTR && errno != EAGAIN)) break;
  }
  if (fd < 0) {
    const int err = errno;
    if (err == EXDEV) return {errc::path_escape, "'" + path + "' resolves outside the root (symlink)"};
    if (err == EAGAIN)
      return {errc::io_error, "'" + path + "': renames kept racing its lookup (" + std::to_string(attempts) + " tries)"};
    return Status::from_errno(err, "'" + path + "'");
  }
  out = Fd(static_cast<int>(fd));
  return Status::ok();
}

std::optional<std::uint64_t> room(int dir) {
  struct statvfs fs {};
  if (::fstatvfs(dir, &fs) != 0) return std::nullopt;
  return static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize;
}

Status check_room(int dir, std::uint64_t bytes, const std::string& what) {
  const auto free = room(dir);
  if (!free) return Status::ok();  // cannot tell: the writes will say
  const std::uint64_t avail = *free;
  if (bytes <= avail) return Status::ok();
  return {errc::disk_full, what + ": " + std::to_string(bytes) + " bytes do not fit, " + std::to_string(avail) +
                               " bytes are free"};
}

namespace {

bool is_temp_of(const char* name, const std::string& tag_prefix) {
  const std::string_view n(name);
  const std::string mark = ".xdfs-" + tag_prefix;
  return n.size() > mark.size() + 6 && n.front() == '.' && n.substr(n.size() - 5) == ".part" &&
         n.find(mark) != std::string_view::npos;
}

// Walks the tree below `dir` (never following a symlink) and calls `take(dir, name)` for each
// regular file (or entry of unknown type) not a directory; counts those it says it removed.
std::size_t sweep_dir(int dir, const std::function<bool(int, const char*)>& take, const std::atomic<bool>* stop,
                      int depth) {
  if (depth > 256) return 0;
  const int fd = ::dup(dir);
  DIR* d = fd < 0 ? nullptr : ::fdopendir(fd);
  if (!d) {
    if (fd >= 0) ::close(fd);
    return 0;
  }
  std::size_t removed = 0;
  std::vector<std::string> subdirs;
  while (const dirent* e = ::readdir(d)) {
    if (stop && stop->load(std::memory_order_relaxed)) break;
    if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
    if (e->d_type == DT_DIR) {
      subdirs.emplace_back(e->d_name);
    } else if ((e->d_type == DT_REG || e->d_type == DT_UNKNOWN) && take(dir, e->d_name)) {
      ++removed;
    } else if (e->d_type == DT_UNKNOWN) {
      subdirs.emplace_back(e->d_name);  // opened below with O_DIRECTORY: a non-directory fails
    }
  }
  ::closedir(d);
  for (const auto& name : subdirs) {
    if (stop && stop->load(std::memory_order_relaxed)) break;
    Fd sub(::openat(dir, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (sub) removed += sweep_dir(sub.get(), take, stop, depth + 1);
  }
  return removed;
}

bool ends_with(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
}

// A resume record's first 16 bytes.
constexpr char record_magic[16] = {'x', 'D', 'F', 'S', '-', 'r', 'e', 's', 'u', 'm', 'e', '-', '1', '\n', 0, 0};

// "NAME" + from (which it ends with) -> "NAME" + to: a partial file's record and back.
std::string swap_suffix(std::string_view name, std::string_view from, std::string_view to) {
  return std::string(name.substr(0, name.size() - from.size())).append(to);
}

}  // namespace

std::size_t sweep_temp_files(int root, const std::string& tag_prefix, const std::atomic<bool>* stop) {
  Fd top(::openat(root, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!top) return 0;
  return sweep_dir(
      top.get(),
      [&](int dir, const char* name) {
        if (!is_temp_of(name, tag_prefix)) return false;
        struct stat st {};
        return ::fstatat(dir, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode) && ::unlinkat(dir, name, 0) == 0;
      },
      stop, 0);
}

std::size_t sweep_partials(int root, std::chrono::seconds max_age, const std::atomic<bool>* stop) {
  Fd top(::openat(root, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!top) return 0;
  const auto now = std::chrono::system_clock::now();
  return sweep_dir(
      top.get(),
      [&](int dir, const char* raw) {
        // A partial file goes with its record; each is judged by the later of the two mtimes
        // (the record is rewritten every second while the transfer runs).
        const std::string_view n(raw);
        if (n.size() > 1 && n.front() == '.' && ends_with(n, record_suffix)) {
          // A record whose partial file never came (killed in between) or went: once stale, and
          // if it is a record at all.
          const std::string partial = swap_suffix(n, record_suffix, partial_suffix);
          struct stat ps {}, rs {};
          if (::fstatat(dir, partial.c_str(), &ps, AT_SYMLINK_NOFOLLOW) == 0 ||
              ::fstatat(dir, raw, &rs, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(rs.st_mode) ||
              now - std::chrono::system_clock::time_point(std::chrono::seconds(rs.st_mtim.tv_sec)) < max_age)
            return false;
          Fd fd(::openat(dir, raw, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
          char magic[16];
          if (!fd || ::pread(fd.get(), magic, sizeof magic, 0) != sizeof magic || std::memcmp(magic, record_magic, sizeof magic) != 0)
            return false;
          ::unlinkat(dir, raw, 0);
          return false;  // not counted: no partial file went
        }
        if (n.empty() || n.front() != '.' || !ends_with(n, partial_suffix)) return false;
        const std::string partial(raw);
        const std::string record = swap_suffix(n, partial_suffix, record_suffix);
        struct stat ps {}, rs {};
        if (::fstatat(dir, partial.c_str(), &ps, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(ps.st_mode)) return false;
        // Only ours: a partial file with its record (one without is someone's file of that name).
        if (::fstatat(dir, record.c_str(), &rs, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(rs.st_mode)) return false;
        auto stale = [&](const struct stat& p, const struct stat& r) {
          const auto newest = std::max(p.st_mtim.tv_sec, r.st_mtim.tv_sec);
          return now - std::chrono::system_clock::time_point(std::chrono::seconds(newest)) >= max_age;
        };
        if (!stale(ps, rs)) return false;
        // A transfer that holds it (its lock) is not stale, whatever the clock says; one that
        // let it go just now wrote it just now (looked at again once locked).
        Fd fd(::openat(dir, partial.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
        if (!fd || ::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) return false;
        if (::fstat(fd.get(), &ps) != 0 || ::fstatat(dir, record.c_str(), &rs, AT_SYMLINK_NOFOLLOW) != 0 || !stale(ps, rs))
          return false;
        ::unlinkat(dir, record.c_str(), 0);
        return ::unlinkat(dir, partial.c_str(), 0) == 0;
      },
      stop, 0);
}

mode_t process_umask() noexcept {
  // /proc tells without the umask(2) round trip, which would race with threads creating files.
  static const mode_t mask = [] {
    if (FILE* f = std::fopen("/proc/self/status", "re")) {
      char line[256];
      while (std::fgets(line, sizeof line, f))
        if (std::strncmp(line, "Umask:", 6) == 0) {
          std::fclose(f);
          return static_cast<mode_t>(std::strtoul(line + 6, nullptr, 8) & 0777);
        }
      std::fclose(f);
    }
    const mode_t old = ::umask(022);
    ::umask(old);
    return old;
  }();
  return mask;
}

std::string temp_name(const std::string& name, const std::string& tag) {
  // (Appended, not concatenated: GCC 12 warns falsely on that, -Wrestrict, PR 105329.)
  std::string temp(1, '.');
  temp.append(name, 0, 200).append(".xdfs-").append(tag).append(".part");
  return temp;
}

std::pair<std::string, std::string> split_parent(const std::string& path) {
  auto slash = path.rfind('/');
  if (slash == std::string::npos) return {".", path};
  // (Built, not assigned from a literal: GCC 12 warns falsely on that, -Wrestrict, PR 105329.)
  return {slash == 0 ? std::string(1, '/') : path.substr(0, slash), path.substr(slash + 1)};
}

PendingFile::PendingFile(PendingFile&& o) noexcept
    : dir_(std::move(o.dir_)),
      fd_(std::move(o.fd_)),
      name_(std::move(o.name_)),
      temp_(std::move(o.temp_)),
      resumable_(std::exchange(o.resumable_, false)),
      key_(std::move(o.key_)),
      saved_(o.saved_.load()) {}

PendingFile& PendingFile::operator=(PendingFile&& o) noexcept {
  if (this != &o) {
    discard();
    dir_ = std::move(o.dir_);
    fd_ = std::move(o.fd_);
    name_ = std::move(o.name_);
    temp_ = std::move(o.temp_);
    resumable_ = std::exchange(o.resumable_, false);
    key_ = std::move(o.key_);
    saved_.store(o.saved_.load());
  }
  return *this;
}

namespace {

// A received file's final name in `dir`: free, or a regular file it may replace.
Status check_final_name(int dir, const std::string& name) {
  if (name.empty() || name == "." || name == "..") return {errc::is_directory, "'" + name + "' names a directory"};
  struct stat st {};
  if (::fstatat(dir, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
    if (S_ISDIR(st.st_mode)) return {errc::is_directory, "'" + name + "' is a directory"};
    // Renaming over a symlink would be harmless, but a name that points elsewhere is refused
    // as the escape it usually is.
    if (S_ISLNK(st.st_mode)) return {errc::path_escape, "'" + name + "' is a symlink"};
    if (!S_ISREG(st.st_mode)) return {errc::not_regular_file, "'" + name + "' exists and is not a regular file"};
  } else if (errno != ENOENT) {
    return Status::from_errno(errno, "'" + name + "'");
  }
  return Status::ok();
}

}  // namespace

Status PendingFile::create(Fd dir, const std::string& name, const std::string& tag, PendingFile& out) {
  if (auto st = check_final_name(dir.get(), name); !st) return st;
  std::string temp = files::temp_name(name, tag);
  int fd = ::openat(dir.get(), temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) return Status::from_errno(errno, "create '" + temp + "'");
  out.discard();
  out.dir_ = std::move(dir);
  out.fd_ = Fd(fd);
  out.name_ = name;
  out.temp_ = std::move(temp);
  return Status::ok();
}

namespace {

// ".NAME" cut to 200 bytes; a longer name ends in 16 hex digits of its SHA-256 instead, so that
// two names alike in their first 200 bytes never share a partial file (or its record).
std::string partial_stem(const std::string& name) {
  std::string p(1, '.');
  if (name.size() <= 200) return p.append(name);
  manifest::BlockHasher h;
  const auto d = h.digest(reinterpret_cast<const std::uint8_t*>(name.data()), name.size());
  return p.append(name, 0, 183).append(1, '~').append(manifest::hex(d).substr(0, 16));
}

}  // namespace

std::string partial_name(const std::string& name) { return partial_stem(name).append(partial_suffix); }

std::string record_name(const std::string& name) { return partial_stem(name).append(record_suffix); }

namespace {

constexpr std::size_t record_fixed = 16 + 8 + 8 + 4 + 4 + 8;  // magic, size, mtime, block, source length, prefix

void put_le(std::vector<std::uint8_t>& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}

std::uint64_t get_le(const std::uint8_t* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= std::uint64_t(p[i]) << (8 * i);
  return v;
}

}  // namespace

// Writes a record to a fresh temporary name, then renames it over `rec` in `dir`: a reader sees
// the old record or the new one. Whatever was at the temporary name (a FIFO, a link) goes first.
bool write_record_at(int dir, const std::string& rec, const ResumeRecord& r) noexcept;

// What a partial file's record says before its source is known: nothing kept, no source.
const ResumeRecord placeholder_record{ResumeKey{"", 0, 0, 1}, 0};

std::vector<std::uint8_t> encode_record(const ResumeRecord& r) {
  std::vector<std::uint8_t> out(record_magic, record_magic + 16);
  put_le(out, r.key.size, 8);
  put_le(out, static_cast<std::uint64_t>(r.key.mtime_ns), 8);
  put_le(out, r.key.block_size, 4);
  put_le(out, r.key.source.size(), 4);
  put_le(out, r.prefix, 8);
  out.insert(out.end(), r.key.source.begin(), r.key.source.end());
  manifest::BlockHasher h;
  const auto d = h.digest(out.data(), out.size());
  out.insert(out.end(), d.begin(), d.end());
  return out;
}

std::optional<ResumeRecord> decode_record(std::span<const std::uint8_t> b, std::string* why) {
  auto no = [&](const char* what) -> std::optional<ResumeRecord> {
    if (why) *why = what;
    return std::nullopt;
  };
  if (b.size() < record_fixed + manifest::digest_size) return no("it is truncated");
  if (std::memcmp(b.data(), record_magic, 16) != 0) return no("it is not a resume record");
  const std::uint64_t source_len = get_le(b.data() + 36, 4);
  if (source_len > max_record_source || b.size() != record_fixed + source_len + manifest::digest_size)
    return no(b.size() < record_fixed + source_len + manifest::digest_size ? "it is truncated" : "its length is wrong");
  manifest::BlockHasher h;
  const auto d = h.digest(b.data(), b.size() - manifest::digest_size);
  if (std::memcmp(d.data(), b.data() + b.size() - manifest::digest_size, d.size()) != 0)
    return no("its checksum does not match (corrupt)");
  ResumeRecord r;
  r.key.size = get_le(b.data() + 16, 8);
  r.key.mtime_ns = static_cast<std::int64_t>(get_le(b.data() + 24, 8));
  r.key.block_size = static_cast<std::uint32_t>(get_le(b.data() + 32, 4));
  r.prefix = get_le(b.data() + 40, 8);
  r.key.source.assign(reinterpret_cast<const char*>(b.data()) + record_fixed, source_len);
  if (r.key.block_size == 0 || r.prefix > r.key.size || (r.prefix % r.key.block_size != 0 && r.prefix != r.key.size))
    return no("its offset is not whole blocks of the file");
  return r;
}

Status PendingFile::open_resumable(Fd dir, const std::string& name, PendingFile& out,
                                   std::optional<ResumeRecord>& found, std::string& notice, bool& busy) {
  found.reset();
  busy = false;
  if (auto st = check_final_name(dir.get(), name); !st) return st;
  const std::string partial = partial_name(name);
  const std::string rec = record_name(name);
  // Ours: made now, or one with a record beside it (every partial file gets one before its
  // transfer starts). A file under that name without a record is someone else's (an upload of
  // that name, a user's file): it is left alone, and so is anything that is not a regular file;
  // the transfer then writes a temporary file (busy), as when another transfer holds it.
  // A fresh one's record comes first (a placeholder naming no source, until set_key), so that
  // no partial file of ours is ever without one, even if the process is killed in between.
  struct stat seen {};
  if (::fstatat(dir.get(), partial.c_str(), &seen, AT_SYMLINK_NOFOLLOW) != 0 && errno == ENOENT)
    (void)write_record_at(dir.get(), rec, placeholder_record);
  int fd = ::openat(dir.get(), partial.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0666);
  if (fd < 0 && errno == EEXIST) {
    struct stat rs {};
    if (::fstatat(dir.get(), rec.c_str(), &rs, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(rs.st_mode)) {
      busy = true;
      return Status::ok();
    }
    fd = ::openat(dir.get(), partial.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  }
  if (fd < 0) {
    busy = true;
    return Status::ok();
  }
  Fd file(fd);
  struct stat ps {};
  // One transfer at a time writes a partial file: another one now gets a fresh temporary file.
  if (::fstat(file.get(), &ps) != 0 || !S_ISREG(ps.st_mode) || ::flock(file.get(), LOCK_EX | LOCK_NB) != 0) {
    busy = true;
    return Status::ok();
  }
  out.discard();
  out.dir_ = std::move(dir);
  out.fd_ = std::move(file);
  out.name_ = name;
  out.temp_ = partial;
  out.resumable_ = true;
  out.saved_.store(0);
  // The record, if any: read whole (it is small), trusted only once it checks out.
  Fd rfd(::openat(out.dir_.get(), rec.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (!rfd) {
    if (ps.st_size > 0) notice = "'" + partial + "' has no resume record: starting over";
    out.restart();
    return Status::ok();
  }
  std::vector<std::uint8_t> buf(record_fixed + max_record_source + manifest::digest_size + 1);
  const ssize_t n = ::pread(rfd.get(), buf.data(), buf.size(), 0);
  std::string why;
  auto r = n < 0 ? std::nullopt : decode_record(std::span<const std::uint8_t>(buf.data(), static_cast<std::size_t>(n)), &why);
  if (!r) {
    notice = "the resume record '" + rec + "' is discarded: " + (n < 0 ? std::string(std::strerror(errno)) : why);
  } else if (static_cast<std::uint64_t>(ps.st_size) < r->prefix) {
    notice = "the resume record '" + rec + "' is discarded: it counts " + std::to_string(r->prefix) +
             " bytes, its partial file has " + std::to_string(ps.st_size);
    r.reset();
  }
  if (!r || r->prefix == 0) {  // nothing recorded (a placeholder, or a transfer that ended early)
    out.restart();
    return Status::ok();
  }
  found = r;
  out.key_ = r->key;
  out.saved_.store(r->prefix);
  return Status::ok();
}

Status PendingFile::open(Fd dir, const std::string& name, const std::string& tag, bool resumable, PendingFile& out,
                         std::optional<ResumeRecord>& found, std::string& notice) {
  found.reset();
  if (resumable) {
    Fd again(::dup(dir.get()));  // open_resumable takes one; create() may need the other
    if (!again) return Status::from_errno(errno, "dup of the directory of '" + name + "'");
    bool busy = false;
    if (auto st = open_resumable(std::move(again), name, out, found, notice, busy); !st || !busy) return st;
  }
  return create(std::move(dir), name, tag, out);
}

void PendingFile::restart() noexcept {
  if (!resumable_ || !dir_) return;
  // The record first becomes a placeholder (never removed: a partial file of ours always has
  // one, whenever the process is killed), then the file is emptied.
  if (!write_record_at(dir_.get(), record_name(name_), placeholder_record)) ::unlinkat(dir_.get(), record_name(name_).c_str(), 0);
  [[maybe_unused]] int r = ::ftruncate(fd_.get(), 0);
  saved_.store(0);
}

void PendingFile::set_key(ResumeKey key) {
  key_ = std::move(key);
  // A fresh partial file gets its record at once: the mark that it is one of ours.
  if (resumable_ && saved_.load() == 0) (void)write_record(0);
}

bool PendingFile::write_record(std::uint64_t count) noexcept {
  return write_record_at(dir_.get(), record_name(name_), ResumeRecord{key_, count});
}

bool write_record_at(int dir, const std::string& rec, const ResumeRecord& r) noexcept {
  try {
    const auto bytes = encode_record(r);
    const std::string tmp = rec + ".tmp";
    ::unlinkat(dir, tmp.c_str(), 0);
    Fd t(::openat(dir, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0600));
    if (!t) return false;
    if (::write(t.get(), bytes.data(), bytes.size()) != static_cast<ssize_t>(bytes.size()) ||
        ::renameat(dir, tmp.c_str(), dir, rec.c_str()) != 0) {
      ::unlinkat(dir, tmp.c_str(), 0);
      return false;
    }
    return true;
  } catch (...) {
    return false;  // no memory for the record: the previous one stands
  }
}

void PendingFile::save(std::uint64_t prefix) noexcept {
  // The disk thread wrote every byte the record counts before it calls this: a process killed
  // at any moment (this one, or the peer's) leaves a record that counts only bytes in the file.
  // Neither file nor record is synced (waiting for the range to reach the disk at each record
  // cost an upload 18% of its rate here, an fdatasync a download 20%): after a crash of the
  // machine, a record that counts bytes its disk lost is caught by the whole-file digest at the
  // end (the kept prefix is hashed again, never trusted), and the transfer starts over.
  if (!resumable_ || !fd_) return;
  if (prefix > saved_.load() && write_record(prefix)) saved_.store(prefix);
}

bool PendingFile::keep() noexcept {
  if (!resumable_ || saved_.load() == 0) {
    discard();
    return false;
  }
  temp_.clear();
  fd_.reset();
  dir_.reset();
  resumable_ = false;
  return true;
}

Status PendingFile::commit(std::uint64_t expected_size, bool sync) {
  struct stat st {};
  if (::fstat(fd_.get(), &st) != 0) return Status::from_errno(errno, "stat '" + temp_ + "'");
  if (static_cast<std::uint64_t>(st.st_size) != expected_size)
    return {errc::size_mismatch, "'" + name_ + "' has " + std::to_string(st.st_size) + " bytes, expected " +
                                     std::to_string(expected_size)};
  if (sync && ::fdatasync(fd_.get()) != 0) return Status::from_errno(errno, "fdatasync '" + temp_ + "'");
  // The name still holds the file written (nothing swapped another in under it meanwhile).
  struct stat at {};
  if (::fstatat(dir_.get(), temp_.c_str(), &at, AT_SYMLINK_NOFOLLOW) != 0 || at.st_dev != st.st_dev || at.st_ino != st.st_ino)
    return {errc::io_error, "'" + temp_ + "' was replaced while it was written"};
  if (::renameat(dir_.get(), temp_.c_str(), dir_.get(), name_.c_str()) != 0)
    return Status::from_errno(errno, "rename '" + temp_ + "' to '" + name_ + "'");
  if (resumable_) ::unlinkat(dir_.get(), record_name(name_).c_str(), 0);
  resumable_ = false;
  fd_.reset();
  temp_.clear();
  return Status::ok();
}

void PendingFile::discard() noexcept {
  if (resumable_ && dir_) ::unlinkat(dir_.get(), record_name(name_).c_str(), 0);
  if (!temp_.empty() && dir_) ::unlinkat(dir_.get(), temp_.c_str(), 0);
  resumable_ = false;
  temp_.clear();
  fd_.reset();
}

std::string Made::key(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  while (p.size() > 2 && p[0] == '.' && p[1] == '/') p.erase(0, 2);
  return p.empty() ? std::string(".") : p;
}

void Made::add(int dir, const std::string& name, const std::string& path) {
  struct stat st {};
  if (::fstatat(dir, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) add(st, path);
}

void Made::add(const struct stat& st, const std::string& path) {
  std::lock_guard lk(mu_);
  if (bytes_ + path.size() + 64 > max_bytes_) return;
  if (made_.emplace(static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino), path).second)
    bytes_ += path.size() + 64;
}

bool Made::has(const struct stat& st, const std::string& path) const {
  std::lock_guard lk(mu_);
  return made_.count({static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino), path}) != 0;
}

}  // namespace xdfs::files
