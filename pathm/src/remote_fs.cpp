#include "xdfs/remote_fs.hpp"

#include <fcntl.h>
#include <sys/stat.h>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#include "xdfs/files.hpp"

namespace xdfs {

struct RemoteFs::Impl {
  std::unique_ptr<Session> own;
  Session* session = nullptr;
  FileTransfers transfers;
  std::unique_ptr<pathm::PathClient> client;  // null between path operations
  // Keep-alives between calls.
  std::thread keeper;
  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  bool closed = false;

  void start() {
    stopping = false;
    wire::Negotiation n;
    n.mode = Mode::path;
    n.remote_path = ".";
    const auto reply = session->begin(n);
    const auto& opt = session->options();
    try {
      client = std::make_unique<pathm::PathClient>(session->io(), session->channels(), reply.block_size, opt.cancel,
                                               opt.idle_timeout);
      if (opt.keep_alive.count() > 0) start_keeper(opt.keep_alive);
    } catch (...) {
      // The session closes its channels while the client (whose reads they hold) still exists.
      session->end_operation(false);
      run_ready();
      client.reset();
      throw;
    }
  }

  void start_keeper(std::chrono::milliseconds every) {
    {
      keeper = std::thread([this, every] {
        std::unique_lock lk(mu);
        while (!cv.wait_for(lk, every, [this] { return stopping; })) {
          lk.unlock();
          try {
            client->keep_alive();
          } catch (...) {  // (out of memory: the next call meets what failed; the process goes on)
          }
          lk.lock();
        }
      });
    }
  }

  void stop_keeper() {
    {
      std::lock_guard lk(mu);
      stopping = true;
    }
    cv.notify_all();
    if (keeper.joinable()) keeper.join();
  }

  // Ends the running path operation, if any; the session stays (unless it failed). Null when it
  // ended cleanly; otherwise why it did not (the path client's own failure where it has one).
  std::exception_ptr end_path() {
    if (!client) return nullptr;
    stop_keeper();
    bool ok = false;
    std::exception_ptr why;
    try {
      ok = client->close();
      if (!ok) {
        if (auto f = client->failure()) throw TransferError(*f);
        throw TransferError(errc::peer_aborted, "the path operation did not end on every channel", false);
      }
    } catch (...) {
      // A handler threw, or the operation failed: the session is over (below).
      why = std::current_exception();
    }
    // The session takes its channels back (or closes them) while the client still exists: what
    // the loop still holds for it runs first. The client goes whatever happens.
    struct Drop {
      std::unique_ptr<pathm::PathClient>& c;
      ~Drop() { c.reset(); }
    } drop{client};
    session->end_operation(ok);
    run_ready();
    return why;
  }

  // What the loop has ready for the path client (its cancelled reads and timers) runs while the
  // client still exists: this thread runs the loop between calls.
  void run_ready() noexcept {
    // A completion that throws stops poll(): go on until everything ready has run.
    for (int k = 0; k < 1000; ++k) {
      try {
        session->io().restart();
        session->io().poll();
        return;
      } catch (...) {
      }
    }
  }

  pathm::PathClient& path() {
    if (closed) throw TransferError(errc::state_violation, "the RemoteFs is closed", false);
    if (!client && !session->usable())
      throw TransferError(errc::session_ended, "an earlier failure ended this session", false);
    if (!client) start();
    return *client;
  }

  // One file as a transfer of its own, between path operations. Afterwards the path operation
  // starts again at once, so that keep-alives hold an idle RemoteFs open as before.
  template <class Transfer>
  std::uint64_t transfer(const Transfer& t, const char* what, const std::string& from, const std::string& to) {
    if (!t) throw TransferError(errc::not_supported, std::string("this RemoteFs has no file ") + what +
                                                         " (give it xdfs::file_transfers())",
                                false);
    if (closed) throw TransferError(errc::state_violation, "the RemoteFs is closed", false);
    if (auto why = end_path()) std::rethrow_exception(why);
    std::uint64_t bytes = 0;
    try {
      bytes = t(*session, from, to);
    } catch (...) {
      restart();
      throw;
    }
    restart();
    return bytes;
  }

