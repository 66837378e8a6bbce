#include "xdfs/server.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <limits.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <fmt/chrono.h>
#include <fmt/core.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <condition_variable>
#include <mutex>
#include <list>
#include <map>
#include <thread>
#include <unordered_map>

#include "xdfs/files.hpp"
#include "xdfs/relay_registry.hpp"
#include "xdfs/text.hpp"

namespace xdfs {

namespace asio = boost::asio;
using xdsi::ErrorCode;
using xdsi::tcp;
using Clock = std::chrono::steady_clock;

namespace {

// Where a connection comes from, as the pending caps and the turns of handshake work count it:
// an IPv4 address (also when it arrives mapped into IPv6), or an IPv6 /64. A host is usually
// given a whole /64 and could otherwise use a new source address for every connection.
std::string source_of(const asio::ip::address& a) {
  const auto u = xdsi::unmapped(a);
  if (!u.is_v6()) return u.to_string();
  auto bytes = u.to_v6().to_bytes();
  std::fill(bytes.begin() + 8, bytes.end(), 0);
  return asio::ip::address_v6(bytes).to_string() + "/64";
}

void default_log(const std::string& line) {
  auto now = std::chrono::system_clock::now();
  auto t = std::chrono::system_clock::to_time_t(now);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  fmt::print(stderr, "{:%Y-%m-%dT%H:%M:%S}Z xdfsd: {}\n", tm, line);
  std::fflush(stderr);
}

// What a peer can make the server log before it has authenticated is rationed: a burst, then a
// few lines a second, and a count of what was left out in the next line that is written.
class LogRation {
public:
  bool allow(Clock::time_point now) {
    const double refill = std::chrono::duration<double>(now - last_).count() * per_second;
    last_ = now;
    tokens_ = std::min(burst, tokens_ + refill);
    if (tokens_ < 1) {
      ++dropped_;
      return false;
    }
    tokens_ -= 1;
    return true;
  }
  /// Lines left out since the last one written (and resets the count).
  std::size_t take_dropped() { return std::exchange(dropped_, 0); }

private:
  static constexpr double per_second = 10, burst = 50;
  double tokens_ = burst;
  Clock::time_point last_ = Clock::now();
  std::size_t dropped_ = 0;
};

// A connection that has not authenticated yet: a socket, a deadline, the few hundred bytes of its
// opening and, once that has arrived, its handshake's state. No thread, no large buffer.
struct Conn {
  explicit Conn(asio::io_context& io) : deadline(io) {}
  std::unique_ptr<xdsi::Channel> ch;
  asio::steady_timer deadline;
  std::string peer;  // address:port
  std::string addr;  // source (an IPv4 address or an IPv6 /64): what the per-address caps count
  wire::PreambleBytes pre{};
  wire::HeaderBytes hdr{};
  std::vector<std::uint8_t> payload;
  wire::Opening opening;
  std::vector<std::uint8_t> opening_bytes;  // preamble and NEGO frame as received
  std::list<std::shared_ptr<Conn>>::iterator self;
  bool counted = true;    // against the pending caps (a join counts against its session instead)
  bool settled = false;   // refused, dropped or handed over: its handlers do nothing more
  bool released = false;  // no longer pending
  std::shared_ptr<unsigned> join_slot;  // its session's count of joins, while it holds a place there
};
using ConnPtr = std::shared_ptr<Conn>;

struct Session {
  // The settings it started with: a reload changes the server's, never a running session's.
  ServerConfig config;
  asio::io_context io{1};
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> guard;
  files::Fd root;  // the key's subdirectory, if it has one
  std::unique_ptr<runtime::SessionEnv> env;
  std::unique_ptr<runtime::SessionHandler> handler;
  std::thread thread;
  bool reported = false;  // session thread only
};

// What the listener knows of a running session: enough to let its other channels join.
struct Record {
  std::unique_ptr<Session> session;
  Reservation overhead;  // what the session itself takes (thread stacks, channels, keys)
  xsec::Key32 secret{};
  wire::Opening opening;
  std::uint32_t channels = 0;
  xsec::Key32 client{};
  // Joins that have not been handed over yet (proving themselves, or refused and on their way
  // out): at most n at a time. Shared with each such connection, so that a connection that
  // outlives its session counts against nothing else.
  std::shared_ptr<unsigned> joins = std::make_shared<unsigned>(0);
  std::vector<bool> handed;  // channel indices the session has been given
};

struct KeyUse {
  unsigned sessions = 0;
  unsigned channels = 0;
};

// The peer closed its side (or reset): it sends nothing more.
bool gone(const ErrorCode& ec) { return ec == asio::error::eof || ec == asio::error::connection_reset; }

// Memory a session takes before any buffer for its peer: two threads' stacks in use, its
// channels with their keys and queues. Reserved at admission, so that the whole process, not
// just the rings, stays within --memory-limit.
std::size_t session_overhead(std::uint32_t channels) { return (std::size_t(256) << 10) + std::size_t(channels) * (16u << 10); }

// How long an authenticated session waits for memory before it is refused (a client waits 15 s
// for the server's confirmation by default).
constexpr std::chrono::milliseconds memory_wait{10000};

// What the server itself holds whatever its sessions do (code, the listener, pending
// connections): kept out of the sessions' share of --memory-limit.
std::size_t process_base(std::size_t limit) { return std::min<std::size_t>(limit / 8, std::size_t(32) << 20); }

bool is_exhaustion(const ErrorCode& ec) {
  return ec == asio::error::no_descriptors || ec == asio::error::no_buffer_space || ec == asio::error::no_memory ||
         ec == boost::system::errc::too_many_files_open_in_system;
}

// Whether `inner` is `outer` or lies below it (both made absolute, symlinks resolved).
bool within(const std::string& outer, const std::string& inner) {
  if (inner == outer) return true;
  const std::string prefix = outer == "/" ? outer : outer + "/";
  return inner.compare(0, prefix.size(), prefix) == 0;
}

std::string real(const std::string& path) {
  char buf[PATH_MAX];
  return ::realpath(path.c_str(), buf) ? std::string(buf) : std::string();
}

// Where path is or would be: the resolved nearest existing ancestor with the rest appended.
std::string real_or_planned(const std::string& path) {
  if (auto r = real(path); !r.empty()) return r;
  const auto [parent, last] = files::split_parent(path);
  if (parent == path || last.empty()) return {};
  const std::string p = real_or_planned(parent);
  return p.empty() ? p : (p == "/" ? p + last : p + "/" + last);
}

}  // namespace

// The server's secrets must not be reachable through the root: a read-only client could fetch
// the private key, a read-write one rewrite who may log in. Checked before a key is made, and
// at each reload.
static void check_secrets_outside(const std::string& root, const std::string& state_dir, const std::string& keys,
                           const std::string& peers) {
  const std::string root_real = real(root);
  for (const auto& [what, path] : {std::pair<const char*, std::string>{"state directory", state_dir},
                                   {"authorized keys file", keys},
                                   {"relay peers file", peers}}) {
    const std::string r = real_or_planned(path);
    if (!root_real.empty() && !r.empty() && within(root_real, r))
      throw Error(errc::bad_argument, fmt::format("the {} '{}' lies inside the served root '{}': clients could reach it; "
                                                  "keep it outside (--state-dir, --authorized-keys, --relay-peers)",
                                                  what, path, root));
  }
}

struct Server::Impl {
  ServerConfig config;
  runtime::HandlerFactory factory;
  files::Fd root;
  xsec::KeyPair key;
  std::unique_ptr<runtime::RelayRegistry> relays;  // places in relay chains, by ticket
  asio::io_context io{1};
  tcp::acceptor acceptor{io};
  asio::signal_set signals{io};
  asio::steady_timer backoff{io};
  files::Fd reserve;  // a descriptor kept free for shedding a connection when they run out
  std::unique_ptr<MemoryBudget> budget;
  std::unique_ptr<RateLimiter> total_rate;
  // This run's mark on its temporary files, recorded (and locked while it runs) in
  // STATE-DIR/instances, so that the next start can tell a crashed run's files from a live one's.
  std::string instance;
  std::string instance_file;
  files::Fd instance_lock;
  std::thread sweeper;
  std::atomic<bool> sweep_stop{false};
  // Resumable uploads' partial files older than config.partial_expiry go: at start, then hourly.
  std::thread partial_sweeper;
  std::mutex partial_mu;
  std::condition_variable partial_cv;
  bool partial_stop = false;
  void sweep_partials();

