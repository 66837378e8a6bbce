#include "xdfs/server.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <fmt/chrono.h>
#include <fmt/core.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <thread>

#include "xdfs/files.hpp"

namespace xdfs {

namespace asio = boost::asio;
using xdsi::ErrorCode;
using xdsi::tcp;

std::string format_report(const SessionReport& r) {
  const double rate = r.seconds > 0 ? static_cast<double>(r.bytes) / r.seconds : 0.0;
  std::string line = fmt::format("session {} end peer={} mode={} path={} channels={} bytes={} seconds={:.3f} rate={:.1f}MB/s",
                                 r.id.short_hex(), r.peer, to_string(r.mode), r.path, r.channels, r.bytes, r.seconds,
                                 rate / 1e6);
  if (r.code == errc::ok) return line + " status=ok";
  return line + " status=error: " + to_string(r.code) + (r.message.empty() ? "" : ": " + r.message);
}

namespace {

void default_log(const std::string& line) {
  auto now = std::chrono::system_clock::now();
  auto t = std::chrono::system_clock::to_time_t(now);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  fmt::print(stderr, "{:%Y-%m-%dT%H:%M:%S}Z xdfsd: {}\n", tm, line);
  std::fflush(stderr);
}

struct Session {
  asio::io_context io{1};
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> guard;
  std::unique_ptr<runtime::SessionEnv> env;
  std::unique_ptr<runtime::SessionHandler> handler;
  std::thread thread;
};

}  // namespace

struct Server::Impl {
  ServerConfig config;
  runtime::HandlerFactory factory;
  files::Fd root;
  xsec::KeyPair key;
  asio::io_context io{1};
  tcp::acceptor acceptor{io};
  asio::signal_set signals{io};
  std::map<SessionId, std::unique_ptr<Session>> sessions;  // touched only on the listener thread
  std::atomic<std::size_t> active{0};
  std::atomic<std::size_t> rejected{0};
  bool stopping = false;

  void log(const std::string& line) const { config.log ? config.log(line) : default_log(line); }

