#include <fcntl.h>
#include <sys/stat.h>

#include <boost/asio/steady_timer.hpp>
#include <fmt/core.h>

#include <chrono>
#include <map>

#include "xdfs/files.hpp"
#include "xdfs/pathm/engine.hpp"
#include "xdfs/xsec.hpp"
#include "xdfs/xftsm/cfsm.hpp"
#include "xdfs/xftsm/server_mode.hpp"
#include "xdfs/xftsm/transfer.hpp"

namespace xdfs::xftsm {
namespace {

using Clock = std::chrono::steady_clock;

// Sends one exception header on a channel that will not join, then closes it.
void refuse_channel(xdsi::tcp::socket sock, errc code, const std::string& message) {
  auto ch = std::make_shared<xdsi::Channel>(std::move(sock), 0);
  ch->send_control(wire::Event::exception, wire::encode(wire::ExceptionHeader{code, message, 0, 0}),
                   [ch](const xdsi::ErrorCode&) { ch->shutdown_send(); });
}

bool same_session(const wire::Negotiation& a, const wire::Negotiation& b) {
  return a.version == b.version && a.channel_count == b.channel_count && a.mode == b.mode &&
         a.remote_path == b.remote_path && a.block_size == b.block_size && a.tcp_window == b.tcp_window &&
         a.extended_flags == b.extended_flags && a.file_size == b.file_size && a.window == b.window &&
         a.protect == b.protect && a.cipher == b.cipher;
}

class ServerSession final : public runtime::SessionHandler, public TransferHost {
public:
  explicit ServerSession(runtime::SessionEnv& env)
      : env_(env),
        nego_(env.first),
        machine_(env.first.mode == Mode::upload     ? Role::server_upload
                 : env.first.mode == Mode::path ? Role::server_path
                                                : Role::server_download),
        join_timer_(env.io),
        linger_(env.io),
        start_(Clock::now()) {}

  void add_channel(xdsi::tcp::socket sock, wire::Negotiation n, std::vector<std::uint8_t> opening,
                   std::string peer) override {
    if (machine_.state() != State::idle && machine_.state() != State::joining)
      return refuse_channel(std::move(sock), errc::bad_channel,
                            fmt::format("session {} already has its {} channels", env_.id.short_hex(),
                                        nego_.channel_count));
    const auto idx = n.channel_index;
    if (machine_.state() == State::joining) {
      if (!same_session(n, nego_))
        return refuse_channel(std::move(sock), errc::bad_channel,
                              fmt::format("channel {} does not match the negotiation of session {}", idx,
                                          env_.id.short_hex()));
      if (channels_[idx] || handshaking_.count(idx))
        return refuse_channel(std::move(sock), errc::bad_channel,
                              fmt::format("duplicate channel index {} in session {}", idx, env_.id.short_hex()));
    }
    xdsi::SocketOptions opts;
    opts.tcp_window = std::min(n.tcp_window, env_.config.max_tcp_window);
    xdsi::apply(sock, opts);
    auto ch = std::make_unique<xdsi::Channel>(std::move(sock), idx);
    auto& chr = *ch;
    handshaking_[idx] = std::move(ch);
    const auto mode = static_cast<xsec::Protect>(nego_.protect);
    const auto cipher = static_cast<xsec::Cipher>(nego_.cipher);
    if (machine_.state() == State::idle) {
      // The first channel registers the session and runs the full (Noise XX) handshake.
      if (machine_.fire(Event::channel_joined) != Action::register_session) return;
      channels_.resize(nego_.channel_count);
      join_timer_.expires_after(env_.config.join_timeout);
      join_timer_.async_wait([this](const xdsi::ErrorCode& ec) {
        if (ec || machine_.state() != State::joining) return;
        fail_early(errc::timeout, fmt::format("only {} of {} channels arrived within {} ms", joined_,
                                              nego_.channel_count, env_.config.join_timeout.count()),
                   Event::timeout);
      });
      xsec::server_establish(chr, std::move(opening), env_.key, mode, cipher,
                             [this](const xsec::Key32& k) { return check_client(k); },
                             [this, idx](xsec::HandshakeResult r) { secured(idx, std::move(r), true); });
      return;
    }
    if (!established_) {
      waiting_.push_back({idx, std::move(opening), std::move(n.join_nonce)});
      return;
    }
    start_join(idx, std::move(opening), std::move(n.join_nonce));
  }

