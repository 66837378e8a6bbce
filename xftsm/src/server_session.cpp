#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cerrno>

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

// How long a session waits for memory for its ring before it gives up (a client waits 15 s for
// the server's answer by default).
constexpr std::chrono::milliseconds memory_wait{10000};

class ServerSession final : public runtime::SessionHandler, public TransferHost {
public:
  explicit ServerSession(runtime::SessionEnv& env)
      : env_(env),
        nego_(env.nego),
        machine_(env.nego.mode == Mode::upload ? Role::server_upload
                 : env.nego.mode == Mode::path ? Role::server_path
                                               : Role::server_download),
        join_timer_(env.io),
        linger_(env.io),
        ring_wait_(env.io),
        start_(Clock::now()) {}

  void add_channel(std::unique_ptr<xdsi::Channel> ch) override {
    const auto idx = ch->index();
    if (machine_.state() != State::idle && machine_.state() != State::joining)
      return refuse_channel(std::move(ch), errc::bad_channel,
                            fmt::format("session {} already has its {} channels", env_.id.short_hex(),
                                        nego_.channel_count));
    if (idx >= nego_.channel_count || (idx < channels_.size() && channels_[idx]))
      return refuse_channel(std::move(ch), errc::bad_channel,
                            fmt::format("duplicate channel index {} in session {}", idx, env_.id.short_hex()));
    xdsi::SocketOptions opts;
    opts.tcp_window = std::min(nego_.tcp_window, env_.config.max_tcp_window);
    xdsi::apply(ch->socket(), opts);
    if (machine_.state() == State::idle) {
      // Channel 0 (Noise XX) registers the session; the others have until the join timeout.
      if (machine_.fire(Event::channel_joined) != Action::register_session)
        return fail_early(errc::state_violation, machine_.why(), Event::local_error);
      channels_.resize(nego_.channel_count);
      join_timer_.expires_after(env_.config.join_timeout);
      join_timer_.async_wait([this](const xdsi::ErrorCode& ec) {
        if (ec || machine_.state() != State::joining) return;
        fail_early(errc::timeout, fmt::format("only {} of {} channels arrived within {} ms", joined_,
                                              nego_.channel_count, env_.config.join_timeout.count()),
                   Event::timeout);
      });
    } else if (machine_.fire(Event::channel_joined) != Action::add_channel) {
      return fail_early(errc::state_violation, machine_.why(), Event::local_error);
    }
    channels_[idx] = std::move(ch);
    if (++joined_ < nego_.channel_count) return watch(*channels_[idx]);
    join_timer_.cancel();
    if (machine_.fire(Event::all_joined) == Action::open_and_reply) open_and_reply();
  }

  void shutdown() override {
    if (path_) return path_->abort(errc::shutting_down, "server is stopping");
    if (sender_) return sender_->abort(errc::shutting_down, "server is stopping");
    if (receiver_) return receiver_->abort(errc::shutting_down, "server is stopping");
    fail_early(errc::shutting_down, "server is stopping", Event::local_error);
  }