  void accept();
  void handshake(tcp::socket s);
  void reject(std::shared_ptr<tcp::socket> s, const std::string& peer, errc code, const std::string& message);
  void admit(tcp::socket s, wire::Negotiation nego, std::vector<std::uint8_t> opening, const std::string& peer);
  void reap(const SessionId& id);
  void begin_stop();
};

Server::Server(ServerConfig config, runtime::HandlerFactory factory) : impl_(std::make_unique<Impl>()) {
  impl_->config = std::move(config);
  impl_->factory = std::move(factory);
  auto& c = impl_->config;
  if (c.root.empty()) throw Error(errc::bad_argument, "no root directory given");
  int fd = ::open(c.root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw Error(errc_from_errno(errno), "root '" + c.root + "': " + std::strerror(errno));
  impl_->root = files::Fd(fd);
  if (c.state_dir.empty()) {
    if (const char* s = std::getenv("XDFS_STATE_DIR"); s && *s) c.state_dir = s;
    else if (const char* x = std::getenv("XDG_STATE_HOME"); x && *x) c.state_dir = std::string(x) + "/xdfsd";
    else c.state_dir = std::string(std::getenv("HOME") ? std::getenv("HOME") : ".") + "/.local/state/xdfsd";
  }
  if (c.authorized_keys.empty()) c.authorized_keys = c.state_dir + "/authorized_keys";
  bool created = false;
  impl_->key = xsec::load_or_create_key(c.state_dir + "/server_x25519", &created);
  if (created) impl_->log("made a new server key in " + c.state_dir + "/server_x25519");
  // A malformed authorized-keys file is an error now rather than at the first client.
  if (::access(c.authorized_keys.c_str(), F_OK) == 0) (void)xsec::AuthorizedKeys::load(c.authorized_keys);
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
std::size_t Server::rejected_channels() const noexcept { return impl_->rejected.load(); }
const xsec::Key32& Server::public_key() const noexcept { return impl_->key.public_key; }

void Server::stop() {
  asio::post(impl_->io, [impl = impl_.get()] { impl->begin_stop(); });
}

void Server::run(bool handle_signals) {
  auto& d = *impl_;
  if (handle_signals) {
    d.signals.add(SIGINT);
    d.signals.add(SIGTERM);
    d.signals.async_wait([&d](const ErrorCode& ec, int sig) {
      if (ec) return;
      d.log(fmt::format("signal {} received: stopping", sig == SIGINT ? "SIGINT" : "SIGTERM"));
      d.begin_stop();
    });
  }
  d.log(fmt::format("listening on {}:{} root={} key={}", d.acceptor.local_endpoint().address().to_string(),
                    d.acceptor.local_endpoint().port(), d.config.root, xsec::fingerprint(d.key.public_key)));
  if (::access(d.config.authorized_keys.c_str(), F_OK) != 0)
    d.log("no authorized keys at " + d.config.authorized_keys + ": every client will be refused until one is added");
  d.accept();
  d.io.run();
  // Sessions still registered (none after a clean stop) are joined here.
  for (auto& [id, s] : d.sessions)
    if (s->thread.joinable()) s->thread.join();
  d.sessions.clear();
  d.log("stopped");
}

void Server::Impl::accept() {
  acceptor.async_accept([this](const ErrorCode& ec, tcp::socket s) {
    if (stopping) return;
    if (!ec) {
      handshake(std::move(s));
    } else if (ec == asio::error::no_descriptors || ec == asio::error::no_buffer_space) {
      log("accept: " + ec.message());
    }
    accept();
  });
}

// Reads preamble + NEGO frame under one deadline, checks every field, then admits the channel.
void Server::Impl::handshake(tcp::socket sock) {
  struct State {
    std::shared_ptr<tcp::socket> s;
    asio::steady_timer timer;
    wire::PreambleBytes pre{};
    wire::HeaderBytes hdr{};
    std::vector<std::uint8_t> payload;
    std::string peer;
    std::size_t got = 0;
  };
  auto st = std::make_shared<State>(
      State{std::make_shared<tcp::socket>(std::move(sock)), asio::steady_timer(io), {}, {}, {}, {}, 0});
  st->peer = xdsi::peer_name(*st->s);
  st->timer.expires_after(config.handshake_timeout);
  st->timer.async_wait([this, st](const ErrorCode& ec) {
    if (ec) return;
    reject(st->s, st->peer, errc::timeout,
           fmt::format("negotiation header did not arrive within {} ms", config.handshake_timeout.count()));
  });
  auto truncated = [this, st](const char* what, std::size_t got, std::size_t want) {
    st->timer.cancel();
    reject(st->s, st->peer, errc::protocol_error,
           fmt::format("connection ended after {} of {} bytes of the {} (truncated header)", got, want, what));
  };
  asio::async_read(*st->s, asio::buffer(st->pre), [this, st, truncated](const ErrorCode& ec, std::size_t n) {
    if (ec == asio::error::operation_aborted) return;
    if (ec) return truncated("preamble", n, wire::preamble_size);
    auto version = wire::decode_preamble(st->pre);
    if (!version) {
      st->timer.cancel();
      return reject(st->s, st->peer, errc::protocol_error, "not an xDFS client (bad magic bytes)");
    }
    if (*version != protocol_version) {
      st->timer.cancel();
      return reject(st->s, st->peer, errc::bad_version,
                    fmt::format("client speaks protocol version {}, this server speaks {}", *version, protocol_version));
    }
    asio::async_read(*st->s, asio::buffer(st->hdr), [this, st, truncated](const ErrorCode& ec, std::size_t n) {
      if (ec == asio::error::operation_aborted) return;
      if (ec) return truncated("frame header", n, wire::frame_header_size);
      std::string why;
      auto h = wire::decode(std::span<const std::uint8_t, wire::frame_header_size>(st->hdr), &why);
      if (!h || h->event != wire::Event::nego) {
        st->timer.cancel();
        return reject(st->s, st->peer, errc::protocol_error,
                      h ? std::string("expected a negotiation header, got ") + wire::to_string(h->event) : why);
      }
      st->payload.resize(h->length);
      asio::async_read(*st->s, asio::buffer(st->payload), [this, st, truncated](const ErrorCode& ec, std::size_t n) {
        if (ec == asio::error::operation_aborted) return;
        if (ec) return truncated("negotiation header", n, st->payload.size());
        st->timer.cancel();
        std::string why;
        auto nego = wire::decode_negotiation(st->payload, &why);
        if (!nego) return reject(st->s, st->peer, errc::protocol_error, why);
        auto& n_ = *nego;
        auto refuse = [&](errc c, const std::string& m) { reject(st->s, st->peer, c, m); };
        if (n_.version != protocol_version)
          return refuse(errc::bad_version, fmt::format("negotiation header version {}, this server speaks {}",
                                                       n_.version, protocol_version));
        if (n_.channel_count == 0) return refuse(errc::bad_argument, "channel count n = 0");
        if (n_.channel_count > config.max_channels)
          return refuse(errc::limit_exceeded,
                        fmt::format("n = {} channels requested, this server allows {}", n_.channel_count,
                                    config.max_channels));
        if (n_.channel_index >= n_.channel_count)
          return refuse(errc::bad_channel,
                        fmt::format("channel index {} is not below n = {}", n_.channel_index, n_.channel_count));
        if (n_.block_size < wire::min_block_size || n_.block_size > config.max_block_size)
          return refuse(errc::bad_argument, fmt::format("block size {} is outside {}..{}", n_.block_size,
                                                        wire::min_block_size, config.max_block_size));
        if (n_.extended_flags & ~wire::known_flags)
          return refuse(errc::bad_argument, fmt::format("unknown extended flags {:#x}", n_.extended_flags));
        if ((n_.extended_flags & wire::flag_memory) && !config.allow_memory_mode)
          return refuse(errc::bad_argument, "memory mode is disabled on this server (xdfsd --allow-memory-mode)");
        if (auto s = files::check_relative_path(n_.remote_path); !s) return refuse(s.code, s.message);
        std::vector<std::uint8_t> opening(st->pre.begin(), st->pre.end());
        opening.insert(opening.end(), st->hdr.begin(), st->hdr.end());
        opening.insert(opening.end(), st->payload.begin(), st->payload.end());
        admit(std::move(*st->s), std::move(n_), std::move(opening), st->peer);
      });
    });
  });
}

void Server::Impl::reject(std::shared_ptr<tcp::socket> s, const std::string& peer, errc code, const std::string& message) {
  if (!s->is_open()) return;
  ++rejected;
  log(fmt::format("rejected channel from {}: {}: {}", peer, to_string(code), message));
  // Tell the peer why, then close; a peer that does not read is closed on after the deadline.
  auto buf = std::make_shared<std::vector<std::uint8_t>>();
  auto payload = wire::encode(wire::ExceptionHeader{code, message, 0, 0});
  wire::FrameHeader h;
  h.event = wire::Event::exception;
  h.length = static_cast<std::uint32_t>(payload.size());
  auto hb = wire::encode(h);
  buf->insert(buf->end(), hb.begin(), hb.end());
  buf->insert(buf->end(), payload.begin(), payload.end());
  auto timer = std::make_shared<asio::steady_timer>(io, std::chrono::seconds(2));
  timer->async_wait([s](const ErrorCode& ec) {
    if (!ec) {
      ErrorCode ignored;
      s->close(ignored);
    }
  });
  asio::async_write(*s, asio::buffer(*buf), [s, buf, timer](const ErrorCode&, std::size_t) {
    ErrorCode ignored;
    s->shutdown(tcp::socket::shutdown_send, ignored);
    // Let the peer read the exception before the close; the timer closes at the latest.
  });
}

void Server::Impl::admit(tcp::socket s, wire::Negotiation nego, std::vector<std::uint8_t> opening,
                         const std::string& peer) {
  auto it = sessions.find(nego.session);
  if (nego.join && it == sessions.end())
    return reject(std::make_shared<tcp::socket>(std::move(s)), peer, errc::bad_channel,
                  "no session " + nego.session.short_hex() + " to join");
  if (!nego.join && it != sessions.end())
    return reject(std::make_shared<tcp::socket>(std::move(s)), peer, errc::bad_channel,
                  "session " + nego.session.short_hex() + " already exists");
  if (it == sessions.end()) {
    if (stopping) return reject(std::make_shared<tcp::socket>(std::move(s)), peer, errc::shutting_down, "server is stopping");
    if (sessions.size() >= config.max_sessions)
      return reject(std::make_shared<tcp::socket>(std::move(s)), peer, errc::limit_exceeded,
                    fmt::format("{} sessions are running, the limit", config.max_sessions));
    auto session = std::make_unique<Session>();
    Session* sp = session.get();
    sp->guard.emplace(sp->io.get_executor());
    const SessionId id = nego.session;
    sp->env = std::unique_ptr<runtime::SessionEnv>(new runtime::SessionEnv{
        sp->io, config, root.get(), key, id, peer, nego,
        [this, sp](SessionReport r) {
          // Session thread: log the end line and let the loop run dry (lingering closes last).
          log(format_report(r));
          sp->guard.reset();
        },
        [this](const std::string& line) { log(line); }});
    sp->handler = factory(*sp->env);
    // Only once the loop has run dry does the listener reap, so its join never blocks accepting.
    sp->thread = std::thread([this, sp, id] {
      sp->io.run();
      asio::post(io, [this, id] { reap(id); });
    });
    it = sessions.emplace(id, std::move(session)).first;
    ++active;
  }
  // The socket moves to the session's own io_context: its network thread owns it from now on.
  Session* sp = it->second.get();
  ErrorCode ec;
  auto protocol = s.local_endpoint(ec).protocol();
  if (ec) return;  // the peer is already gone
  // Owned until the session thread adopts it: closed if that thread has already ended.
  auto fd = std::make_shared<files::Fd>(s.release());
  asio::post(sp->io, [sp, fd, protocol, nego = std::move(nego), opening = std::move(opening), peer]() mutable {
    tcp::socket moved(sp->io, protocol, fd->release());
    sp->handler->add_channel(std::move(moved), std::move(nego), std::move(opening), peer);
  });
}

void Server::Impl::reap(const SessionId& id) {
  auto it = sessions.find(id);
  if (it == sessions.end()) return;
  if (it->second->thread.joinable()) it->second->thread.join();
  sessions.erase(it);
  --active;
  if (stopping && sessions.empty()) io.stop();
}

void Server::Impl::begin_stop() {
  if (stopping) return;
  stopping = true;
  ErrorCode ignored;
  acceptor.close(ignored);
  signals.cancel(ignored);
  if (sessions.empty()) {
    io.stop();
    return;
  }
  for (auto& [id, s] : sessions) {
    Session* sp = s.get();
    asio::post(sp->io, [sp] { sp->handler->shutdown(); });
  }
}

}  // namespace xdfs
