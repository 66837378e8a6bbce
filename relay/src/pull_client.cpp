// The pulling host's side (xduc get): a server of its own takes this host's place in the file's
// chain, which the master runs; a session to the master asks for the file and lasts until the
// master lets this host go (EOFR) or says why not (EXCEPTION). A lost session is tried again,
// and what was verified stays for the next place (its resume record is keyed by the master's
// key and the file's name, whoever feeds it).
//
// That server admits only the master's key, takes only relay places and the uploads that feed
// them (nothing is read from it), and its root is a staging directory of its own beside DST
// (".xdfs-pull-" and the name): what the master or an upstream sends lands there, and only the
// file, whole and with the digest the master gave, is renamed to its name in DST.
#include <fcntl.h>
#include <sys/resource.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <linux/magic.h>
#include <unistd.h>

#include <dirent.h>

#include <fmt/core.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "xdfs/detail/relay_fsm.hpp"
#include "xdfs/files.hpp"
#include "xdfs/manifest.hpp"
#include "xdfs/relay.hpp"
#include "xdfs/relay_registry.hpp"
#include "xdfs/session.hpp"
#include "xdfs/text.hpp"
#include "xdfs/xftsm/server_mode.hpp"

#include "forward.hpp"
#include "pack.hpp"

namespace xdfs {
namespace {

using Clock = std::chrono::steady_clock;

// Failures no other session to the master would change.
bool lasting(errc c) {
  return c == errc::no_such_file || c == errc::permission_denied || c == errc::path_escape || c == errc::is_directory ||
         c == errc::not_regular_file || c == errc::bad_argument || c == errc::auth_failed || c == errc::not_supported ||
         c == errc::disk_full || c == errc::bad_version || c == errc::insecure_key_file;
}

// A set's pack, its files copied out while it arrives, so that writing them out overlaps the
// transfer instead of following it (on a machine whose cores the chain leaves idle now and
// then). Each file is copied once the prefix of the pack whose every block this host's server
// verified (RelaySlot::written) holds it, from the file the uploads write, into a directory of
// the staging directory, named by the offset of its bytes in the pack; and only while the
// place has had one upload (RelaySlot::feeds), so the bytes copied are the pack's for good. The
// copies count only if that place made the pack whole (with the master's digest) and had no
// other upload: then unpack (which checks the whole pack first) renames them into place
// (relay_detail::Prestaged). Otherwise, and whenever the part fails, they are removed, never
// named in DST. The thread runs at a low priority (nice 10): it takes little from the chain,
// and a copy it did not make is made at the end as before.
struct EarlyUnpack {
  std::thread thread;
  std::atomic<bool> stop{false};
  std::string dir;  // staging/.xdfs-unpacking-N
  // Written by the thread; read once it is joined.
  std::shared_ptr<runtime::RelaySlot> slot;  // the place whose file it reads
  std::uint64_t feeds = 0;       // the slot's feeds when it began reading that file
  std::uint64_t upto = 0;        // every file entry ending at or below is copied (0: none)
  dev_t dev = 0;                 // the pack's file they came from
  ino_t ino = 0;
  void end() {
    stop.store(true);
    if (thread.joinable()) thread.join();
  }
  // Once ended: are its copies those of the whole pack at pack_fd? (Its place made it whole,
  // with one upload, the one it read from.)
  bool holds(int pack_fd) const {
    struct stat st {};
    if (!slot || upto == 0 || feeds != 1 || ::fstat(pack_fd, &st) != 0 || st.st_dev != dev || st.st_ino != ino)
      return false;
    std::lock_guard lock(slot->m);
    return slot->committed && slot->feeds.load() == 1;
  }
  // Ends it and removes its copies.
  void drop() {
    end();
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  }
  ~EarlyUnpack() { end(); }
};

void unpack_early(runtime::RelayRegistry& relays, const std::string& name, std::uint64_t size, EarlyUnpack& u) {
  // (Not SCHED_IDLE: it takes the place's lock now and then, which the server's threads wait for.)
  (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 10);  // (this thread's alone)
  files::Fd out, pack;
  std::uint64_t at = 0, entries = 0;
  bool v2 = false;
  // Starts over with the file the slot's upload writes now: nothing copied so far counts. False:
  // no more copying (a second upload came: its resume point may be below `written`).
  auto restart = [&]() -> bool {
    u.upto = 0;
    at = entries = 0;
    pack.reset();
    out.reset();
    std::error_code ignored;
    std::filesystem::remove_all(u.dir, ignored);  // (and a killed pull's)
    if (::mkdir(u.dir.c_str(), 0700) != 0) return false;
    out = files::Fd(::open(u.dir.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    std::lock_guard lock(u.slot->m);
    u.feeds = u.slot->feeds.load();
    if (u.feeds > 1) return false;
    if (!out || !u.slot->file) return static_cast<bool>(out);
    pack = files::Fd(::fcntl(u.slot->file.get(), F_DUPFD_CLOEXEC, 3));
    struct stat st {};
    if (!pack || ::fstat(pack.get(), &st) != 0) return false;
    u.dev = st.st_dev;
    u.ino = st.st_ino;
    return true;
  };
  auto same_feed = [&] { return u.slot->feeds.load() == u.feeds; };
  relay_detail::PackHeadBuffer head{};
  while (!u.stop.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (!u.slot && !(u.slot = relays.find_path(name))) continue;
    if (!out || !same_feed()) {  // (the first upload to attach is a new feed too)
      if (!restart()) return;
      if (!pack) continue;
    }
    const std::uint64_t verified = std::min(u.slot->written.load(), size);
    if (verified < at) continue;  // (another feed began just now: the next round starts over)
    if (at == 0) {
      if (verified < relay_detail::pack_magic.size()) continue;
      if (::pread(pack.get(), head.data(), relay_detail::pack_magic.size(), 0) !=
          static_cast<ssize_t>(relay_detail::pack_magic.size()))
        return;
      v2 = std::memcmp(head.data(), relay_detail::pack_magic_2.data(), relay_detail::pack_magic.size()) == 0;
      if (!v2 && std::memcmp(head.data(), relay_detail::pack_magic.data(), relay_detail::pack_magic.size()) != 0)
        return;  // (unpack names what is wrong)
      at = relay_detail::pack_magic.size();
    }
    // Every number is the pack's, not yet checked against the master's digest: bounded before
    // it is used; one out of bounds ends the copying here (unpack refuses the pack).
    std::uint64_t upto = u.upto;
    while (!u.stop.load() && entries < relay_detail::max_pack_files) {
      const auto h = relay_detail::read_pack_head(pack.get(), at, verified, head);
      if (h.read == relay_detail::PackHead::short_head || h.read == relay_detail::PackHead::short_path) break;  // (not yet)
      if (h.read != relay_detail::PackHead::ok) return;
      const std::uint64_t bytes = h.size, data = h.data;
      if (bytes > relay_detail::max_pack_file || bytes > size - data) return;
      if (bytes > verified - data) break;
      if (!v2 || (h.mode & S_IFMT) == S_IFREG) {  // (directories and symlinks: unpack's)
        const std::string copy = std::to_string(data);
        files::Fd f(::openat(out.get(), copy.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
        if (!f || !pathm::copy_exact(pack.get(), data, f.get(), 0, bytes, "the pack", copy)) return;
      }
      ++entries;
      at = data + bytes;
      upto = at;
    }
    // (What was copied counts only if no other upload or file came meanwhile.)
    if (same_feed()) u.upto = upto;
    if (entries >= relay_detail::max_pack_files) return;  // (unpack refuses more)
  }
}

// How a pull session ended.
struct Ending {
  enum { eofr, exception, lost } how = lost;
  wire::ExceptionHeader ex;
};

Ending await_end(Session& s, const std::function<void()>& every, const std::atomic<bool>* cancel) {
  auto& ch = *s.channels()[0];
  Ending e;
  bool over = false;
  std::vector<std::uint8_t> buf;
  ch.async_read_header([&](const xdsi::ErrorCode& ec, const wire::FrameHeader& h) {
    if (ec) {
      e.ex.message = ch.failure(ec, "master").message;
      over = true;
      return;
    }
    if (h.event == wire::ChannelEvent::eofr && h.length == 0) {
      e.how = Ending::eofr;
      over = true;
      return;
    }
    if (h.event != wire::ChannelEvent::exception) {
      e.ex.message = fmt::format("{} from the master in a pull", wire::to_string(h.event));
      over = true;
      return;
    }
    buf.resize(h.length);
    ch.async_read_payload(buf, [&](const xdsi::ErrorCode& ec2) {
      over = true;
      if (ec2) {
        e.ex.message = ch.failure(ec2, "master").message;
        return;
      }
      auto x = wire::decode_exception(buf);
      e.how = Ending::exception;
      e.ex = x ? *x : wire::ExceptionHeader{errc::protocol_error, "a malformed exception", 0, 0};
    });
  });
  bool cancelled = false;
  while (!over) {
    if (cancel && cancel->load() && !cancelled) {
      // The read still refers to what is here: it ends (aborted) before this returns.
      cancelled = true;
      ch.close();
    }
    s.io().restart();
    s.io().run_for(std::chrono::milliseconds(20));
    if (!every) continue;
    try {
      every();
    } catch (...) {
      // (Likewise: the read ends here before what failed goes on up.)
      ch.close();
      while (!over) {
        s.io().restart();
        s.io().run_for(std::chrono::milliseconds(20));
      }
      throw;
    }
  }
  if (cancelled) {
    e.how = Ending::exception;
    e.ex = wire::ExceptionHeader{errc::cancelled, "cancelled", 0, 0};
  }
  return e;
}

// Removes the pulling server's state directory (its authorized_keys, its run's marks) at the end.
struct StateDir {
  std::string path;
  ~StateDir() {
    std::error_code ignored;
    if (!path.empty()) std::filesystem::remove_all(path, ignored);
  }
};

// The staging directory's name for a file: stable, so a later pull of it goes on from what an
// earlier one verified (FNV-1a of the name: any name fits).
std::string staging_name(const std::string& name) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return fmt::format(".xdfs-pull-{:016x}", h);
}

// A set's parts of at most a pack's size wait in a directory of this pull's own on a memory
// file system, so that their bytes reach DST's disk once, as the files they hold, instead of
// twice (the part, then its files). It goes when the pull ends, however it ends: what was
// verified there is not kept for a later pull (a part is at most a pack). A pull holds a lock on
// its directory while it runs; one killed before its end leaves its directory unlocked, and the
// next pull of the same user there removes it.
struct MemoryStage {
  std::string path;
  files::Fd lock;
  MemoryStage() = default;
  MemoryStage(MemoryStage&&) = default;
  MemoryStage& operator=(MemoryStage&& o) noexcept {
    std::swap(path, o.path);
    std::swap(lock, o.lock);
    return *this;
  }
  ~MemoryStage() {
    std::error_code ignored;
    if (!path.empty()) std::filesystem::remove_all(path, ignored);
  }
};

// Empty (none: parts wait beside DST) where `under` is not a tmpfs of ours to use, or has less
// room than `room` bytes (a small /dev/shm, as containers have, would run out mid-part).
MemoryStage memory_stage(const std::string& under, std::uint64_t room) {
  MemoryStage m;
  struct statfs fs {};
  if (under.empty() || ::statfs(under.c_str(), &fs) != 0 || fs.f_type != TMPFS_MAGIC ||
      static_cast<std::uint64_t>(fs.f_bavail) < room / std::max<std::uint64_t>(fs.f_bsize, 1))
    return m;
  // A directory is made under a name the sweep passes over, locked, then given its name: so the
  // sweep never finds one of a live pull unlocked. One left under the first name (a pull killed
  // in between) is swept once a minute old.
  const std::string prefix = fmt::format(".xdfs-pull-{}-", ::geteuid());
  const std::string making = fmt::format(".xdfs-pulling-{}-", ::geteuid());
  if (DIR* d = ::opendir(under.c_str())) {
    std::vector<std::pair<std::string, files::Fd>> left;  // locked until removed
    const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
    while (auto* e = ::readdir(d)) {
      const std::string n = e->d_name;
      struct stat st {}, held {};
      const bool made = n.rfind(prefix, 0) == 0, half = n.rfind(making, 0) == 0;
      if ((!made && !half) || ::fstatat(::dirfd(d), n.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 ||
          !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid() || (half && now - st.st_mtime < 60))
        continue;
      files::Fd other(::openat(::dirfd(d), n.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
      if (other && ::fstat(other.get(), &held) == 0 && held.st_dev == st.st_dev && held.st_ino == st.st_ino &&
          ::flock(other.get(), LOCK_EX | LOCK_NB) == 0)
        left.emplace_back(under + "/" + n, std::move(other));
    }
    ::closedir(d);
    std::error_code ignored;
    for (const auto& [n, lock] : left) std::filesystem::remove_all(n, ignored);
  }
  std::string tmpl = under + "/" + making + "XXXXXX";
  if (!::mkdtemp(tmpl.data())) return m;
  files::Fd lock(::open(tmpl.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  const std::string named = under + "/" + prefix + tmpl.substr(tmpl.size() - 6);
  if (!lock || ::flock(lock.get(), LOCK_EX | LOCK_NB) != 0 || ::rename(tmpl.c_str(), named.c_str()) != 0) {
    ::rmdir(tmpl.c_str());
    return m;
  }
  m.path = named;
  m.lock = std::move(lock);
  return m;
}

}  // namespace

PullResult pull(const Endpoint& master, const std::string& remote, const std::string& local,
                const TransferOptions& options, const PullOptions& po) {
  if (!options.verify) throw TransferError(errc::bad_argument, "a pull verifies every block: not with --no-verify", false);
  // Where it goes: a directory (the file's own name in it), or a file's path.
  std::string dir, name;
  struct stat st {};
  if (po.set) {
    // A set: its files go into the directory `local`; its pack is a file of the staging directory.
    dir = local;
    name = ".xdfs-set";
  } else if (!local.empty() && (local.back() == '/' || (::stat(local.c_str(), &st) == 0 && S_ISDIR(st.st_mode)))) {
    dir = local;
    name = relay_detail::base_name(remote);
  } else {
    auto [d, n] = files::split_parent(local);
    dir = d.empty() ? "." : d;
    name = n;
  }
  if (name.empty() || name == "." || name == ".." || name == "/")
    throw TransferError(errc::bad_argument, "'" + local + "': no file name to pull into", false);
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw TransferError(errc::no_such_file, "'" + dir + "' is not a directory", false);

  // This client's key, which its own server proves to the master (who pins it).
  xsec::KeyPair me;
  try {
    bool created = false;
    const std::string id = options.identity_file.empty() ? xsec::default_config_dir() + "/id_x25519" : options.identity_file;
    me = options.identity_secret ? xsec::KeyPair::from_secret(*options.identity_secret) : xsec::load_or_create_key(id, &created);
    if (created && options.notice) options.notice("made a new client key " + xsec::fingerprint(me.public_key) + " in " + id);
  } catch (const Error& e) {
    throw TransferError(e.code(), e.context(), false);
  }
  StateDir state;
  {
    const char* t = std::getenv("TMPDIR");
    std::string tmpl = std::string(t && *t ? t : "/tmp") + "/xduc-pull-XXXXXX";
    if (!::mkdtemp(tmpl.data())) throw TransferError(errc_from_errno(errno), "a state directory for the pull's server", false);
    state.path = tmpl;
  }
  // The staging directory: a directory of ours (not a symlink), kept while it holds a partial copy.
  // One staging directory per master, remote path and local name: two pulls never share one.
  const std::string staging =
      dir + "/" + staging_name(fmt::format("{}:{} {} {} {}", master.host, master.port, po.set ? "set" : "file", remote, name));
  if (::mkdir(staging.c_str(), 0700) != 0 && errno != EEXIST)
    throw TransferError(errc_from_errno(errno), "'" + staging + "': " + std::strerror(errno), false);
  if (::lstat(staging.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid())
    throw TransferError(errc::bad_argument, "'" + staging + "' is not this user's directory", false);
  struct Emptied {
    std::string path;
    ~Emptied() { ::rmdir(path.c_str()); }  // only if nothing worth keeping is left in it
  } emptied{staging};
  MemoryStage memory;
  // (Room for the two parts a host holds at once, and as much again for the other pulls there.)
  if (po.set) memory = memory_stage(po.memory_stage, 4 * relay_detail::max_pack_size);
  // Where this host's server may keep a part (an empty one: none).
  const std::array<const std::string*, 2> stages{&memory.path, &staging};
  ServerConfig cfg;
  cfg.root = staging;
  cfg.relay_memory_dir = memory.path;
  cfg.relay_memory_max = relay_detail::max_pack_size;
  cfg.state_dir = state.path;
  cfg.authorized_keys = state.path + "/authorized_keys";
  cfg.relay_peers = state.path + "/relay_peers";
  cfg.key = me.secret;
  cfg.relay_trust_master = true;
  cfg.listen = po.listen;
  cfg.idle_timeout = options.idle_timeout;
  // A place and the upload feeding it for each part of a set this host takes at once.
  cfg.max_sessions = po.set ? 32 : 16;
  cfg.max_sessions_per_key = cfg.max_sessions;
  cfg.log = po.log ? po.log : [](const std::string&) {};
  // This host forwards as it uploads: by sendfile, or not, as the user said (xduc --no-zero-copy).
  cfg.zero_copy = options.zero_copy;
  cfg.loopback_sendfile = options.loopback_sendfile;
  cfg.debug = static_cast<bool>(options.debug) && static_cast<bool>(po.log);
  // Relay places and the uploads that feed them; nothing here is for reading.
  auto modes = xftsm::server_modes();
  std::erase_if(modes, [](const runtime::ModeEntry& m) { return m.mode != Mode::upload; });
  modes.push_back(relay_mode::server_mode());
  std::unique_ptr<Server> server;
  try {
    server = std::make_unique<Server>(cfg, runtime::session_factory(std::move(modes)));
  } catch (const Error& e) {
    throw TransferError(e.code(), "this host's server for the pull (" + po.listen + "): " + e.context(), false);
  }
  std::thread serving([&] {
    try {
      server->run();
    } catch (...) {  // (its sessions catch their own: this is its set-up, out of memory; the
    }                // master then cannot reach this host, and the pull fails saying so)
  });
  struct Stop {
    Server& s;
    std::thread& t;
    void now() {
      s.stop();
      if (t.joinable()) t.join();
    }
    ~Stop() { now(); }
  } stop{*server, serving};
  // Only partial copies (and their records) are taken from an earlier pull: a whole file left
  // in staging is not one this run's server kept, and is not trusted. (A set's parts are named
  // after `name`; their partial copies' names begin with another '.'.)
  if (po.set) {
    if (DIR* d = ::opendir(staging.c_str())) {
      while (auto* e = ::readdir(d)) {
        const std::string n = e->d_name;
        if (n.rfind(name + "-", 0) == 0 || n == name) (void)::unlinkat(::dirfd(d), n.c_str(), 0);
        if (n.rfind(".xdfs-unpacking-", 0) == 0) {  // (a killed pull's copies out of a pack)
          std::error_code ignored;
          std::filesystem::remove_all(staging + "/" + n, ignored);
        }
      }
      ::closedir(d);
    }
  } else {
    ::unlink((staging + "/" + name).c_str());
  }

  const auto t0 = Clock::now();
  PullResult result;
  result.local = po.set ? dir : dir + (dir.back() == '/' ? "" : "/") + name;
  SessionOptions so = options;
  so.channels = 1;

  // One file through one chain: the file, or a part of a set (a pack of its small files, or one
  // large file; each part an operation of its own, on a session of its own).
  struct Part {
    std::uint32_t index = 0;
    std::string name;              // in staging
    std::uint64_t size = 0;        // as the master answered
    std::int64_t mtime = -1;
    std::string path;              // a set's part that is one file: its path in the set
    bool placed = false;
    double placed_after = 0;
    std::uint64_t files = 0;
    std::uint64_t early_files = 0;  // of those: copied out of the pack while it arrived
    unsigned tries = 0;
    std::atomic<std::uint64_t> have{0};
    std::atomic<bool> ended{false};  // its thread is done with it
    std::unique_ptr<EarlyUnpack> early;  // a pack's files copied out while it arrives (this try's)
  };
  // A set's parts, as part 0's answer named them.
  struct Plan {
    std::mutex m;
    std::condition_variable changed;
    bool known = false;
    std::uint32_t parts = 1;
    std::vector<std::uint8_t> id;  // empty: a master that sends a set as one pack
    std::uint64_t bytes = 0;
    unsigned unplaced = 0;         // parts asked for and not yet in DST
    unsigned running = 0;          // parts whose sessions to the master are open
    std::exception_ptr failed;
    std::vector<pathm::Entry> dirs;  // the set's directories (part 0): modes and mtimes set last
  } plan;
  // What this pull made in DST, for every part's writer: only those get the set's modes.
  const auto made = std::make_shared<files::Made>();
  std::mutex keys_m;  // the server's authorized_keys, written by each part's session
  std::string keys_written;  // (under keys_m) its line as last written: the same is not written again
  bool keys_failed = false;  // (under keys_m) it could not be written: no other try would help
  std::atomic<bool> halt{false};  // a part failed, or the user cancelled: every part stops
  // The master may register this host's place here as soon as it reads the negotiation: its
  // key (as the session's handshake proved it) is authorized here before that is sent.
  so.server_key_accepted = [&](const xsec::Key32& master_key) {
    const std::string line = xsec::format_public(master_key);
    std::lock_guard lock(keys_m);
    if (keys_written == line) return;
    const std::string tmp = cfg.authorized_keys + ".tmp";
    errno = 0;
    std::ofstream out(tmp, std::ios::trunc);
    out << line << " rw\n";
    out.close();
    if (!out || ::rename(tmp.c_str(), cfg.authorized_keys.c_str()) != 0) {
      const int e = errno;
      ::unlink(tmp.c_str());
      keys_failed = true;
      throw TransferError(e ? errc_from_errno(e) : errc::internal,
                          "cannot write the pull server's authorized keys in " + state.path +
                              (e ? std::string(": ") + std::strerror(e) : std::string()),
                          false);
    }
    keys_written = line;
  };
  const std::atomic<bool>* const stop_flag = po.set ? &halt : options.cancel;
  auto stopping = [&] { return (options.cancel && options.cancel->load()) || halt.load(); };

  // Whole in the staging directory means verified against the master's digest (its server keeps
  // nothing else there under the name): it goes to its place in DST at once, while this host
  // still serves the hosts after it from its descriptor.
  // Where this host's server keeps a part: in memory if it had the room there, else in staging;
  // each try of a part chooses again, so a part whole in either is the one.
  auto whole_in = [&](const Part& p, struct stat& ps) -> const std::string* {
    for (const std::string* d : stages)
      if (!d->empty() && ::lstat((*d + "/" + p.name).c_str(), &ps) == 0 && S_ISREG(ps.st_mode) &&
          static_cast<std::uint64_t>(ps.st_size) == p.size)
        return d;
    return nullptr;
  };
  auto place = [&](Part& p) -> bool {
    if (p.placed) return true;
    struct stat ps {};
    const std::string* in = whole_in(p, ps);
    if (!in) return false;
    const std::string& from_dir = *in;
    const std::string staged = from_dir + "/" + p.name;
    if (po.set) {
      files::Fd root(::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
      if (!root) throw TransferError(errc_from_errno(errno), "'" + dir + "': " + std::strerror(errno), false);
      pathm::TreeWriter writer(root.get(), fmt::format("pull{}-{}", ::getpid(), p.index), options.fsync,
                               options.block_size, 1024, files::process_umask(), 0, made);
      if (p.path.empty()) {
        // A pack, whole with the master's digest: its files go into DST, each checked as any
        // pack's are (paths within DST, sizes against what the pack holds), nothing written
        // unless the whole pack reads well.
        files::Fd pack(::open(staged.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
        if (!pack) throw TransferError(errc_from_errno(errno), "the set's pack: " + std::string(std::strerror(errno)), false);
        if (::fstat(pack.get(), &ps) != 0 || !S_ISREG(ps.st_mode) || static_cast<std::uint64_t>(ps.st_size) != p.size)
          return false;
        // Those of its files copied out while it arrived are renamed into place instead.
        relay_detail::Prestaged pre;
        files::Fd pre_dir;
        if (p.early) {
          p.early->end();
          if (p.early->holds(pack.get())) {
            pre_dir = files::Fd(::open(p.early->dir.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
            pre.dir = pre_dir.get();
            pre.upto = p.early->upto;
          }
        }
        // (Directories and symlinks only in part 0: a set's others are packs of files.)
        auto u = relay_detail::unpack(pack.get(), p.size, writer, "", 0, stop_flag, p.index == 0 ? 2 : 1, &pre);
        if (p.early) {
          p.early->drop();
          p.early.reset();
        }
        if (u.code != errc::ok) throw TransferError(u.code, "the set: " + u.message, false);
        p.files = u.files;
        p.early_files = u.prestaged;
        if (!u.dirs.empty()) {
          std::lock_guard lock(plan.m);
          plan.dirs.insert(plan.dirs.end(), std::make_move_iterator(u.dirs.begin()), std::make_move_iterator(u.dirs.end()));
        }
      } else {
        // One large file of the set: renamed into its place (its path checked as a pack's are).
        // (From memory, a copy: the file's bytes are written into DST once all the same.)
        files::Fd from(::open(from_dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
        if (!from) throw TransferError(errc_from_errno(errno), "'" + from_dir + "': " + std::strerror(errno), false);
        pathm::Entry e;
        e.path = p.path;
        e.size = p.size;
        e.mode = ps.st_mode & 0777;
        e.mtime_ns = p.mtime;
        if (auto s = writer.put_move(e, from.get(), p.name); !s)
          throw TransferError(s.code, "the set: " + text::escape(s.message), false);
        p.files = 1;
      }
    } else {
      if (::rename(staged.c_str(), result.local.c_str()) != 0)
        throw TransferError(errc_from_errno(errno), "'" + result.local + "': " + std::strerror(errno), false);
      // The source's mtime, as a copy keeps it.
      const timespec times[2] = {{0, UTIME_OMIT},
                                 {static_cast<time_t>(p.mtime / 1000000000), static_cast<long>(p.mtime % 1000000000)}};
      if (p.mtime >= 0) (void)::utimensat(AT_FDCWD, result.local.c_str(), times, AT_SYMLINK_NOFOLLOW);
    }
    p.placed = true;
    p.placed_after = std::chrono::duration<double>(Clock::now() - t0).count();
    p.have = p.size;
    if (po.set) {
      std::lock_guard lock(plan.m);
      --plan.unplaced;
      plan.changed.notify_all();
    }
    return true;
  };

  // Failures no other session to the master would change; in a set, also a set that changed
  // since its first part (its parts would not fit together).
  auto final_failure = [&](errc c) { return lasting(c) || (po.set && c == errc::size_mismatch); };

  // The part's sessions to the master, until the master lets this host go (or it is given up).
  auto run = [&](Part& p) {
    errc last_code = errc::peer_aborted;
    std::string last_why = "no session to the master";
    const unsigned tries = std::max(1u, po.tries);
    for (unsigned attempt = 0; attempt < tries; ++attempt) {
      if (stopping()) throw TransferError(errc::cancelled, "cancelled", false);
      if (attempt > 0) std::this_thread::sleep_for(std::chrono::seconds(1));
      ++p.tries;
      Session s(master, so);
      wire::Negotiation n;
      n.mode = Mode::pull;
      n.remote_path = remote;
      n.block_size = options.block_size;
      n.pull_port = server->port();
      n.pull_name = p.name;
      n.pull_set = po.set;
      if (po.set) {
        n.pull_parts = true;
        n.pull_links = true;
        n.pull_part = p.index;
        if (p.index > 0) {
          std::lock_guard lock(plan.m);
          n.pull_plan = plan.id;
        }
      }
      wire::NegotiationReply reply;
      try {
        reply = s.begin(n);
      } catch (const TransferError& e) {
        // (A changed server key too, or this host's own keys not written: another try would not help.)
        const bool keys_unwritten = [&] {
          std::lock_guard lock(keys_m);
          return keys_failed;
        }();
        if (final_failure(e.code()) || keys_unwritten) throw;
        last_code = e.code();
        last_why = e.what();
        continue;
      }
      if (po.set) {
        std::lock_guard lock(plan.m);
        const std::uint32_t parts = reply.set_parts ? reply.set_parts : 1;  // 0: an older master's one pack
        if (!plan.known) {
          plan.known = true;
          plan.parts = parts;
          plan.id = reply.set_plan;
          plan.bytes = reply.set_parts ? reply.set_bytes : reply.file_size;
          plan.changed.notify_all();
        } else if (plan.parts != parts || plan.id != reply.set_plan) {
          throw TransferError(errc::size_mismatch, "the set changed on the master while this host pulled it: pull it again",
                              false);
        }
        if (reply.set_path.empty() && reply.file_size > relay_detail::max_pack_size)
          throw TransferError(errc::protocol_error, fmt::format("the master's pack is {} bytes, more than a pack holds",
                                                                reply.file_size), true);
        p.path = reply.set_path;
      }
      p.size = reply.file_size;
      p.mtime = reply.mtime_ns;
      auto shown_at = Clock::now();
      auto shown = [&] {
        if (place(p) || Clock::now() - shown_at < std::chrono::milliseconds(200)) return;
        shown_at = Clock::now();
        std::uint64_t have = 0;
        for (const std::string* d : stages) {
          struct stat ps {};
          if (!d->empty() && ::stat((*d + "/" + files::partial_name(p.name)).c_str(), &ps) == 0)
            have = std::max(have, static_cast<std::uint64_t>(ps.st_size));
        }
        p.have = std::min(have, p.size);
        if (!po.set && po.progress) po.progress(p.have, p.size);
      };
      // A pack of the set: its files copied out while it arrives (ended with this try).
      struct EndEarly {
        Part& p;
        ~EndEarly() {
          if (p.early) p.early->drop();
        }
      } end_early{p};
      if (po.set && p.path.empty() && p.size > 0 && !p.placed) {
        p.early = std::make_unique<EarlyUnpack>();
        p.early->dir = staging + "/.xdfs-unpacking-" + std::to_string(p.index);
        try {
          p.early->thread = std::thread([&relays = server->relays(), &p, e = p.early.get()] {
            try {
              unpack_early(relays, p.name, p.size, *e);
            } catch (...) {  // (only a speed-up: the pack is unpacked whole at the end as ever)
            }
          });
        } catch (const std::system_error&) {  // (no thread now: likewise)
          p.early.reset();
        }
      }
      // This side's table (relay_fsm, pull-host): answered, then the master's EOFR or EXCEPTION.
      relay_fsm::RelayMachine machine(relay_fsm::RelaySide::pull_host);
      (void)machine.fire(relay_fsm::RelayEvent::accepted);
      const auto end = await_end(s, shown, stop_flag);
      const auto action = machine.fire(end.how == Ending::eofr        ? relay_fsm::RelayEvent::ended
                                       : end.how == Ending::exception ? relay_fsm::RelayEvent::peer_exception
                                                                      : relay_fsm::RelayEvent::channel_lost);
      if (action == relay_fsm::RelayAction::send_eofr_back) {
        if (reply.file_size == 0) {
          // Nothing travels for an empty file: it is made here.
          const std::string staged = staging + "/" + p.name;
          ::unlink(staged.c_str());
          const int fd = ::open(staged.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0666);
          if (fd < 0) throw TransferError(errc_from_errno(errno), "'" + staged + "': " + std::strerror(errno), false);
          ::close(fd);
        }
        wire::FrameHeader h;
        h.event = wire::ChannelEvent::eofr;
        s.channels()[0]->send(h, std::vector<std::uint8_t>{});
        s.end_operation(true);
        s.close();
        if (!place(p)) throw TransferError(errc::integrity_error, "the master let this host go, but its copy is not whole", false);
        return;
      }
      // Whole and in place already: what failed was only its serving the hosts after it.
      if (p.placed) return;
      last_code = end.how == Ending::exception ? end.ex.code : errc::peer_aborted;
      last_why = end.ex.message.empty() ? "the master's session ended" : end.ex.message;
      // (The master could not reach this host's server, at its address and port, after its own
      // tries: asking it again would not change that.)
      if (end.how == Ending::exception && (final_failure(end.ex.code) || end.ex.code == errc::connection_failed))
        throw TransferError(end.ex.code, text::escape(last_why), true);
      if (stopping()) throw TransferError(errc::cancelled, "cancelled", false);
    }
    throw TransferError(last_code, fmt::format("after {} tries through the master: {}", p.tries, text::escape(last_why)),
                        false);
  };

  auto finished = [&](double placed_after, std::uint64_t size) {
    stop.now();  // (nothing more lands in staging)
    std::error_code ignored;  // what else the master left there
    std::filesystem::remove_all(staging, ignored);
    if (po.progress) po.progress(size, size);
    result.size = size;
    result.seconds = placed_after;
    return result;
  };

  if (!po.set) {
    Part p;
    p.name = name;
    run(p);
    result.tries = p.tries;
    return finished(p.placed_after, p.size);
  }

  // A set: part 0 first, whose answer says how many parts there are; then the others, one after
  // another (each on a session and a thread of its own), each asked for once the one before it
  // is in place: so a set's parts, and its files, arrive in the plan's order, and the chains of
  // consecutive parts form in about the same order of hosts. A part in place goes on serving
  // the hosts after it until its chain lets this host go, costing the master a session while it
  // does: one such part at most, beside the one on its way.
  constexpr unsigned window = 1;        // parts on their way here at once
  constexpr unsigned most_running = 2;  // sessions to the master at once (parts serving included)
  std::deque<Part> parts;  // (a deque: a Part stays where it is while others are added)
  std::deque<std::pair<std::thread, const Part*>> threads;
  struct Joined {  // every part's thread is joined before this returns or throws
    std::deque<std::pair<std::thread, const Part*>>& threads;
    std::atomic<bool>& halt;
    ~Joined() {
      for (auto& [t, p] : threads)
        if (t.joinable()) {
          halt = true;
          t.join();
        }
    }
  } joined{threads, halt};
  auto launch = [&](std::uint32_t k) {
    auto& p = parts.emplace_back();
    p.index = k;
    // Part 0 is a pack the master makes afresh; the others are named with their plan, so that
    // a partial copy kept from another plan's part is never taken for this one's.
    // (A plan with parts past 0 is 32 bytes: the decoder sees to it.)
    manifest::Digest id{};
    std::copy_n(plan.id.begin(), std::min(id.size(), plan.id.size()), id.begin());
    p.name = k == 0 ? name + "-0" : fmt::format("{}-{}-{}", name, k, manifest::hex(id).substr(0, 16));
    {
      std::lock_guard lock(plan.m);
      ++plan.unplaced;
      ++plan.running;
    }
    auto& slot = threads.emplace_back(std::thread(), &p);
    slot.first = std::thread([&, &p = p] {
      std::exception_ptr failure;
      try {
        run(p);
      } catch (...) {
        failure = std::current_exception();
      }
      // Its chain is done with this host: its copy in memory goes now, not with the pull.
      if (!memory.path.empty())
        for (const auto& n : {p.name, files::partial_name(p.name), files::record_name(p.name)})
          ::unlink((memory.path + "/" + n).c_str());
      std::lock_guard lock(plan.m);
      if (!p.placed) --plan.unplaced;
      --plan.running;
      if (failure && !plan.failed) plan.failed = failure;
      if (failure) halt = true;
      if (!plan.known) plan.known = true;  // (part 0 failed before any answer: nothing else starts)
      p.ended = true;
      plan.changed.notify_all();
    });
  };
  // Threads of parts that are over are joined as they end: at most most_running are kept.
  auto reap = [&] {
    for (auto& [t, p] : threads)
      if (t.joinable() && p->ended.load()) t.join();
    while (!threads.empty() && !threads.front().first.joinable()) threads.pop_front();
  };
  auto progress_at = Clock::now();
  auto wait_a_little = [&](std::unique_lock<std::mutex>& lock) {
    plan.changed.wait_for(lock, std::chrono::milliseconds(50));
    if (options.cancel && options.cancel->load()) halt = true;
    if (po.progress && Clock::now() - progress_at >= std::chrono::milliseconds(200) && plan.bytes) {
      progress_at = Clock::now();
      std::uint64_t have = 0;
      for (const auto& q : parts) have += q.have.load();
      lock.unlock();
      po.progress(std::min(have, plan.bytes), plan.bytes);
      lock.lock();
    }
  };
  launch(0);
  {
    std::unique_lock lock(plan.m);
    std::uint32_t next = 1;
    while (!halt && (!plan.known || next < plan.parts)) {
      if (plan.known && plan.unplaced < window && plan.running < most_running) {
        lock.unlock();
        reap();
        launch(next++);
        lock.lock();
        continue;
      }
      wait_a_little(lock);
    }
    while (plan.running > 0) wait_a_little(lock);
  }
  for (auto& [t, p] : threads)
    if (t.joinable()) t.join();
  for (const auto& p : parts) {
    result.tries = std::max(result.tries, p.tries);
    result.files += p.files;
    result.early_files += p.early_files;
  }
  if (plan.failed) std::rethrow_exception(plan.failed);
  // (Every part in place: a cancel then only ended their serving, as for one file.)
  const bool whole = parts.size() == plan.parts && std::all_of(parts.begin(), parts.end(), [](const Part& p) {
                       return p.placed;
                     });
  if (!whole) throw TransferError(errc::cancelled, "cancelled", false);
  // The set's directories, once all they hold is in place: each one's contents before it.
  if (!plan.dirs.empty()) {
    files::Fd root(::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (!root) throw TransferError(errc_from_errno(errno), "'" + dir + "': " + std::strerror(errno), false);
    pathm::TreeWriter writer(root.get(), fmt::format("pull{}-dirs", ::getpid()), false, options.block_size, 1024,
                             files::process_umask(), 0, made);
    for (auto it = plan.dirs.rbegin(); it != plan.dirs.rend(); ++it)
      if (auto s = writer.set_attrs(*it); !s) throw TransferError(s.code, "the set: " + text::escape(s.message), false);
  }
  double last = 0;
  for (const auto& p : parts) last = std::max(last, p.placed_after);
  return finished(last, plan.bytes);
}

}  // namespace xdfs