  void shutdown() override {
    if (path_) return path_->abort(errc::shutting_down, "server is stopping");
    if (sender_) return sender_->abort(errc::shutting_down, "server is stopping");
    if (receiver_) return receiver_->abort(errc::shutting_down, "server is stopping");
    fail_early(errc::shutting_down, "server is stopping", Event::local_error);
  }

  files::Status commit() override {
    if (!pending_.active()) return files::Status::ok();  // memory mode: nothing to make final
    return pending_.commit(nego_.file_size, env_.config.fsync);
  }

  void finished(errc code, const std::string& message, bool from_peer) override {
    if (code != errc::ok) pending_.discard();
    report(code, message);
  }

private:
  struct Waiting {
    std::uint32_t index;
    std::vector<std::uint8_t> opening;
    std::vector<std::uint8_t> nonce;
  };

  void start_join(std::uint32_t idx, std::vector<std::uint8_t> opening, std::vector<std::uint8_t> nonce) {
    xsec::server_join(*handshaking_[idx], std::move(opening), std::move(nonce), secret_,
                      static_cast<xsec::Protect>(nego_.protect), static_cast<xsec::Cipher>(nego_.cipher),
                      [this, idx](xsec::HandshakeResult r) { secured(idx, std::move(r), false); });
  }

  // Authorization of the first channel's client key: listed, allowed this mode, confined.
  xsec::HandshakeResult check_client(const xsec::Key32& key) {
    xsec::HandshakeResult r;
    const std::string who = "client key " + xsec::fingerprint(key);
    try {
      auto keys = xsec::AuthorizedKeys::load(env_.config.authorized_keys);
      const auto* perm = keys.find(key);
      if (!perm) {
        r.code = errc::auth_failed;
        r.message = who + " is not in the server's authorized keys";
        return r;
      }
      if (!perm->write && nego_.mode == Mode::upload) {
        r.code = errc::permission_denied;
        r.message = who + " may only download (read-only)";
        return r;
      }
      if (!perm->subdir.empty()) {
        if (auto st = files::open_beneath(env_.root_fd, perm->subdir, O_PATH | O_DIRECTORY, 0, confined_root_); !st) {
          r.code = st.code;
          r.message = who + " is confined to " + st.message;
          return r;
        }
      }
      read_only_ = !perm->write;
      client_key_ = key;
    } catch (const Error& e) {
      r.code = errc::auth_failed;
      r.message = std::string("the server cannot check client keys: ") + e.what();
    }
    return r;
  }

  int root_fd() const noexcept { return confined_root_ ? confined_root_.get() : env_.root_fd; }

  // The block protection of this session's data direction (none in clear mode).
  xsec::BlockCrypto* crypto() {
    const auto mode = static_cast<xsec::Protect>(nego_.protect);
    if (mode == xsec::Protect::clear) return nullptr;
    if (!block_crypto_)
      block_crypto_ = std::make_unique<xsec::BlockCrypto>(mode, static_cast<xsec::Cipher>(nego_.cipher),
                                                          xsec::data_key(secret_, nego_.mode == Mode::upload));
    return block_crypto_.get();
  }

  // A channel finished its handshake (or failed it).
  void secured(std::uint32_t idx, xsec::HandshakeResult r, bool first) {
    if (machine_.finished()) return;
    auto it = handshaking_.find(idx);
    if (it == handshaking_.end()) return;
    auto ch = std::move(it->second);
    handshaking_.erase(it);
    if (r.code != errc::ok) {
      if (first) {
        channels_[idx] = std::move(ch);  // so the failure reaches this client
        return fail_early(r.code, r.message, Event::local_error);
      }
      // A channel that cannot prove the session secret does not join; the session goes on
      // waiting for the real one (bounded by the join timeout).
      env_.log(fmt::format("session {} refused channel {}: {}: {}", env_.id.short_hex(), idx, to_string(r.code),
                           r.message));
      ch->close();
      return;
    }
    channels_[idx] = std::move(ch);
    if (first) {
      established_ = true;
      secret_ = r.session_secret;
      for (auto& w : waiting_) start_join(w.index, std::move(w.opening), std::move(w.nonce));
      waiting_.clear();
    } else if (!machine_.fire(Event::channel_joined)) {
      return fail_early(errc::state_violation, machine_.why(), Event::local_error);
    }
    if (++joined_ < nego_.channel_count) return;
    join_timer_.cancel();
    if (machine_.fire(Event::all_joined) == Action::open_and_reply) open_and_reply();
  }