  // Listener thread only.
  std::list<ConnPtr> pending;                      // arrival order
  std::unordered_map<std::string, unsigned> per_address;
  unsigned counted = 0;                            // pending connections under the caps
  struct Turn {
    std::deque<std::pair<std::weak_ptr<Conn>, std::function<void()>>> jobs;
    bool queued = false;
  };
  std::unordered_map<std::string, Turn> dh_jobs;   // public-key work, per source address
  std::deque<std::string> dh_turns;                // addresses with work, in turn
  bool dh_posted = false;
  std::map<SessionId, Record> sessions;
  std::map<xsec::Key32, KeyUse> key_use;
  LogRation ration;
  bool stopping = false;

  std::atomic<std::size_t> active{0};
  std::atomic<std::size_t> pending_count{0};
  std::atomic<std::size_t> rejected{0};
  std::atomic<std::size_t> channels_active{0};  // of the registered sessions (as negotiated)

  Metrics metrics;
  const Clock::time_point started = Clock::now();
  std::function<void(const std::string&)> notify;                          // sd_notify, or nothing
  std::function<std::optional<ServerConfig>(std::string&)> next_config;    // SIGHUP
  void await_signal();
  void reload(ServerConfig next);

  void log(const std::string& line) const noexcept {
    // One event, one line, nothing raw from a peer: the whole line is escaped here. A log that
    // cannot be written (stderr a full disk, a closed pipe) loses the line, never a thread.
    try {
      const std::string safe = text::escape(line);
      config.log ? config.log(safe) : default_log(safe);
    } catch (...) {
    }
  }
  // A line a peer can cause before it has authenticated.
  void log_rationed(const std::string& line) {
    if (!ration.allow(Clock::now())) return;
    const std::size_t dropped = ration.take_dropped();
    log(dropped ? fmt::format("{} ({} similar lines left out)", line, dropped) : line);
  }

  // authorized_keys, parsed again only when the file changed (edits apply at the next session
  // without a restart; a flood of handshakes does not re-read it each time).
  struct {
    struct stat st {};
    std::time_t loaded_at = 0;
    std::optional<xsec::AuthorizedKeys> keys;
  } keys_cache;
  const xsec::AuthorizedKeys& authorized_keys();

