#include "xdfs/files.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

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

Status check_room(int dir, std::uint64_t bytes, const std::string& what) {
  struct statvfs fs {};
  if (::fstatvfs(dir, &fs) != 0) return Status::ok();  // cannot tell: the writes will say
  const std::uint64_t avail = static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize;
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

std::size_t sweep_dir(int dir, const std::string& tag_prefix, const std::atomic<bool>* stop, int depth) {
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
    } else if ((e->d_type == DT_REG || e->d_type == DT_UNKNOWN) && is_temp_of(e->d_name, tag_prefix)) {
      struct stat st {};
      if (::fstatat(dir, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode) &&
          ::unlinkat(dir, e->d_name, 0) == 0)
        ++removed;
    } else if (e->d_type == DT_UNKNOWN) {
      subdirs.emplace_back(e->d_name);  // opened below with O_DIRECTORY: a non-directory fails
    }
  }
  ::closedir(d);
  for (const auto& name : subdirs) {
    if (stop && stop->load(std::memory_order_relaxed)) break;
    Fd sub(::openat(dir, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (sub) removed += sweep_dir(sub.get(), tag_prefix, stop, depth + 1);
  }
  return removed;
}

}  // namespace

std::size_t sweep_temp_files(int root, const std::string& tag_prefix, const std::atomic<bool>* stop) {
  Fd top(::openat(root, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  return top ? sweep_dir(top.get(), tag_prefix, stop, 0) : 0;
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
    : dir_(std::move(o.dir_)), fd_(std::move(o.fd_)), name_(std::move(o.name_)), temp_(std::move(o.temp_)) {}

PendingFile& PendingFile::operator=(PendingFile&& o) noexcept {
  if (this != &o) {
    discard();
    dir_ = std::move(o.dir_);
    fd_ = std::move(o.fd_);
    name_ = std::move(o.name_);
    temp_ = std::move(o.temp_);
  }
  return *this;
}

Status PendingFile::create(Fd dir, const std::string& name, const std::string& tag, PendingFile& out) {
  if (name.empty() || name == "." || name == "..") return {errc::is_directory, "'" + name + "' names a directory"};
  struct stat st {};
  if (::fstatat(dir.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
    if (S_ISDIR(st.st_mode)) return {errc::is_directory, "'" + name + "' is a directory"};
    // Renaming over a symlink would be harmless, but a name that points elsewhere is refused
    // as the escape it usually is.
    if (S_ISLNK(st.st_mode)) return {errc::path_escape, "'" + name + "' is a symlink"};
    if (!S_ISREG(st.st_mode)) return {errc::not_regular_file, "'" + name + "' exists and is not a regular file"};
  } else if (errno != ENOENT) {
    return Status::from_errno(errno, "'" + name + "'");
  }
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

Status PendingFile::commit(std::uint64_t expected_size, bool sync) {
  struct stat st {};
  if (::fstat(fd_.get(), &st) != 0) return Status::from_errno(errno, "stat '" + temp_ + "'");
  if (static_cast<std::uint64_t>(st.st_size) != expected_size)
    return {errc::size_mismatch, "'" + name_ + "' has " + std::to_string(st.st_size) + " bytes, expected " +
                                     std::to_string(expected_size)};
  if (sync && ::fdatasync(fd_.get()) != 0) return Status::from_errno(errno, "fdatasync '" + temp_ + "'");
  if (::renameat(dir_.get(), temp_.c_str(), dir_.get(), name_.c_str()) != 0)
    return Status::from_errno(errno, "rename '" + temp_ + "' to '" + name_ + "'");
  fd_.reset();
  temp_.clear();
  return Status::ok();
}

void PendingFile::discard() noexcept {
  if (!temp_.empty() && dir_) ::unlinkat(dir_.get(), temp_.c_str(), 0);
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