  void open_and_reply() {
    env_.log(fmt::format("session {} start peer={} mode={} path={} channels={} block={} protect={} client={}",
                         env_.id.short_hex(), env_.peer, to_string(nego_.mode), nego_.remote_path, nego_.channel_count,
                         nego_.block_size, xsec::to_string(static_cast<xsec::Protect>(nego_.protect)),
                         xsec::fingerprint(client_key_)));
    TransferParams p;
    p.block_size = nego_.block_size;
    p.slots = static_cast<std::uint32_t>(std::max<std::size_t>(env_.config.ring_bytes / nego_.block_size, 4));
    p.idle_timeout = env_.config.idle_timeout;
    wire::NegotiationReply reply;
    reply.block_size = nego_.block_size;
    const bool memory = (nego_.extended_flags & wire::flag_memory) != 0;
    if (nego_.mode == Mode::path) {
      if (memory) return fail_early(errc::bad_argument, "memory mode does not apply to path sessions", Event::local_error);
      pathm::ServerParams pp;
      pp.block_size = nego_.block_size;
      pp.workers = env_.config.path_workers;
      pp.read_only = read_only_;
      pp.fsync = env_.config.fsync;
      pp.tag = env_.id.short_hex();
      pp.idle_timeout = env_.config.idle_timeout;
      path_ = std::make_unique<pathm::Server>(env_.io, channels_, root_fd(), pp,
                                              [this](errc code, const std::string& message, bool from_peer) {
                                                (void)machine_.fire(code == errc::ok ? Event::committed
                                                                    : from_peer     ? Event::peer_exception
                                                                                    : Event::local_error);
                                                report(code, message);
                                              });
      send_reply(reply);
      path_->start();
    } else if (nego_.mode == Mode::upload && memory) {
      p.file_size = nego_.file_size;
      p.data_event = wire::Event::xftsmu;
      receiver_ = std::make_unique<Receiver>(env_.io, machine_, channels_, *this, p, piod::Sink{-1, true, true, crypto()});
      reply.window = receiver_->window();
      send_reply(reply);
      receiver_->start();
    } else if (nego_.mode == Mode::download && memory) {
      if (nego_.window < nego_.block_size)
        return fail_early(errc::bad_argument, fmt::format("window of {} bytes is smaller than one block", nego_.window),
                          Event::local_error);
      p.file_size = nego_.file_size;
      p.window = nego_.window;
      p.data_event = wire::Event::xftsmd;
      reply.file_size = p.file_size;
      sender_ = std::make_unique<Sender>(env_.io, machine_, channels_, *this, p, piod::Source{-1, p.file_size, true, crypto()});
      send_reply(reply);
      sender_->start();
    } else if (nego_.mode == Mode::upload) {
      auto [dir, name] = files::split_parent(nego_.remote_path);
      files::Fd dirfd;
      if (auto st = files::open_beneath(root_fd(), dir, O_PATH | O_DIRECTORY, 0, dirfd); !st)
        return fail_early(st.code, st.message, Event::local_error);
      if (auto st = files::PendingFile::create(std::move(dirfd), name, env_.id.short_hex(), pending_); !st)
        return fail_early(st.code, st.message, Event::local_error);
      p.file_size = nego_.file_size;
      p.data_event = wire::Event::xftsmu;
      receiver_ = std::make_unique<Receiver>(env_.io, machine_, channels_, *this, p, piod::Sink{pending_.fd(), true, false, crypto()});
      reply.window = receiver_->window();
      send_reply(reply);
      receiver_->start();
    } else {
      if (auto st = files::open_beneath(root_fd(), nego_.remote_path, O_RDONLY | O_NONBLOCK, 0, source_); !st)
        return fail_early(st.code, st.message, Event::local_error);
      struct stat sb {};
      if (::fstat(source_.get(), &sb) != 0)
        return fail_early(errc_from_errno(errno), "stat '" + nego_.remote_path + "'", Event::local_error);
      if (S_ISDIR(sb.st_mode)) return fail_early(errc::is_directory, "'" + nego_.remote_path + "' is a directory", Event::local_error);
      if (!S_ISREG(sb.st_mode))
        return fail_early(errc::not_regular_file, "'" + nego_.remote_path + "' is not a regular file", Event::local_error);
      if (nego_.window < nego_.block_size)
        return fail_early(errc::bad_argument, fmt::format("window of {} bytes is smaller than one block", nego_.window),
                          Event::local_error);
      p.file_size = static_cast<std::uint64_t>(sb.st_size);
      p.window = nego_.window;
      p.data_event = wire::Event::xftsmd;
      reply.file_size = p.file_size;
      sender_ = std::make_unique<Sender>(env_.io, machine_, channels_, *this, p,
                                         piod::Source{source_.get(), p.file_size, false, crypto()});
      send_reply(reply);
      sender_->start();
    }
  }