  void check_descriptors();
  void record_instance();
  void sweep_dead_instances();
  void accept();
  void shed();
  void on_accept(tcp::socket s);
  void make_room(const std::string& addr);
  void evict(const ConnPtr& c, const std::string& why);
  void uncount(Conn& c);
  void release(Conn& c);
  void read_opening(const ConnPtr& c);
  void on_opening(const ConnPtr& c);
  void start_noise(const ConnPtr& c);
  void on_established(const ConnPtr& c, xsec::HandshakeResult r);
  void start_join(const ConnPtr& c);
  void on_joined(const ConnPtr& c, xsec::HandshakeResult r);
  /// Tells the peer why (unless it is gone already), then closes.
  void refuse(const ConnPtr& c, errc code, const std::string& message, bool peer_gone = false);
  xsec::Defer defer_for(const ConnPtr& c);
  void schedule_dh();
  std::string check(const wire::Negotiation& n, errc& code) const;
  // An authenticated first channel on its way to becoming a session.
  struct Admission {
    ConnPtr c;
    wire::Negotiation nego;
    xsec::HandshakeResult r;
    xsec::Permission perm;
    files::Fd confined;
    Clock::time_point since;
  };
  bool try_admit(Admission& a);
  // What a key holds now, and what it may hold (its authorized_keys line, else the defaults).
  KeyUse use_of(const xsec::Key32& key) const {
    auto it = key_use.find(key);
    return it == key_use.end() ? KeyUse{} : it->second;
  }
  KeyUse limits_of(const xsec::Permission& p) const {
    return {p.sessions ? p.sessions : config.max_sessions_per_key, p.channels ? p.channels : config.max_channels_per_key};
  }
  void admit_waiting();
  void arm_waiting();
  std::deque<Admission> waiting;  // admissions waiting for memory, in order of arrival
  asio::steady_timer waiting_timer{io};
  bool waiting_armed = false;
  void create_session(const ConnPtr& c, wire::Negotiation nego, xsec::HandshakeResult& r, const xsec::Permission& perm,
                      files::Fd confined, Reservation overhead);
  void run_session(Session& s);
  void reap(const SessionId& id);
  void begin_stop();
};

Server::Server(ServerConfig config, runtime::HandlerFactory factory) : impl_(std::make_unique<Impl>()) {
  impl_->config = std::move(config);
  impl_->factory = std::move(factory);
  auto& c = impl_->config;
  if (c.root.empty()) throw Error(errc::bad_argument, "no root directory given");
  // The process's block-work pool, if nothing has set it yet (xdfsd did, with the same value).
  piod::BlockWorkers::configure(c.block_workers);
  int fd = ::open(c.root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw Error(errc_from_errno(errno), "root '" + c.root + "': " + std::strerror(errno));
  impl_->root = files::Fd(fd);
  if (c.state_dir.empty()) {
    if (const char* s = std::getenv("XDFS_STATE_DIR"); s && *s) c.state_dir = s;
    else if (const char* x = std::getenv("XDG_STATE_HOME"); x && *x) c.state_dir = std::string(x) + "/xdfsd";
    else c.state_dir = std::string(std::getenv("HOME") ? std::getenv("HOME") : ".") + "/.local/state/xdfsd";
  }
  if (c.authorized_keys.empty()) c.authorized_keys = c.state_dir + "/authorized_keys";
  if (c.relay_peers.empty()) c.relay_peers = c.state_dir + "/relay_peers";
  check_secrets_outside(c.root, c.state_dir, c.authorized_keys, c.relay_peers);
  bool created = false;
  impl_->key = c.key ? xsec::KeyPair::from_secret(*c.key) : xsec::load_or_create_key(c.state_dir + "/server_x25519", &created);
  impl_->relays = std::make_unique<runtime::RelayRegistry>(impl_->key);
  if (created) impl_->log("made a new server key in " + c.state_dir + "/server_x25519");
  // A malformed authorized-keys file is an error now rather than at the first client.
  if (::access(c.authorized_keys.c_str(), F_OK) == 0) (void)xsec::AuthorizedKeys::load(c.authorized_keys);
  if (c.min_protect > 2) throw Error(errc::bad_argument, "unknown minimum protection level");
  if (!c.memory_limit) c.memory_limit = default_memory_limit();
  impl_->budget = std::make_unique<MemoryBudget>(c.memory_limit - process_base(c.memory_limit));
  impl_->total_rate = std::make_unique<RateLimiter>(c.max_total_rate);
  impl_->record_instance();
  impl_->reserve = files::Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  std::string host;
  std::uint16_t port = 0;
  if (!xdsi::parse_host_port(c.listen, 7721, host, port))
    throw Error(errc::bad_argument, "listen address '" + c.listen + "' is not HOST:PORT");
  ErrorCode ec;
  auto addr = asio::ip::make_address(host, ec);
  if (ec) throw Error(errc::bad_argument, "listen address '" + host + "' is not an IP address");
  tcp::endpoint ep(addr, port);
  auto& a = impl_->acceptor;
  a.open(ep.protocol(), ec);
  if (!ec) a.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) a.bind(ep, ec);
  if (!ec) a.listen(asio::socket_base::max_listen_connections, ec);
  if (!ec) a.native_non_blocking(true, ec);
  if (ec) throw Error(errc::bad_argument, "cannot listen on " + c.listen + ": " + ec.message());
}

Server::~Server() {
  // run() has joined every session; if it never ran, there are none.
}

std::uint16_t Server::port() const noexcept {
  ErrorCode ec;
  auto ep = impl_->acceptor.local_endpoint(ec);
  return ec ? 0 : ep.port();
}

std::size_t Server::active_sessions() const noexcept { return impl_->active.load(); }
std::size_t Server::pending_connections() const noexcept { return impl_->pending_count.load(); }
std::size_t Server::rejected_channels() const noexcept { return impl_->rejected.load(); }
const MemoryBudget& Server::memory() const noexcept { return *impl_->budget; }
void Server::on_state(std::function<void(const std::string&)> notify) { impl_->notify = std::move(notify); }
void Server::on_reload(std::function<std::optional<ServerConfig>(std::string& why)> next) {
  impl_->next_config = std::move(next);
}
void Server::reload(ServerConfig next) {
  asio::post(impl_->io, [d = impl_.get(), next = std::move(next)]() mutable {
    try {
      d->reload(std::move(next));
    } catch (const std::exception& e) {
      d->metrics.add("xdfs_reloads_total", {{"result", "failed"}});
      d->log(std::string("reload failed, the running settings stay: ") + e.what());
    }
  });
}
Metrics& Server::metrics() noexcept { return impl_->metrics; }

std::string Server::metrics_text() const {
  const auto& d = *impl_;
  const double up = std::chrono::duration<double>(Clock::now() - d.started).count();
  return d.metrics.render({
      {"xdfs_sessions_active", {}, static_cast<double>(d.active.load())},
      {"xdfs_channels_active", {}, static_cast<double>(d.channels_active.load())},
      {"xdfs_connections_pending", {}, static_cast<double>(d.pending_count.load())},
      {"xdfs_memory_budget_bytes", {{"state", "limit"}}, static_cast<double>(d.budget->limit())},
      {"xdfs_memory_budget_bytes", {{"state", "used"}}, static_cast<double>(d.budget->used())},
      {"xdfs_uptime_seconds", {}, up},
  });
}

void Server::Impl::await_signal() {
  signals.async_wait([this](const ErrorCode& ec, int sig) {
    if (ec) return;
    if (sig != SIGHUP) {
      log(fmt::format("signal {} received: stopping", sig == SIGINT ? "SIGINT" : "SIGTERM"));
      return begin_stop();
    }
    await_signal();  // first: whatever the reload does, the next signal is heard
    if (notify) notify(fmt::format("RELOADING=1\nMONOTONIC_USEC={}", std::chrono::duration_cast<std::chrono::microseconds>(
                                                                          Clock::now().time_since_epoch()).count()));
    std::string why;
    try {
      if (auto next = next_config(why)) reload(std::move(*next));
      else throw Error(errc::bad_argument, why);
    } catch (const std::exception& e) {
      metrics.add("xdfs_reloads_total", {{"result", "failed"}});
      log(std::string("SIGHUP: reload failed, the running settings stay: ") + e.what());
    }
    if (notify) notify("READY=1");
  });
}

// What a reload may change, on the listener thread. Sessions copy the settings when they start,
// so nothing a running session reads changes under it; the listener's admission reads them here.
// All or nothing: the new settings are checked and staged in a copy, which replaces the running
// ones only when everything checked out (throws otherwise, changing nothing).
void Server::Impl::reload(ServerConfig next) {
  if (next.min_protect > 2) throw Error(errc::bad_argument, "unknown minimum protection level");
  if (next.authorized_keys.empty()) next.authorized_keys = config.state_dir + "/authorized_keys";
  if (next.relay_peers.empty()) next.relay_peers = config.state_dir + "/relay_peers";
  check_secrets_outside(config.root, config.state_dir, next.authorized_keys, next.relay_peers);
  if (::access(next.authorized_keys.c_str(), F_OK) == 0) (void)xsec::AuthorizedKeys::load(next.authorized_keys);
  ServerConfig staged = config;
  std::vector<std::string> applied, kept;
  auto take = [&](const char* name, auto& have, const auto& want, auto show) {
    if (have == want) return;
    applied.push_back(fmt::format("{} {} -> {}", name, show(have), show(want)));
    have = want;
  };
  auto num = [](const auto& v) { return fmt::format("{}", v); };
  auto ms = [](const std::chrono::milliseconds& v) { return fmt::format("{}s", v.count() / 1000.0); };
  auto yes = [](bool v) { return std::string(v ? "on" : "off"); };
  auto str = [](const std::string& v) { return v; };
  auto& c = staged;
  take("max-sessions", c.max_sessions, next.max_sessions, num);
  take("max-channels", c.max_channels, next.max_channels, num);
  take("max-sessions-per-key", c.max_sessions_per_key, next.max_sessions_per_key, num);
  take("max-channels-per-key", c.max_channels_per_key, next.max_channels_per_key, num);
  take("max-pending", c.max_pending, next.max_pending, num);
  take("max-pending-per-address", c.max_pending_per_address, next.max_pending_per_address, num);
  take("max-block-size", c.max_block_size, next.max_block_size, num);
  take("ring", c.ring_bytes, next.ring_bytes, num);
  take("max-file-size", c.max_file_size, next.max_file_size, num);
  take("min-protect", c.min_protect, next.min_protect,
       [](std::uint8_t p) { return std::string(xsec::to_string(static_cast<xsec::Protect>(p))); });
  take("handshake-timeout", c.handshake_timeout, next.handshake_timeout, ms);
  take("join-timeout", c.join_timeout, next.join_timeout, ms);
  take("idle-timeout", c.idle_timeout, next.idle_timeout, ms);
  take("fsync", c.fsync, next.fsync, yes);
  take("max-rate", c.max_rate, next.max_rate, num);
  take("allow-memory-mode", c.allow_memory_mode, next.allow_memory_mode, yes);
  take("allow-fifo", c.allow_fifo, next.allow_fifo, yes);
  take("path-workers", c.path_workers, next.path_workers, num);
  take("zero-copy", c.zero_copy, next.zero_copy, yes);
  take("loopback-sendfile", c.loopback_sendfile, next.loopback_sendfile, yes);
  take("pull-pack-size", c.pull_pack_size, next.pull_pack_size, num);
  take("debug", c.debug, next.debug, yes);
  take("authorized-keys", c.authorized_keys, next.authorized_keys, str);
  take("relay-peers", c.relay_peers, next.relay_peers, str);
  auto restart = [&](const char* name, bool same) {
    if (!same) kept.push_back(name);
  };
  restart("root", next.root == c.root);
  restart("listen", next.listen == c.listen);
  restart("state-dir", next.state_dir.empty() || next.state_dir == c.state_dir);
  restart("memory-limit", (next.memory_limit ? next.memory_limit : default_memory_limit()) == c.memory_limit);
  restart("max-total-rate", next.max_total_rate == c.max_total_rate);
  restart("partial-expiry", next.partial_expiry == c.partial_expiry);
  restart("block-workers", next.block_workers == c.block_workers);
  std::string line = applied.empty() ? "SIGHUP: reloaded, nothing changed" : "SIGHUP: reloaded: " + fmt::format("{}", fmt::join(applied, ", "));
  line += "; authorized keys and relay peers are read again at the next session";
  if (!kept.empty()) line += fmt::format("; not applied, these need a restart: {}", fmt::join(kept, ", "));
  config = std::move(staged);
  keys_cache = {};  // the files are read again either way: a reload is how an operator says "look again"
  metrics.add("xdfs_reloads_total", {{"result", "ok"}});
  log(line);
  admit_waiting();
}
const xsec::Key32& Server::public_key() const noexcept { return impl_->key.public_key; }

runtime::RelayRegistry& Server::relays() noexcept { return *impl_->relays; }

void Server::stop() {
  asio::post(impl_->io, [impl = impl_.get()] { impl->begin_stop(); });
}

void Server::run(bool handle_signals) {
  auto& d = *impl_;
  if (handle_signals) {
    // A write past the file size limit (RLIMIT_FSIZE: ulimit -f, systemd's LimitFSIZE=) would
    // end the process by SIGXFSZ, and every session with it; ignored, the write fails with
    // EFBIG, and so does only the session that made it. So would a log line written to a pipe
    // whose reader has gone (xdfsd 2>&1 | tee, a log shipper restarting): SIGPIPE, ignored,
    // leaves EPIPE, and the line is lost.
    std::signal(SIGXFSZ, SIG_IGN);
    std::signal(SIGPIPE, SIG_IGN);
    d.signals.add(SIGINT);
    d.signals.add(SIGTERM);
    if (d.next_config) d.signals.add(SIGHUP);
    d.await_signal();
  }
  d.log(fmt::format("listening on {}:{} root={} key={} memory-limit={} ({} for sessions)",
                    d.acceptor.local_endpoint().address().to_string(), d.acceptor.local_endpoint().port(), d.config.root,
                    xsec::fingerprint(d.key.public_key), d.config.memory_limit, d.budget->limit()));
  if (::access(d.config.authorized_keys.c_str(), F_OK) != 0)
    d.log("no authorized keys at " + d.config.authorized_keys + ": every client will be refused until one is added");
  d.check_descriptors();
  d.sweep_dead_instances();
  d.sweep_partials();
  d.accept();
  if (d.notify) d.notify("READY=1");
  // A handler that throws fails what it was doing (a connection's deadline still ends it), never
  // the listener.
  for (;;) {
    try {
      d.io.run();
      break;
    } catch (const std::exception& e) {
      d.log(std::string("internal error on the listener (going on): ") + e.what());
    }
  }
  // Sessions still registered (none after a clean stop) are joined here.
  for (auto& [id, r] : d.sessions)
    if (r.session->thread.joinable()) r.session->thread.join();
  d.sessions.clear();
  // Then the chains it ran as their master (their pulling hosts' sessions are gone).
  d.relays->stop_chains();
  d.sweep_stop = true;
  if (d.sweeper.joinable()) d.sweeper.join();
  {
    std::lock_guard lk(d.partial_mu);
    d.partial_stop = true;
  }
  d.partial_cv.notify_all();
  if (d.partial_sweeper.joinable()) d.partial_sweeper.join();
  // Every session removed its partial files: nothing of this run is left to sweep.
  if (!d.instance_file.empty()) ::unlink(d.instance_file.c_str());
  d.log("stopped");
}

const xsec::AuthorizedKeys& Server::Impl::authorized_keys() {
  struct stat st {};
  if (::stat(config.authorized_keys.c_str(), &st) != 0)
    throw Error(errc::no_such_file, "authorized keys '" + config.authorized_keys + "': " + std::strerror(errno));
  auto& c = keys_cache;
  // A file changed within a second of when it was read may change again with the same size and
  // time stamps (their clock is coarse): it is trusted only once it was older than that.
  const bool settled = st.st_ctim.tv_sec + 1 < c.loaded_at && st.st_mtim.tv_sec + 1 < c.loaded_at;
  const bool same = c.keys && settled && st.st_dev == c.st.st_dev && st.st_ino == c.st.st_ino &&
                    st.st_size == c.st.st_size && st.st_mtim.tv_sec == c.st.st_mtim.tv_sec &&
                    st.st_mtim.tv_nsec == c.st.st_mtim.tv_nsec && st.st_ctim.tv_sec == c.st.st_ctim.tv_sec &&
                    st.st_ctim.tv_nsec == c.st.st_ctim.tv_nsec;
  if (!same) {
    c.loaded_at = std::time(nullptr);
    c.keys = xsec::AuthorizedKeys::load(config.authorized_keys);
    c.st = st;
  }
  return *c.keys;
}

void Server::Impl::record_instance() {
  instance = "s" + SessionId::random().short_hex();
  const std::string dir = config.state_dir + "/instances";
  ::mkdir(dir.c_str(), 0700);
  const std::string path = dir + "/" + instance;
  files::Fd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!fd || ::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    log("cannot record this run in " + dir + " (" + std::strerror(errno) +
        "): partial files of a crash of it will not be removed at the next start");
    if (fd) ::unlink(path.c_str());
    return;
  }
  // The record names the root: several servers may share a state directory (one identity,
  // several roots), and a run is swept only by a later run on the same root.
  const std::string r = real(config.root) + "\n";
  if (::write(fd.get(), r.data(), r.size()) != static_cast<ssize_t>(r.size())) {
    ::unlink(path.c_str());
    return;
  }
  instance_lock = std::move(fd);
  instance_file = path;
}