  void crash(const std::string& what) override {
    if (path_) return path_->abort(errc::internal, what);
    if (sender_) return sender_->abort(errc::internal, what);
    if (receiver_) return receiver_->abort(errc::internal, what);
    fail_early(errc::internal, what, Event::local_error);
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
  int root_fd() const noexcept { return env_.root_fd; }

  // The block protection of this session's data direction (none in clear mode).
  xsec::BlockCrypto* crypto() {
    const auto mode = static_cast<xsec::Protect>(env_.opening.protect);
    if (mode == xsec::Protect::clear) return nullptr;
    if (!block_crypto_)
      block_crypto_ = std::make_unique<xsec::BlockCrypto>(mode, static_cast<xsec::Cipher>(env_.opening.cipher),
                                                          xsec::data_key(env_.session_secret, nego_.mode == Mode::upload));
    return block_crypto_.get();
  }

  // While the session waits for its other channels, the client sends nothing on those it has:
  // a channel that closes (or talks) then ends the session at once instead of at the join timeout.
  void watch(xdsi::Channel& ch) {
    ch.socket().async_wait(xdsi::tcp::socket::wait_read, [this, &ch](const xdsi::ErrorCode& ec) {
      if (ec || machine_.state() != State::joining) return;
      char b;
      const auto n = ::recv(ch.socket().native_handle(), &b, 1, MSG_PEEK | MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return watch(ch);
      if (n > 0)
        return fail_early(errc::protocol_error,
                          fmt::format("channel {} sent a frame before the session started", ch.index()),
                          Event::local_error);
      fail_early(errc::peer_aborted,
                 fmt::format("channel {} closed while the session waited for its other channels", ch.index()),
                 Event::channel_lost);
    });
  }

  // A channel this session does not take: it hears why (it is authenticated), then goes.
  void refuse_channel(std::unique_ptr<xdsi::Channel> ch, errc code, const std::string& message) {
    env_.log(fmt::format("session {} refused channel {} from {}: {}: {}", env_.id.short_hex(), ch->index(),
                         xdsi::peer_name(ch->socket()), to_string(code), message));
    auto* c = ch.get();
    leaving_.push_back(std::move(ch));
    // A second to read it and close, then it goes whatever the peer does.
    auto timer = std::make_shared<boost::asio::steady_timer>(env_.io, std::chrono::seconds(1));
    timer->async_wait([c](const xdsi::ErrorCode& ec) {
      if (!ec) c->close();
    });
    c->send_control(wire::Event::exception, wire::encode(wire::ExceptionHeader{code, message, c->index(), 0}),
                    [c, timer](const xdsi::ErrorCode&) { c->linger_close([timer] { timer->cancel(); }); });
  }

  // The ring this session gets: what it asks for while memory is plentiful; when it is getting
  // short, a quarter of what is left (the sessions that come next get some too), never below two
  // slots, which still overlap disk and network. False when not even that fits.
  bool reserve_ring(TransferParams& p) {
    const std::size_t per_slot = std::size_t(p.block_size) + piod::slot_tag_room;
    const std::size_t used = env_.budget.used(), limit = env_.budget.limit();
    const std::size_t free = used < limit ? limit - used : 0;
    std::uint32_t want = pool_slots(p);
    if (std::size_t(want) * per_slot * 4 > free)
      want = static_cast<std::uint32_t>(std::max<std::size_t>(2, std::min<std::size_t>(want, free / 4 / per_slot)));
    for (std::uint32_t slots = want;; slots = std::max<std::uint32_t>(2, slots / 2)) {
      if (auto r = Reservation::take(&env_.budget, slots * per_slot)) {
        ring_ = std::move(*r);
        p.slots = slots;
        return true;
      }
      if (slots <= 2) return false;
    }
  }

  // Starts the engine once its ring is reserved: a receiver into sink, or a sender from source.
  // When memory for even the smallest ring is taken, the session waits for other sessions to
  // give some back (they end every second or so under load), then gives up with a clear error.
  void start_engine(TransferParams p, std::optional<piod::Sink> sink, std::optional<piod::Source> source) {
    if (machine_.finished()) return;
    if (!reserve_ring(p)) {
      const auto now = Clock::now();
      if (waiting_since_ == Clock::time_point{}) waiting_since_ = now;
      if (now - waiting_since_ > memory_wait)
        return fail_early(errc::limit_exceeded,
                          fmt::format("the server's memory for transfers ({} MiB) stayed in use by other sessions "
                                      "for {} s; try again later",
                                      env_.budget.limit() >> 20, memory_wait.count() / 1000),
                          Event::local_error);
      ring_wait_.expires_after(std::chrono::milliseconds(50));
      ring_wait_.async_wait([this, p, sink, source](const xdsi::ErrorCode& ec) {
        if (!ec) start_engine(p, sink, source);
      });
      return;
    }
    wire::NegotiationReply reply;
    reply.block_size = nego_.block_size;
    if (sink) {
      receiver_ = std::make_unique<Receiver>(env_.io, machine_, channels_, *this, p, *sink);
      reply.window = receiver_->window();
      send_reply(reply);
      receiver_->start();
    } else {
      reply.file_size = p.file_size;
      sender_ = std::make_unique<Sender>(env_.io, machine_, channels_, *this, p, *source);
      send_reply(reply);
      sender_->start();
    }
  }

  void open_and_reply() {
    env_.log(fmt::format("session {} start peer={} mode={} path={} channels={} block={} protect={} client={}",
                         env_.id.short_hex(), env_.peer, to_string(nego_.mode), nego_.remote_path, nego_.channel_count,
                         nego_.block_size, xsec::to_string(static_cast<xsec::Protect>(env_.opening.protect)),
                         env_.client.fingerprint));
    TransferParams p;
    p.block_size = nego_.block_size;
    p.slots = static_cast<std::uint32_t>(std::max<std::size_t>(env_.config.ring_bytes / nego_.block_size, 4));
    p.idle_timeout = env_.config.idle_timeout;
    wire::NegotiationReply reply;
    reply.block_size = nego_.block_size;
    const bool memory = (nego_.extended_flags & wire::flag_memory) != 0;
    if (nego_.mode == Mode::path) {
      pathm::ServerParams pp;
      pp.block_size = nego_.block_size;
      pp.workers = env_.config.path_workers;
      pp.read_only = !env_.client.write;
      pp.fsync = env_.config.fsync;
      pp.tag = env_.tag;
      pp.idle_timeout = env_.config.idle_timeout;
      pp.budget = &env_.budget;
      pp.max_file_size = env_.config.max_file_size;
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
      start_engine(p, piod::Sink{-1, true, true, crypto()}, std::nullopt);
    } else if (nego_.mode == Mode::download && memory) {
      if (nego_.window < nego_.block_size)
        return fail_early(errc::bad_argument, fmt::format("window of {} bytes is smaller than one block", nego_.window),
                          Event::local_error);
      p.file_size = nego_.file_size;
      p.window = nego_.window;
      p.data_event = wire::Event::xftsmd;
      start_engine(p, std::nullopt, piod::Source{-1, p.file_size, true, crypto()});
    } else if (nego_.mode == Mode::upload) {
      auto [dir, name] = files::split_parent(nego_.remote_path);
      files::Fd dirfd;
      if (auto st = files::open_beneath(root_fd(), dir, O_PATH | O_DIRECTORY, 0, dirfd); !st)
        return fail_early(st.code, st.message, Event::local_error);
      if (auto st = files::PendingFile::create(std::move(dirfd), name, env_.tag, pending_); !st)
        return fail_early(st.code, st.message, Event::local_error);
      // Without a size limit of its own the server takes what the file system can hold: an
      // upload that cannot fit is refused now, not when the disk is full.
      if (env_.config.max_file_size == 0)
        if (auto st = files::check_room(pending_.dir(), nego_.file_size, "'" + nego_.remote_path + "'"); !st)
          return fail_early(st.code, st.message, Event::local_error);
      p.file_size = nego_.file_size;
      p.data_event = wire::Event::xftsmu;
      start_engine(p, piod::Sink{pending_.fd(), true, false, crypto()}, std::nullopt);
    } else {
      if (auto st = files::open_beneath(root_fd(), nego_.remote_path, O_RDONLY | O_NONBLOCK | O_NOCTTY, 0, source_); !st)
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
      start_engine(p, std::nullopt, piod::Source{source_.get(), p.file_size, false, crypto()});
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
    ring_wait_.cancel();
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
  ChannelList channels_;                           // authenticated channels by index
  std::vector<std::unique_ptr<xdsi::Channel>> leaving_;  // refused channels saying goodbye
  unsigned joined_ = 0;
  boost::asio::steady_timer join_timer_;
  boost::asio::steady_timer linger_;
  boost::asio::steady_timer ring_wait_;   // memory for the ring was short: look again
  Clock::time_point waiting_since_{};
  Clock::time_point start_;
  files::PendingFile pending_;
  files::Fd source_;
  std::unique_ptr<xsec::BlockCrypto> block_crypto_;  // used by the disk thread: outlives the engines
  Reservation ring_;                                 // the engine's pool, in the server's memory budget
  std::unique_ptr<Sender> sender_;
  std::unique_ptr<Receiver> receiver_;
  std::unique_ptr<pathm::Server> path_;
  bool reported_ = false;
};

}  // namespace

runtime::HandlerFactory server_factory() {
  return [](runtime::SessionEnv& env) -> std::unique_ptr<runtime::SessionHandler> {
    return std::make_unique<ServerSession>(env);
  };
}

}  // namespace xdfs::xftsm