  void send_reply(const wire::NegotiationReply& reply) {
    auto payload = wire::encode(reply);
    for (auto& ch : channels_) ch->send_control(wire::Event::nego_reply, payload);
  }

  // Failure before an engine runs: tell every joined channel, then report.
  void fail_early(errc code, const std::string& message, Event ev) {
    if (machine_.finished()) return;
    if (!machine_.fire(ev)) (void)machine_.fire(Event::local_error);
    join_timer_.cancel();
    // Channels still in their handshake hear the reason too (in clear: they have no keys yet).
    for (auto& [i, ch] : handshaking_)
      if (!channels_[i]) channels_[i] = std::move(ch);
    handshaking_.clear();
    pending_.discard();
    tell_and_close(channels_, wire::ExceptionHeader{code, message, 0, 0}, linger_, std::chrono::milliseconds(2000));
    report(code, message);
  }

  void report(errc code, const std::string& message) {
    if (reported_) return;
    reported_ = true;
    SessionReport r;
    r.id = env_.id;
    r.peer = env_.peer;
    r.mode = nego_.mode;
    r.path = nego_.remote_path;
    r.channels = nego_.channel_count;
    r.bytes = sender_ ? sender_->bytes_done() : receiver_ ? receiver_->bytes_done() : path_ ? path_->bytes() : 0;
    r.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    r.code = code;
    r.message = message;
    env_.done(std::move(r));
  }

  runtime::SessionEnv& env_;
  wire::Negotiation nego_;
  Machine machine_;
  ChannelList channels_;                                         // secured channels by index
  std::map<std::uint32_t, std::unique_ptr<xdsi::Channel>> handshaking_;  // still proving themselves
  std::vector<Waiting> waiting_;                                 // joins that came before the first handshake ended
  bool established_ = false;
  xsec::Key32 secret_{};
  xsec::Key32 client_key_{};
  files::Fd confined_root_;
  unsigned joined_ = 0;
  boost::asio::steady_timer join_timer_;
  boost::asio::steady_timer linger_;
  Clock::time_point start_;
  files::PendingFile pending_;
  files::Fd source_;
  std::unique_ptr<xsec::BlockCrypto> block_crypto_;  // used by the disk thread: outlives the engines
  std::unique_ptr<Sender> sender_;
  std::unique_ptr<Receiver> receiver_;
  std::unique_ptr<pathm::Server> path_;
  bool read_only_ = false;
  bool reported_ = false;
};

}  // namespace

runtime::HandlerFactory server_factory() {
  return [](runtime::SessionEnv& env) -> std::unique_ptr<runtime::SessionHandler> {
    return std::make_unique<ServerSession>(env);
  };
}

}  // namespace xdfs::xftsm