// Runs that ended without cleaning up (killed, crashed) left their lock file unlocked: their
// partial files are removed, in the background, and so is the record.
void Server::Impl::sweep_dead_instances() {
  const std::string dir = config.state_dir + "/instances";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;
  std::vector<std::pair<std::string, std::shared_ptr<files::Fd>>> dead;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() != 9 || name[0] != 's' || name == instance) continue;
    auto fd = std::make_shared<files::Fd>(::open((dir + "/" + name).c_str(), O_RDWR | O_CLOEXEC));
    // Held while sweeping, so that two servers starting at once do not both sweep it.
    if (!*fd || ::flock(fd->get(), LOCK_EX | LOCK_NB) != 0) continue;  // a live run holds it
    char buf[PATH_MAX + 2];
    const ssize_t n = ::pread(fd->get(), buf, sizeof buf - 1, 0);
    std::string its_root(buf, n > 0 ? static_cast<std::size_t>(n) : 0);
    while (!its_root.empty() && its_root.back() == '\n') its_root.pop_back();
    if (its_root == real(config.root)) {
      dead.emplace_back(name, fd);
    } else if (its_root.empty() || ::access(its_root.c_str(), F_OK) != 0) {
      ::unlink((dir + "/" + name).c_str());  // a run on a root that is gone: nothing to sweep
    }
  }
  ::closedir(d);
  if (dead.empty()) return;
  try {
    sweeper = std::thread([this, dir, dead] {
      try {
        for (const auto& [name, lock] : dead) {
          const std::size_t n = files::sweep_temp_files(root.get(), name + "-", &sweep_stop);
          if (sweep_stop) return;
          ::unlink((dir + "/" + name).c_str());
          log(fmt::format("removed {} partial file{} left by an earlier run ({}) that ended without cleaning up", n,
                          n == 1 ? "" : "s", name));
        }
      } catch (...) {
        // Out of memory, most likely: the sweep stops, the server goes on (the next run sweeps).
      }
    });
  } catch (const std::system_error& e) {
    log(std::string("cannot sweep partial files of earlier runs: ") + e.what());
  }
}

void Server::Impl::sweep_partials() {
  if (config.partial_expiry.count() <= 0) return;
  try {
    partial_sweeper = std::thread([this] {
      std::unique_lock lk(partial_mu);
      while (!partial_stop) {
        lk.unlock();
        try {
          const std::size_t n = files::sweep_partials(root.get(), config.partial_expiry, &sweep_stop);
          if (n)
            log(fmt::format("removed {} partial upload{} not resumed for {} s", n, n == 1 ? "" : "s",
                            config.partial_expiry.count()));
        } catch (...) {
          // Out of memory, most likely: this sweep ends early, the next one in an hour.
        }
        lk.lock();
        partial_cv.wait_for(lk, std::chrono::hours(1), [this] { return partial_stop; });
      }
    });
  } catch (const std::system_error& e) {
    log(std::string("cannot sweep expired partial uploads: ") + e.what());
  }
}