  // The next path operation, when the session can carry one; a failure here is the next path
  // call's to report (the transfer before it is done either way).
  void restart() noexcept {
    if (closed || client || !session->usable()) return;
    try {
      start();
    } catch (...) {
    }
  }
};

RemoteFs::RemoteFs(const Endpoint& server, const SessionOptions& options, FileTransfers transfers)
    : impl_(std::make_unique<Impl>()) {
  impl_->own = std::make_unique<Session>(server, options);
  impl_->session = impl_->own.get();
  impl_->transfers = std::move(transfers);
  impl_->start();
}

RemoteFs::RemoteFs(Session& session, FileTransfers transfers) : impl_(std::make_unique<Impl>()) {
  impl_->session = &session;
  impl_->transfers = std::move(transfers);
  impl_->start();
}

RemoteFs::~RemoteFs() {
  try {
    close();
  } catch (...) {
  }
}

pathm::PathClient* RemoteFs::operator->() { return &impl_->path(); }
pathm::PathClient& RemoteFs::client() { return impl_->path(); }
Session& RemoteFs::session() noexcept { return *impl_->session; }
bool RemoteFs::remote_error() const noexcept { return impl_->client && impl_->client->remote_error(); }

std::uint64_t RemoteFs::upload(const std::string& local, const std::string& remote) {
  return impl_->transfer(impl_->transfers.upload, "uploads", local, remote);
}

std::uint64_t RemoteFs::download(const std::string& remote, const std::string& local) {
  return impl_->transfer(impl_->transfers.download, "downloads", remote, local);
}

void RemoteFs::close() {
  if (impl_->closed) return;
  impl_->closed = true;
  auto why = impl_->end_path();
  if (impl_->own) impl_->own->close();
  if (why) std::rethrow_exception(why);
}

namespace pathm {
namespace {

std::string join(const std::string& base, const std::string& rel) {
  std::string b = base;
  while (!b.empty() && b.back() == '/') b.pop_back();
  if (b.empty() || b == ".") return rel;
  return b + "/" + rel;
}

// A path operation of a tree copy. Its failures say whether the server reported them. Returns
// why its end failed, if it did (which ends the session).
std::optional<TreeFailure> path_part(Session& session, const std::function<void(PathClient&)>& run) {
  RemoteFs fs(session);
  try {
    run(fs.client());
  } catch (const TreeError&) {
    throw;
  } catch (const TransferError&) {
    throw;
  } catch (const Error& e) {
    throw TransferError(e.code(), e.context(), fs.remote_error());
  }
  // Every call above had its answer: what was copied is copied. An operation that then does not
  // end cleanly ends the session, which the tree's next part sees (it names what it could not
  // copy) rather than losing the result here.
  try {
    fs.close();
  } catch (const Error& e) {
    return TreeFailure{"", e.code(), e.context(), fs.remote_error()};
  }
  return std::nullopt;
}

// The path part of a tree copy; the entries it could not copy are kept, and the large files
// still go.
TreeResult tree_part(Session& session, const std::function<TreeResult(PathClient&)>& copy) {
  TreeResult r;
  auto ended = path_part(session, [&](PathClient& c) {
    try {
      r = copy(c);
    } catch (const TreeError& e) {
      r = e.result();
    }
  });
  if (ended && !r.session_failure) r.session_failure = ended;
  return r;
}

// Where a large file of a download goes. Its path is the server's: it must be relative and stay
// beneath the local tree (no "..", no symlink out of it, as path mode's own writes), and the
// name there must be a regular file or nothing (never a symlink, device or FIFO, which a
// download would write through). `dir` holds the directory; the path returned names it by its
// descriptor, so nothing can swap it while the file is written.
std::string download_target(int root, const std::string& rel, files::Fd& dir) {
  if (auto st = files::check_relative_path(rel); !st) throw TransferError(st.code, st.message, true);
  const auto [parent, name] = files::split_parent(rel);
  if (auto st = files::open_beneath(root, parent, O_PATH | O_DIRECTORY | O_CLOEXEC, 0, dir); !st)
    throw TransferError(st.code, st.message, false);
  struct stat sb {};
  if (::fstatat(dir.get(), name.c_str(), &sb, AT_SYMLINK_NOFOLLOW) == 0 && !S_ISREG(sb.st_mode))
    throw TransferError(S_ISDIR(sb.st_mode) ? errc::is_directory : errc::not_regular_file,
                        "'" + rel + "' exists here and is not a regular file", false);
  return "/proc/self/fd/" + std::to_string(dir.get()) + "/" + name;
}

// The large files, one transfer each; those copied are kept in `done`. A failure that leaves
// the session usable fails its file only; one that ends the session fails its file and names
// every file after it as not copied.
void large_part(Session& session, const LargeFiles& large, const std::string& from_base, const std::string& to_base,
                int local_root, bool up, const TreeOptions& o, const CopyFile& copy, TreeResult& r,
                std::vector<Entry>& done) {
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& f : large.files) {
    try {
      const std::string from = up ? from_base + "/" + f.path : join(from_base, f.path);
      files::Fd dir;  // download: the destination's directory, held while the file is written
      const std::string to = up ? join(to_base, f.path) : download_target(local_root, f.path, dir);
      const std::uint64_t bytes = copy(from, to);
      // Downloaded here by this copy: its mode is the copy's to set (below, with the directories').
      if (!up && large.made) large.made->add(dir.get(), files::split_parent(f.path).second, files::Made::key(f.path));
      ++r.files;
      ++r.large_files;
      r.bytes += bytes;
      r.large_bytes += bytes;
      done.push_back(f);
      if (o.progress) o.progress({r.files, r.bytes, large.files_total, large.bytes_total, true});
    } catch (const TransferError& e) {
      r.failures.push_back({f.path, e.code(), e.context(), e.remote()});
      if (!session.usable()) {
        if (!r.session_failure) r.session_failure = r.failures.back();
        for (const auto* g = &f + 1; g != large.files.data() + large.files.size(); ++g)
          r.failures.push_back({g->path, errc::peer_aborted, "not copied: the session ended", false});
        break;
      }
    }
  }
  r.large_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Whether the session can carry the large files after the path part; if it ended there (the
// peer did not end the path operation cleanly), each of them is named as not copied.
bool still_usable(Session& session, const LargeFiles& large, TreeResult& r) {
  if (session.usable()) return true;
  for (const auto& f : large.files)
    r.failures.push_back({f.path, errc::peer_aborted, "not copied: the session ended after the path operation", false});
  return false;
}

TreeResult finish(TreeResult r) {
  if (!r.failures.empty()) throw TreeError(std::move(r));
  return r;
}

}  // namespace

TreeResult upload_tree(Session& session, const std::string& local, const std::string& remote, const TreeOptions& o,
                       const CopyFile& copy) {
  LargeFiles large;
  large.threshold = copy ? o.large_file : 0;
  TreeResult r = tree_part(session, [&](PathClient& c) { return c.upload_tree(local, remote, o, &large); });
  if (large.files.empty() || !still_usable(session, large, r)) return finish(std::move(r));
  std::vector<Entry> done;
  large_part(session, large, local, remote, -1, true, o, copy, r, done);
  // Their modes and mtimes, then the directories' (which the large files' renames touched); a
  // session that ended with a large file cannot set them (its files are named above).
  done.insert(done.end(), large.dirs.begin(), large.dirs.end());
  if (session.usable())
    if (auto ended = path_part(session, [&](PathClient& c) { c.set_attrs(remote, done, r); }); ended && !r.session_failure)
      r.session_failure = ended;
  return finish(std::move(r));
}

TreeResult download_tree(Session& session, const std::string& remote, const std::string& local,
                         const TreeOptions& o, const CopyFile& copy) {
  LargeFiles large;
  large.threshold = copy ? o.large_file : 0;
  TreeResult r = tree_part(session, [&](PathClient& c) { return c.download_tree(remote, local, o, &large); });
  if (large.files.empty() || !still_usable(session, large, r)) return finish(std::move(r));
  files::Fd root(::open(local.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!root) {
    const auto st = files::Status::from_errno(errno, "open '" + local + "'");
    throw Error(st.code, st.message);
  }
  std::vector<Entry> done;
  large_part(session, large, remote, local, root.get(), false, o, copy, r, done);
  // The same directories count as made by this copy as in its path part: only theirs get modes.
  TreeWriter writer(root.get(), download_tag(), o.fsync, 1, 1, files::process_umask(), 0, large.made);
  std::unordered_set<std::string> named;
  for (const auto* v : {&done, &large.dirs})
    for (const auto& e : *v)
      if (auto st = writer.set_attrs(e); !st && named.insert(e.path).second)
        r.failures.push_back({e.path, st.code, st.message, false});
  return finish(std::move(r));
}

}  // namespace pathm

}  // namespace xdfs
