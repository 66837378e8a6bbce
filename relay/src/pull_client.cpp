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
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/core.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "xdfs/detail/relay_fsm.hpp"
#include "xdfs/files.hpp"
#include "xdfs/relay.hpp"
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
    if (every) every();
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
  ServerConfig cfg;
  cfg.root = staging;
  cfg.state_dir = state.path;
  cfg.authorized_keys = state.path + "/authorized_keys";
  cfg.relay_peers = state.path + "/relay_peers";
  cfg.key = me.secret;
  cfg.relay_trust_master = true;
  cfg.listen = po.listen;
  cfg.idle_timeout = options.idle_timeout;
  cfg.max_sessions = 16;
  cfg.log = po.log ? po.log : [](const std::string&) {};
  // This host forwards as it uploads: by sendfile, or not, as the user said (xduc --no-zero-copy).
  cfg.zero_copy = options.zero_copy;
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
  std::thread serving([&] { server->run(); });
  struct Stop {
    Server& s;
    std::thread& t;
    void now() {
      s.stop();
      if (t.joinable()) t.join();
    }
    ~Stop() { now(); }
  } stop{*server, serving};
  // Only the partial copy (and its record) is taken from an earlier pull: a whole file left in
  // staging is not one this run's server kept, and is not trusted.
  ::unlink((staging + "/" + name).c_str());

  const auto t0 = Clock::now();
  PullResult result;
  result.local = po.set ? dir : dir + (dir.back() == '/' ? "" : "/") + name;
  SessionOptions so = options;
  so.channels = 1;
  // Whole in the staging directory means verified against the master's digest (its server keeps
  // nothing else there under the name): it goes to its name in DST at once, while this host
  // still serves the hosts after it from its descriptor.
  bool placed = false;
  double placed_after = 0;
  std::uint64_t want_size = 0;
  std::int64_t want_mtime = -1;
  const std::string staged = staging + "/" + name;
  auto place = [&]() -> bool {
    if (placed) return true;
    if (::lstat(staged.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || static_cast<std::uint64_t>(st.st_size) != want_size)
      return false;
    if (po.set) {
      // The set's pack, whole with the master's digest: its files go into DST, each checked as
      // any pack's are (paths within DST, sizes against what the pack holds), nothing written
      // unless the whole pack reads well.
      files::Fd pack(::open(staged.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
      files::Fd root(::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
      if (!pack || !root) throw TransferError(errc_from_errno(errno), "the set's pack: " + std::string(std::strerror(errno)), false);
      if (::fstat(pack.get(), &st) != 0 || !S_ISREG(st.st_mode) || static_cast<std::uint64_t>(st.st_size) != want_size)
        return false;
      pathm::TreeWriter writer(root.get(), fmt::format("pull{}", ::getpid()), options.fsync, options.block_size);
      const auto u = relay_detail::unpack(pack.get(), want_size, writer, "", 0, options.cancel);
      if (u.code != errc::ok) throw TransferError(u.code, "the set: " + u.message, false);
      result.files = u.files;
    } else {
      if (::rename(staged.c_str(), result.local.c_str()) != 0)
        throw TransferError(errc_from_errno(errno), "'" + result.local + "': " + std::strerror(errno), false);
      // The source's mtime, as a copy keeps it.
      const timespec times[2] = {{0, UTIME_OMIT},
                                 {static_cast<time_t>(want_mtime / 1000000000), static_cast<long>(want_mtime % 1000000000)}};
      if (want_mtime >= 0) (void)::utimensat(AT_FDCWD, result.local.c_str(), times, AT_SYMLINK_NOFOLLOW);
    }
    placed = true;
    placed_after = std::chrono::duration<double>(Clock::now() - t0).count();
    return true;
  };
  auto finished = [&] {
    stop.now();  // (nothing more lands in staging)
    std::error_code ignored;  // what else the master left there
    std::filesystem::remove_all(staging, ignored);
    if (po.progress) po.progress(want_size, want_size);
    result.seconds = placed_after;
    return result;
  };
  errc last_code = errc::peer_aborted;
  std::string last_why = "no session to the master";
  const unsigned tries = std::max(1u, po.tries);
  for (unsigned attempt = 0; attempt < tries; ++attempt) {
    if (options.cancel && options.cancel->load()) throw TransferError(errc::cancelled, "cancelled", false);
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::seconds(1));
    ++result.tries;
    Session s(master, so);
    wire::Negotiation n;
    n.mode = Mode::pull;
    n.remote_path = remote;
    n.block_size = options.block_size;
    n.pull_port = server->port();
    n.pull_name = name;
    n.pull_set = po.set;
    wire::NegotiationReply reply;
    try {
      reply = s.begin(n);
    } catch (const TransferError& e) {
      if (lasting(e.code())) throw;  // (a changed server key too: another try would not change it)
      last_code = e.code();
      last_why = e.what();
      continue;
    }
    // The master may now register this host's place here (its key as the session proved it).
    {
      const std::string tmp = cfg.authorized_keys + ".tmp";
      std::ofstream out(tmp, std::ios::trunc);
      out << xsec::format_public(s.server_key()) << " rw\n";
      out.close();
      if (!out || ::rename(tmp.c_str(), cfg.authorized_keys.c_str()) != 0)
        throw TransferError(errc::internal, "cannot write the pull server's authorized keys in " + state.path, false);
    }
    if (po.set && reply.file_size > relay_detail::max_pack_size)
      throw TransferError(errc::protocol_error, fmt::format("the master's set is {} bytes, more than a pack holds",
                                                            reply.file_size), true);
    result.size = want_size = reply.file_size;
    want_mtime = reply.mtime_ns;
    const std::string partial = staging + "/" + files::partial_name(name);
    auto shown_at = Clock::now();
    auto shown = [&] {
      if (place() || !po.progress || Clock::now() - shown_at < std::chrono::milliseconds(200)) return;
      shown_at = Clock::now();
      struct stat p {};
      const std::uint64_t have = ::stat(partial.c_str(), &p) == 0 ? static_cast<std::uint64_t>(p.st_size) : 0;
      po.progress(std::min(have, reply.file_size), reply.file_size);
    };
    // This side's table (relay_fsm, pull-host): answered, then the master's EOFR or EXCEPTION.
    relay_fsm::RelayMachine machine(relay_fsm::RelaySide::pull_host);
    (void)machine.fire(relay_fsm::RelayEvent::accepted);
    const auto end = await_end(s, shown, options.cancel);
    const auto action = machine.fire(end.how == Ending::eofr        ? relay_fsm::RelayEvent::ended
                                     : end.how == Ending::exception ? relay_fsm::RelayEvent::peer_exception
                                                                    : relay_fsm::RelayEvent::channel_lost);
    if (action == relay_fsm::RelayAction::send_eofr_back) {
      if (reply.file_size == 0) {
        // Nothing travels for an empty file: it is made here.
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
      if (!place()) throw TransferError(errc::integrity_error, "the master let this host go, but its copy is not whole", false);
      return finished();
    }
    // Whole and in place already: what failed was only its serving the hosts after it.
    if (placed) return finished();
    last_code = end.how == Ending::exception ? end.ex.code : errc::peer_aborted;
    last_why = end.ex.message.empty() ? "the master's session ended" : end.ex.message;
    // (The master could not reach this host's server, at its address and port, after its own
    // tries: asking it again would not change that.)
    if (end.how == Ending::exception && (lasting(end.ex.code) || end.ex.code == errc::connection_failed))
      throw TransferError(end.ex.code, text::escape(last_why), true);
    if (options.cancel && options.cancel->load()) throw TransferError(errc::cancelled, "cancelled", false);
  }
  throw TransferError(last_code, fmt::format("after {} tries through the master: {}", result.tries, text::escape(last_why)),
                      false);
}

}  // namespace xdfs