// The configured maxima need descriptors: raise the soft limit as far as the hard one allows and
// say so when even that is short (connections beyond it are shed, see accept()).
void Server::Impl::check_descriptors() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
  // A session holds its channels, a few files, and in path mode up to max_files_in_progress
  // large files at two descriptors each.
  const rlim_t per_session = config.max_channels + 16 + 2 * files::max_files_in_progress;
  const rlim_t need = static_cast<rlim_t>(config.max_pending) + static_cast<rlim_t>(config.max_sessions) * per_session + 64;
  if (rl.rlim_cur < need && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = std::min(need, rl.rlim_max);
    ::setrlimit(RLIMIT_NOFILE, &rl);
  }
  if (rl.rlim_cur < need)
    log(fmt::format("descriptor limit is {}, the configured maxima may need {} (max-pending + max-sessions x "
                    "(max-channels + 16 + 512)): connections beyond it are refused until descriptors free up",
                    rl.rlim_cur, need));
}

void Server::Impl::accept() {
  acceptor.async_accept([this](const ErrorCode& ec, tcp::socket s) {
    if (stopping || ec == asio::error::operation_aborted) return;
    if (!ec) {
      try {
        on_accept(std::move(s));
      } catch (const std::exception& e) {
        log_rationed(std::string("cannot take a connection: ") + e.what());
      }
      return accept();
    }
    if (is_exhaustion(ec)) {
      // Out of descriptors or memory: re-arming at once would spin. Shed one waiting
      // connection with the reserve descriptor and pause accepting for a moment.
      log_rationed("accept: " + ec.message() + ": shedding a connection and pausing for 100 ms");
      shed();
      backoff.expires_after(std::chrono::milliseconds(100));
      backoff.async_wait([this](const ErrorCode& e) {
        if (!e && !stopping) accept();
      });
      return;
    }
    accept();
  });
}

void Server::Impl::shed() {
  reserve.reset();
  const int fd = ::accept4(acceptor.native_handle(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd >= 0) ::close(fd);
  reserve = files::Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
}

void Server::Impl::on_accept(tcp::socket s) {
  ErrorCode ec;
  const auto ep = s.remote_endpoint(ec);
  if (ec) return;  // gone already
  auto c = std::make_shared<Conn>(io);
  c->addr = source_of(ep.address());
  c->peer = xdsi::peer_name(s);
  make_room(c->addr);
  c->ch = std::make_unique<xdsi::Channel>(std::move(s), 0);
  c->self = pending.insert(pending.end(), c);
  ++per_address[c->addr];
  ++counted;
  pending_count = pending.size();
  c->deadline.expires_after(config.handshake_timeout);
  c->deadline.async_wait([this, w = std::weak_ptr<Conn>(c)](const ErrorCode& e) {
    auto conn = w.lock();
    if (e || !conn || conn->settled) return;
    refuse(conn, errc::timeout,
           fmt::format("the opening and handshake did not complete within {} ms", config.handshake_timeout.count()));
  });
  read_opening(c);
}

// Room for one more pending connection from addr: the caps never refuse a newcomer, they drop
// the oldest waiting connection (of that address, or of all when the server-wide cap is full).
// A real client completes its handshake in a few round trips; only connections that stall get
// old, so a flood cannot push out a client that is making progress unless it outpaces it.
void Server::Impl::make_room(const std::string& addr) {
  auto oldest = [this](const std::string* a) -> ConnPtr {
    for (int refused = 1; refused >= 0; --refused)  // those already refused and saying why, first
      for (auto& c : pending)
        if (c->counted && c->settled == static_cast<bool>(refused) && (!a || c->addr == *a)) return c;
    return nullptr;
  };
  if (auto it = per_address.find(addr); it != per_address.end() && it->second >= config.max_pending_per_address) {
    if (auto v = oldest(&addr))
      evict(v, fmt::format("{} connections from {} are pending, its limit", it->second, addr));
  }
  if (counted >= config.max_pending)
    if (auto v = oldest(nullptr)) evict(v, fmt::format("{} connections are pending, the server's limit", counted));
}

void Server::Impl::evict(const ConnPtr& c, const std::string& why) {
  if (!c->settled) metrics.add("xdfs_rejected_connections_total", {{"cause", "evicted_pending"}});
  log_rationed(fmt::format("dropped a pending connection from {}: {}", c->peer, why));
  c->settled = true;
  ErrorCode ignored;
  c->deadline.cancel(ignored);
  c->ch->close();
  release(*c);
}

void Server::Impl::uncount(Conn& c) {
  if (!c.counted) return;
  c.counted = false;
  if (auto it = per_address.find(c.addr); it != per_address.end() && --it->second == 0) per_address.erase(it);
  --counted;
}

void Server::Impl::release(Conn& c) {
  if (c.released) return;
  c.released = true;
  uncount(c);
  if (c.join_slot) {
    --*c.join_slot;
    c.join_slot.reset();
  }
  auto keep = *c.self;  // erasing the list node must not destroy c under our feet
  pending.erase(c.self);
  pending_count = pending.size();
}

// Preamble, then the NEGO frame's header, then its payload: at most a few hundred bytes, each
// part read only once the one before it checked out.
void Server::Impl::read_opening(const ConnPtr& c) {
  auto& sock = c->ch->socket();
  asio::async_read(sock, asio::buffer(c->pre), [this, c](const ErrorCode& ec, std::size_t n) {
    if (c->settled) return;
    if (ec)
      return refuse(c, errc::protocol_error,
                    fmt::format("connection ended after {} of {} bytes of the preamble (truncated header)", n,
                                wire::preamble_size),
                    gone(ec));
    auto version = wire::decode_preamble(c->pre);
    if (!version) return refuse(c, errc::protocol_error, "not an xDFS client (bad magic bytes)");
    if (*version != protocol_version)
      return refuse(c, errc::bad_version,
                    fmt::format("client speaks protocol version {}, this server speaks {}", *version, protocol_version));
    asio::async_read(c->ch->socket(), asio::buffer(c->hdr), [this, c](const ErrorCode& ec, std::size_t n) {
      if (c->settled) return;
      if (ec)
        return refuse(c, errc::protocol_error,
                      fmt::format("connection ended after {} of {} bytes of the frame header (truncated header)", n,
                                  wire::frame_header_size),
                      gone(ec));
      std::string why;
      auto h = wire::decode(std::span<const std::uint8_t, wire::frame_header_size>(c->hdr), &why);
      if (!h) return refuse(c, errc::protocol_error, why);
      if (h->event != wire::ChannelEvent::nego)
        return refuse(c, errc::protocol_error,
                      std::string("expected a negotiation header, got ") + wire::to_string(h->event));
      if (h->length == 0 || h->length > wire::max_opening_payload)
        return refuse(c, errc::protocol_error,
                      fmt::format("opening of {} bytes (1..{} allowed): this payload exceeds the limit", h->length,
                                  wire::max_opening_payload));
      c->payload.resize(h->length);
      asio::async_read(c->ch->socket(), asio::buffer(c->payload), [this, c](const ErrorCode& ec, std::size_t n) {
        if (c->settled) return;
        if (ec)
          return refuse(c, errc::protocol_error,
                        fmt::format("connection ended after {} of {} bytes of the negotiation header (truncated header)",
                                    n, c->payload.size()),
                        gone(ec));
        on_opening(c);
      });
    });
  });
}

void Server::Impl::on_opening(const ConnPtr& c) {
  std::string why;
  auto o = wire::decode_opening(c->payload, &why);
  if (!o) return refuse(c, errc::protocol_error, why);
  if (o->version != protocol_version)
    return refuse(c, errc::bad_version,
                  fmt::format("negotiation header version {}, this server speaks {}", o->version, protocol_version));
  // A join must match its session's protection (start_join), whatever a reload set since.
  if (!o->join && o->protect < config.min_protect)
    return refuse(c, errc::permission_denied,
                  fmt::format("this server requires protection '{}' or stronger, the client asked for '{}'",
                              xsec::to_string(static_cast<xsec::Protect>(config.min_protect)),
                              xsec::to_string(static_cast<xsec::Protect>(o->protect))));
  c->opening = std::move(*o);
  c->opening_bytes.reserve(c->pre.size() + c->hdr.size() + c->payload.size());
  c->opening_bytes.assign(c->pre.begin(), c->pre.end());
  c->opening_bytes.insert(c->opening_bytes.end(), c->hdr.begin(), c->hdr.end());
  c->opening_bytes.insert(c->opening_bytes.end(), c->payload.begin(), c->payload.end());
  c->payload = {};
  if (c->opening.join) return start_join(c);
  if (sessions.count(c->opening.session))
    return refuse(c, errc::bad_channel, "session " + c->opening.session.short_hex() + " already exists");
  start_noise(c);
}

// Public-key work runs one step at a time, the source addresses that have some taking turns: a
// flood of handshakes from some addresses delays the others by one step per address at most.
xsec::Defer Server::Impl::defer_for(const ConnPtr& c) {
  return [this, w = std::weak_ptr<Conn>(c)](std::function<void()> work) {
    auto conn = w.lock();
    if (!conn || conn->settled) return;
    auto& t = dh_jobs[conn->addr];
    // Work of connections that went meanwhile leaves now: an address never has more queued than
    // it has connections pending.
    std::erase_if(t.jobs, [](const auto& j) {
      auto cj = j.first.lock();
      return !cj || cj->settled;
    });
    t.jobs.emplace_back(w, std::move(work));
    if (!t.queued) {
      t.queued = true;
      dh_turns.push_back(conn->addr);
    }
    schedule_dh();
  };
}

void Server::Impl::schedule_dh() {
  if (dh_posted || dh_turns.empty()) return;
  dh_posted = true;
  asio::post(io, [this] {
    dh_posted = false;
    if (dh_turns.empty()) return;
    const std::string addr = std::move(dh_turns.front());
    dh_turns.pop_front();
    auto it = dh_jobs.find(addr);
    if (it == dh_jobs.end()) return schedule_dh();
    if (it->second.jobs.empty()) {
      dh_jobs.erase(it);
      return schedule_dh();
    }
    auto job = std::move(it->second.jobs.front());
    it->second.jobs.pop_front();
    if (it->second.jobs.empty()) dh_jobs.erase(it);
    else dh_turns.push_back(addr);
    schedule_dh();  // before the work: if it throws, the others still get their turn
    if (auto conn = job.first.lock(); conn && !conn->settled) job.second();
  });
}

void Server::Impl::start_noise(const ConnPtr& c) {
  const auto mode = static_cast<xsec::Protect>(c->opening.protect);
  const auto cipher = static_cast<xsec::Cipher>(c->opening.cipher);
  xsec::server_establish(*c->ch, c->opening_bytes, key, mode, cipher, defer_for(c),
                         [this, c](xsec::HandshakeResult r) { on_established(c, std::move(r)); });
}

// What the negotiation asks must fit this server's limits; the reason otherwise ("" if it fits).
std::string Server::Impl::check(const wire::Negotiation& n, errc& code) const {
  code = errc::bad_argument;
  if (n.channel_count == 0) return "channel count n = 0";
  if (n.channel_count > config.max_channels) {
    code = errc::limit_exceeded;
    return fmt::format("n = {} channels requested, this server allows {}", n.channel_count, config.max_channels);
  }
  if (n.block_size < wire::min_block_size || n.block_size > config.max_block_size)
    return fmt::format("block size {} is outside {}..{}", n.block_size, wire::min_block_size, config.max_block_size);
  if (n.extended_flags & ~wire::known_flags) return fmt::format("unknown extended flags {:#x}", n.extended_flags);
  const bool memory = (n.extended_flags & wire::flag_memory) != 0;
  if (memory && !config.allow_memory_mode) return "memory mode is disabled on this server (xdfsd --allow-memory-mode)";
  return runtime::check_operation(config, n, true, code);
}

void Server::Impl::on_established(const ConnPtr& c, xsec::HandshakeResult r) {
  if (c->settled) return;
  if (r.code != errc::ok) return refuse(c, r.code, r.message);
  std::string why;
  auto nego = wire::decode_negotiation(r.payload, &why);
  if (!nego) return refuse(c, errc::protocol_error, "negotiation: " + why);
  // An upload that feeds a place in a relay chain writes the place's file: what it names itself
  // does not count.
  std::shared_ptr<runtime::RelaySlot> slot;
  if (!nego->relay_ticket.empty()) {
    slot = relays->find(nego->relay_ticket);
    if (slot) {
      nego->remote_path = slot->path;
      nego->file_size = slot->size;
      nego->source_mtime_ns = slot->mtime_ns;
      nego->fresh = false;
    }
  }
  errc code = errc::ok;
  if (auto bad = check(*nego, code); !bad.empty()) return refuse(c, code, bad);
  // Who it is and what it may do.
  const std::string who = "client key " + xsec::fingerprint(r.remote_static);
  const xsec::AuthorizedKeys* keys = nullptr;
  try {
    keys = &authorized_keys();
  } catch (const Error& e) {
    return refuse(c, errc::auth_failed, std::string("the server cannot check client keys: ") + e.what());
  }
  const xsec::Permission* perm = keys->find(r.remote_static);
  files::Fd confined;
  if (!nego->relay_ticket.empty()) {
    // An upload that feeds a place in a relay chain: registered here by its master, whose rights
    // it writes with, whoever sends it (the master, or the xdfsd upstream it gave the ticket).
    if (!slot || slot->cancel.load())
      return refuse(c, errc::auth_failed, who + " offers a relay ticket that no relay here holds");
    if (nego->block_size != slot->block_size)
      return refuse(c, errc::bad_argument,
                    fmt::format("the relay's blocks are {} bytes, not {}", slot->block_size, nego->block_size));
    perm = keys->find(slot->master);
    if (!perm) return refuse(c, errc::auth_failed, "the relay's master key is no longer in the server's authorized keys");
    if (!perm->write) return refuse(c, errc::permission_denied, "the relay's master key may only download (read-only)");
    int fd = ::fcntl(slot->root.get(), F_DUPFD_CLOEXEC, 3);
    if (fd < 0) return refuse(c, errc_from_errno(errno), std::string("relay root: ") + std::strerror(errno));
    confined = files::Fd(fd);
  }
  if (!perm) return refuse(c, errc::auth_failed, who + " is not in the server's authorized keys");
  if (!perm->write && (nego->mode == Mode::upload || nego->mode == Mode::relay))
    return refuse(c, errc::permission_denied, who + " may only download (read-only)");
  if (!confined && !perm->subdir.empty())
    if (auto st = files::open_beneath(root.get(), perm->subdir, O_PATH | O_DIRECTORY, 0, confined); !st)
      return refuse(c, st.code, who + " is confined to " + st.message);
  Admission a{c, std::move(*nego), std::move(r), *perm, std::move(confined), Clock::now()};
  // Authenticated: no longer one of the unauthenticated many (its deadline and caps are done).
  ErrorCode ignored;
  c->deadline.cancel(ignored);
  uncount(*c);
  if (waiting.empty() && try_admit(a)) return;
  // First come, first admitted: behind those already waiting for memory.
  if (waiting.size() >= config.max_sessions)
    return refuse(c, errc::limit_exceeded, fmt::format("{} sessions are waiting for memory, the limit", waiting.size()));
  // What a key has waiting counts against its limits as if it ran: one key cannot fill the
  // queue and keep every other key out of it.
  KeyUse queued;
  for (const auto& w : waiting)
    if (!w.c->settled && w.r.remote_static == a.r.remote_static) {
      ++queued.sessions;
      queued.channels += w.nego.channel_count;
    }
  const KeyUse use = use_of(a.r.remote_static);
  const KeyUse max = limits_of(a.perm);
  if (use.sessions + queued.sessions >= max.sessions)
    return refuse(c, errc::limit_exceeded, fmt::format("{} has {} sessions running and {} waiting for memory, its limit",
                                                       who, use.sessions, queued.sessions));
  if (use.channels + queued.channels + a.nego.channel_count > max.channels)
    return refuse(c, errc::limit_exceeded,
                  fmt::format("{} has {} channels open and {} waiting for memory, and asks for {} more, its limit is {}",
                              who, use.channels, queued.channels, a.nego.channel_count, max.channels));
  log_rationed(fmt::format("{}: a session from {} waits for memory ({} waiting)", who, c->peer, waiting.size() + 1));
  waiting.push_back(std::move(a));
  arm_waiting();
}

// Admission: the server's and the key's limits, then memory for the session itself. True once
// it is settled (a session, or refused); false while it must wait for memory (sessions that end
// give some back), which it does for memory_wait at most.
bool Server::Impl::try_admit(Admission& a) {
  const auto& c = a.c;
  if (c->settled) return true;
  const std::string who = "client key " + xsec::fingerprint(a.r.remote_static);
  auto no = [&](errc code, const std::string& why) {
    refuse(c, code, why);
    return true;
  };
  if (stopping) return no(errc::shutting_down, "server is stopping");
  if (sessions.size() >= config.max_sessions)
    return no(errc::limit_exceeded, fmt::format("{} sessions are running, the limit", config.max_sessions));
  if (sessions.count(c->opening.session))
    return no(errc::bad_channel, "session " + c->opening.session.short_hex() + " already exists");
  const KeyUse use = use_of(a.r.remote_static);
  const KeyUse max = limits_of(a.perm);
  if (use.sessions >= max.sessions)
    return no(errc::limit_exceeded, fmt::format("{} has {} sessions running, its limit", who, use.sessions));
  if (use.channels + a.nego.channel_count > max.channels)
    return no(errc::limit_exceeded, fmt::format("{} has {} channels open and asks for {} more, its limit is {}", who,
                                                use.channels, a.nego.channel_count, max.channels));
  auto overhead = Reservation::take(budget.get(), session_overhead(a.nego.channel_count));
  if (!overhead) {
    if (Clock::now() - a.since <= memory_wait) return false;
    return no(errc::limit_exceeded,
              fmt::format("the server's memory for sessions ({} MiB) stayed in use for {} s; try again later",
                          budget->limit() >> 20, memory_wait.count() / 1000));
  }
  create_session(c, std::move(a.nego), a.r, a.perm, std::move(a.confined), std::move(*overhead));
  return true;
}

void Server::Impl::admit_waiting() {
  while (!waiting.empty() && try_admit(waiting.front())) waiting.pop_front();
  arm_waiting();
}

void Server::Impl::arm_waiting() {
  if (waiting.empty() || waiting_armed) return;
  waiting_armed = true;
  waiting_timer.expires_after(std::chrono::milliseconds(50));
  waiting_timer.async_wait([this](const ErrorCode& ec) {
    waiting_armed = false;
    if (!ec) admit_waiting();
  });
}

void Server::Impl::create_session(const ConnPtr& c, wire::Negotiation nego, xsec::HandshakeResult& r,
                                  const xsec::Permission& perm, files::Fd confined, Reservation overhead) {
  const SessionId id = c->opening.session;
  Record rec;
  rec.overhead = std::move(overhead);
  rec.session = std::make_unique<Session>();
  Session* sp = rec.session.get();
  sp->root = std::move(confined);
  sp->config = config;
  runtime::Client client{r.remote_static, xsec::fingerprint(r.remote_static), perm.write, limits_of(perm).sessions};
  sp->env = std::unique_ptr<runtime::SessionEnv>(new runtime::SessionEnv{
      sp->io, sp->config, sp->root ? sp->root.get() : root.get(), id, c->peer, instance + "-" + id.short_hex(), c->opening,
      nego, client,
      r.session_secret, *budget, *total_rate, relays.get(),
      [this, sp](SessionReport rep) {
        // Session thread: log the end line and let the loop run dry (lingering closes last).
        if (sp->reported) return;
        sp->reported = true;
        const char* outcome = rep.code == errc::ok ? "ok" : xdfs::to_string(rep.code);
        metrics.add("xdfs_sessions_ended_total", {{"mode", xdfs::to_string(rep.mode)}, {"outcome", outcome}});
        log(format_report(rep));
        sp->guard.reset();
      },
      [this](const std::string& line) { log(line); }, &metrics});
  sp->guard.emplace(sp->io.get_executor());
  rec.secret = r.session_secret;
  rec.opening = c->opening;
  rec.channels = nego.channel_count;
  rec.handed.assign(nego.channel_count, false);
  rec.handed[0] = true;
  rec.client = r.remote_static;
  const std::uint32_t channels = rec.channels;
  const xsec::Key32 who = rec.client;
  // What allocates comes before the session's thread starts, and nothing after it can throw out
  // of here: a record whose thread runs must be in `sessions` (a std::thread destroyed joinable
  // ends the process), with its key's counts there to count down.
  auto d = std::make_shared<xdsi::Channel::Detached>();
  const auto at = sessions.emplace(id, std::move(rec)).first;
  KeyUse* use = nullptr;
  try {
    use = &key_use[who];
    sp->thread = std::thread([this, sp, id] {
      run_session(*sp);
      try {
        asio::post(io, [this, id] { reap(id); });
      } catch (...) {  // out of memory: the record stays, counted (a stop then waits for it),
      }                  // rather than the process ending
    });
  } catch (const std::exception& e) {
    sessions.erase(at);
    if (use && use->sessions == 0) key_use.erase(who);
    return refuse(c, errc::limit_exceeded, std::string("cannot start a session thread: ") + e.what());
  }
  // The channel moves to the session's loop: its thread owns it from now on.
  c->settled = true;
  ErrorCode ignored;
  c->deadline.cancel(ignored);
  *d = c->ch->detach();
  release(*c);
  d->index = 0;
  ++use->sessions;
  use->channels += channels;
  channels_active += channels;
  active = sessions.size();
  try {
    metrics.add("xdfs_sessions_started_total", {{"mode", xdfs::to_string(nego.mode)}});
  } catch (const std::exception&) {  // (a count lost, not the session)
  }
  try {
    asio::post(sp->io, [sp, d] {
      if (!sp->handler) return;  // it could not be made: the channel closes with d
      auto ch = xdsi::Channel::adopt(sp->io, std::move(*d));
      if (!ch) return;
      // The handshake's last word: the session exists, its other channels may join now.
      ch->send_control(wire::ChannelEvent::handshake, {});
      sp->handler->add_channel(std::move(ch));
    });
  } catch (const std::exception&) {
    // Out of memory: the session never gets its channel (it closes with d); its loop stops, its
    // thread ends and it is reaped. (The guard is the session thread's to reset.)
    sp->io.stop();
  }
}

void Server::Impl::start_join(const ConnPtr& c) {
  const auto& o = c->opening;
  auto it = sessions.find(o.session);
  if (it == sessions.end()) return refuse(c, errc::bad_channel, "no session " + o.session.short_hex() + " to join");
  Record& rec = it->second;
  if (o.protect != rec.opening.protect || o.cipher != rec.opening.cipher)
    return refuse(c, errc::bad_channel,
                  fmt::format("channel {} does not match the negotiation of session {}", o.channel_index,
                              o.session.short_hex()));
  if (o.channel_index >= rec.channels)
    return refuse(c, errc::bad_channel,
                  fmt::format("channel index {} is not below n = {} of session {}", o.channel_index, rec.channels,
                              o.session.short_hex()));
  if (std::find(rec.handed.begin(), rec.handed.end(), false) == rec.handed.end())
    return refuse(c, errc::bad_channel,
                  fmt::format("session {} already has its {} channels", o.session.short_hex(), rec.channels));
  // Joins count against their session, not the pending caps: a session's own n channels
  // arriving at once must not push each other out. When n are there already, the oldest goes
  // (one refused first): a stranger who saw the session id can delay a real channel by
  // holding places, never keep it out, and none claims an index before it has proved the secret.
  if (*rec.joins >= rec.channels) {
    ConnPtr victim;
    for (int refused = 1; refused >= 0 && !victim; --refused)
      for (auto& p : pending)
        if (p->join_slot == rec.joins && p->settled == static_cast<bool>(refused)) {
          victim = p;
          break;
        }
    if (victim)
      evict(victim, fmt::format("session {} has {} channels proving themselves, its n", o.session.short_hex(),
                                *rec.joins));
  }
  ++*rec.joins;
  c->join_slot = rec.joins;
  uncount(*c);
  xsec::server_join(*c->ch, c->opening_bytes, o.join_nonce, rec.secret, static_cast<xsec::Protect>(o.protect),
                    static_cast<xsec::Cipher>(o.cipher),
                    [this, c](xsec::HandshakeResult r) { on_joined(c, std::move(r)); });
}

void Server::Impl::on_joined(const ConnPtr& c, xsec::HandshakeResult r) {
  if (c->settled) return;
  auto it = sessions.find(c->opening.session);
  if (r.code != errc::ok) {
    // A channel that cannot prove the session secret does not join and learns nothing more;
    // the session goes on waiting for the real one (bounded by its join timeout).
    log_rationed(fmt::format("session {} refused channel {} from {}: {}: {}", c->opening.session.short_hex(),
                             c->opening.channel_index, c->peer, to_string(r.code), r.message));
    ++rejected;
    metrics.add("xdfs_rejected_connections_total", {{"cause", xdfs::to_string(r.code)}});
    c->settled = true;
    ErrorCode ignored;
    c->deadline.cancel(ignored);
    c->ch->close();
    release(*c);
    return;
  }
  if (it == sessions.end() || c->join_slot != it->second.joins)
    return refuse(c, errc::bad_channel, "session " + c->opening.session.short_hex() + " has ended");
  // Each index is handed over once: whichever proved itself second is refused here, and holds
  // its place among the joins until it has gone.
  const auto idx = c->opening.channel_index;
  if (it->second.handed[idx])
    return refuse(c, errc::bad_channel,
                  fmt::format("duplicate channel index {} in session {}", idx, c->opening.session.short_hex()));
  it->second.handed[idx] = true;
  Session* sp = it->second.session.get();
  c->settled = true;
  ErrorCode ignored;
  c->deadline.cancel(ignored);
  auto d = std::make_shared<xdsi::Channel::Detached>(c->ch->detach());
  d->index = c->opening.channel_index;
  release(*c);
  // With its n channels the session needs no more: whoever else is still proving itself for it
  // goes now rather than at its deadline.
  const Record& rec = it->second;
  if (std::find(rec.handed.begin(), rec.handed.end(), false) == rec.handed.end()) {
    std::vector<ConnPtr> rest;
    for (auto& p : pending)
      if (p->join_slot == rec.joins && !p->settled) rest.push_back(p);
    for (auto& p : rest)
      evict(p, fmt::format("session {} has its {} channels", c->opening.session.short_hex(), rec.channels));
  }
  asio::post(sp->io, [sp, d] {
    if (!sp->handler) return;
    if (auto ch = xdsi::Channel::adopt(sp->io, std::move(*d))) sp->handler->add_channel(std::move(ch));
  });
}

// Tells the peer why (over the protected channel once it has keys), then closes: at once when
// the peer closes too, after a second at the latest. Until then it stays under the caps.
void Server::Impl::refuse(const ConnPtr& c, errc code, const std::string& message, bool peer_gone) {
  if (c->settled) return;
  c->settled = true;
  ++rejected;
  metrics.add("xdfs_rejected_connections_total", {{"cause", xdfs::to_string(code)}});
  log_rationed(fmt::format("rejected channel from {}: {}: {}", c->peer, to_string(code), message));
  if (!c->ch->open()) return release(*c);
  if (peer_gone) {
    // The peer sends no more (it may still read: a half-close): the answer goes out and the
    // descriptor comes back as soon as it has left, with nothing unread to turn the close into
    // a reset. A flood of dead connections must not keep descriptors for a second each.
    c->ch->send_control(wire::ChannelEvent::exception,
                        wire::encode(wire::ExceptionHeader{code, message, c->opening.channel_index, 0}),
                        [this, c](const ErrorCode&) {
                          ErrorCode ignored;
                          c->deadline.cancel(ignored);
                          c->ch->close();
                          release(*c);
                        });
    return;
  }
  c->ch->send_control(wire::ChannelEvent::exception,
                      wire::encode(wire::ExceptionHeader{code, message, c->opening.channel_index, 0}),
                      [c](const ErrorCode&) { c->ch->shutdown_send(); });
  c->deadline.expires_after(std::chrono::seconds(1));
  c->deadline.async_wait([this, c](const ErrorCode& e) {
    if (e == asio::error::operation_aborted && !c->released) return;
    c->ch->close();
    release(*c);
  });
}

void Server::Impl::run_session(Session& s) {
  try {
    s.handler = factory(*s.env);
  } catch (const std::exception& e) {
    log(fmt::format("session {} could not start: {}", s.env->id.short_hex(), e.what()));
    metrics.add("xdfs_sessions_ended_total", {{"mode", xdfs::to_string(s.env->nego.mode)}, {"outcome", "internal"}});
    s.reported = true;
    s.guard.reset();
  }
  // A handler that throws fails its own session: the mode tells the peer and removes partial
  // files (crash); if even that throws, the session is torn down by its destructors. Other
  // sessions and the listener never see it.
  int crashes = 0;
  for (;;) {
    std::string what;
    try {
      s.io.run();
      break;
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
      what = "unknown exception";
    }
    if (++crashes == 1 && s.handler) {
      try {
        s.handler->crash(what);
        continue;
      } catch (...) {
      }
    }
    if (!s.reported) {
      s.reported = true;
      SessionReport rep;
      rep.id = s.env->id;
      rep.peer = s.env->peer;
      rep.mode = s.env->nego.mode;
      rep.path = s.env->nego.remote_path;
      rep.channels = s.env->nego.channel_count;
      rep.code = errc::internal;
      rep.message = what;
      metrics.add("xdfs_sessions_ended_total", {{"mode", xdfs::to_string(rep.mode)}, {"outcome", "internal"}});
      log(format_report(rep));
    }
    break;
  }
  // Teardown happens here, on the session's thread, never on the listener: the handler joins
  // its disk threads and workers (whose long operations stop once the session has ended).
  s.handler.reset();
}

void Server::Impl::reap(const SessionId& id) {
  auto it = sessions.find(id);
  if (it == sessions.end()) return;
  if (it->second.session->thread.joinable()) it->second.session->thread.join();
  if (auto u = key_use.find(it->second.client); u != key_use.end()) {
    --u->second.sessions;
    u->second.channels -= it->second.channels;
    if (u->second.sessions == 0) key_use.erase(u);
  }
  channels_active -= it->second.channels;
  sessions.erase(it);
  active = sessions.size();
  if (stopping && sessions.empty()) io.stop();
  if (!waiting.empty()) admit_waiting();
}

void Server::Impl::begin_stop() {
  if (stopping) return;
  stopping = true;
  if (notify) notify("STOPPING=1");
  ErrorCode ignored;
  acceptor.close(ignored);
  signals.cancel(ignored);
  backoff.cancel(ignored);
  waiting_timer.cancel(ignored);
  for (auto& a : waiting) refuse(a.c, errc::shutting_down, "server is stopping");
  waiting.clear();
  for (auto it = pending.begin(); it != pending.end();) {
    auto c = *it++;
    c->settled = true;
    c->deadline.cancel(ignored);
    c->ch->close();
    release(*c);
  }
  if (sessions.empty()) {
    io.stop();
    return;
  }
  for (auto& [id, r] : sessions) {
    Session* sp = r.session.get();
    asio::post(sp->io, [sp] {
      if (sp->handler) sp->handler->shutdown();
    });
  }
}

}  // namespace xdfs
