// The server's side of a session, over whatever modes the server offers: it takes the session's
// n authenticated channels as they join, then runs operations on them one after another. Each
// operation is negotiated on every channel (the first inside the handshake), run by its mode,
// and ended on every channel; in between, the session reads one frame from each channel: the
// next operation's negotiation on all n, or EOFT on all n (the client ends the session).
#include <sys/socket.h>

#include <cerrno>

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <fmt/core.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <utility>

#include "xdfs/detail/session_fsm.hpp"
#include "xdfs/files.hpp"
#include "xdfs/server.hpp"

namespace xdfs {

std::string format_report(const SessionReport& r) {
  const double rate = r.seconds > 0 ? static_cast<double>(r.bytes) / r.seconds : 0.0;
  const std::string what = r.operation ? fmt::format("session {} op {}", r.id.short_hex(), *r.operation)
                                       : fmt::format("session {}", r.id.short_hex());
  std::string line = fmt::format("{} end peer={} mode={} path={} channels={} bytes={} seconds={:.3f} rate={:.1f}MB/s", what,
                                 r.peer, to_string(r.mode), r.path, r.channels, r.bytes, r.seconds, rate / 1e6);
  if (!r.operation && r.operations > 1) line += fmt::format(" ops={}", r.operations);
  if (r.code == errc::ok) return line + " status=ok";
  return line + " status=error: " + to_string(r.code) + (r.message.empty() ? "" : ": " + r.message);
}

namespace runtime {
namespace {

using Clock = std::chrono::steady_clock;
using xdsi::ErrorCode;

using session_fsm::SessionAction;
using session_fsm::SessionEvent;
using session_fsm::State;

class Session final : public SessionHandler {
public:
  Session(SessionEnv& env, std::shared_ptr<const Modes> modes)
      : env_(env), modes_(std::move(modes)), join_timer_(env.io), idle_(env.io), linger_(env.io), start_(Clock::now()) {}

  void add_channel(std::unique_ptr<xdsi::Channel> ch) override {
    const auto idx = ch->index();
    const auto n = env_.nego.channel_count;
    if (!machine_.find(SessionEvent::channel_joined))
      return refuse_channel(std::move(ch), errc::bad_channel,
                            fmt::format("session {} already has its {} channels", env_.id.short_hex(), n));
    if (idx >= n || (idx < channels_.size() && channels_[idx]))
      return refuse_channel(std::move(ch), errc::bad_channel,
                            fmt::format("duplicate channel index {} in session {}", idx, env_.id.short_hex()));
    xdsi::SocketOptions opts;
    opts.tcp_window = std::min(env_.nego.tcp_window, env_.config.max_tcp_window);
    xdsi::apply(*ch, opts);
    if (machine_.fire(SessionEvent::channel_joined) == SessionAction::register_session) {
      // Channel 0 (Noise XX) registers the session; the others have until the join timeout.
      channels_.resize(n);
      join_timer_.expires_after(env_.config.join_timeout);
      join_timer_.async_wait([this](const ErrorCode& ec) {
        if (ec || machine_.state() != State::joining) return;
        fail(SessionEvent::timeout, errc::timeout,
             fmt::format("only {} of {} channels arrived within {} ms", joined_, env_.nego.channel_count,
                         env_.config.join_timeout.count()));
      });
    }
    channels_[idx] = std::move(ch);
    if (++joined_ < n) return watch(*channels_[idx]);
    join_timer_.cancel();
    if (machine_.fire(SessionEvent::all_joined) == SessionAction::start_operation) start_operation(env_.nego);
  }

  void shutdown() override { stop(errc::shutting_down, "server is stopping"); }
  void crash(const std::string& what) override { stop(errc::internal, what); }

private:
  void stop(errc code, const std::string& message) {
    if (machine_.state() == State::operating && op_) return op_->abort(code, message);
    fail(SessionEvent::local_error, code, message);
  }

  // While the session waits for its other channels, the client sends nothing on those it has:
  // a channel that closes (or talks) then ends the session at once instead of at the join timeout.
  void watch(xdsi::Channel& ch) {
    ch.socket().async_wait(xdsi::tcp::socket::wait_read, [this, &ch](const ErrorCode& ec) {
      if (ec || machine_.state() != State::joining) return;
      char b;
      const auto got = ::recv(ch.socket().native_handle(), &b, 1, MSG_PEEK | MSG_DONTWAIT);
      if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return watch(ch);
      if (got > 0)
        return fail(SessionEvent::local_error, errc::protocol_error,
                    fmt::format("channel {} sent a frame before the session started", ch.index()));
      fail(SessionEvent::peer_left, errc::peer_aborted,
           fmt::format("channel {} closed while the session waited for its other channels", ch.index()));
    });
  }

  // A channel this session does not take: it hears why (it is authenticated), then goes.
  void refuse_channel(std::unique_ptr<xdsi::Channel> ch, errc code, const std::string& message) {
    env_.log(fmt::format("session {} refused channel {} from {}: {}: {}", env_.id.short_hex(), ch->index(),
                         xdsi::peer_name(ch->socket()), xdfs::to_string(code), message));
    auto* c = ch.get();
    leaving_.push_back(std::move(ch));
    // A second to read it and close, then it goes whatever the peer does.
    auto timer = std::make_shared<boost::asio::steady_timer>(env_.io, std::chrono::seconds(1));
    timer->async_wait([c](const ErrorCode& ec) {
      if (!ec) c->close();
    });
    c->send_control(wire::ChannelEvent::exception, wire::encode(wire::ExceptionHeader{code, message, c->index(), 0}),
                    [c, timer](const ErrorCode&) { c->linger_close([timer] { timer->cancel(); }); });
  }

  // What makes an operation unacceptable here, whatever its mode does with it: the reason, or "".
  // Every operation, refused ones too, takes its transfer number: a later one must be above it.
  std::string check(const wire::Negotiation& n, errc& code) {
    code = errc::bad_argument;
    const bool later = numbered_;  // not the session's first operation (which came in its handshake)
    // The session's own parameters were checked against the server's limits when the session
    // was admitted (the first negotiation, env_.nego); no operation may change them.
    if (numbered_ && n.transfer <= last_transfer_)
      return fmt::format("transfer number {} is not above the last one ({}): each operation has its own", n.transfer,
                         last_transfer_);
    numbered_ = true;
    last_transfer_ = n.transfer;
    const auto& first = env_.nego;
    if (n.channel_count != first.channel_count || n.block_size != first.block_size ||
        n.tcp_window != first.tcp_window || n.extended_flags != first.extended_flags)
      return "channel count, block size, TCP window and flags are the session's and cannot change";
    if (auto why = check_operation(env_.config, n, env_.client.write, code); !why.empty()) return why;
    // A ticket is checked when a session is admitted, with its first operation: a later one
    // cannot bring one, and a session admitted by one carries that upload and nothing else (it
    // holds the relay's master's rights only for the place's file).
    if (later && !n.relay_ticket.empty()) return "a relayed upload opens a session of its own";
    if (later && !env_.nego.relay_ticket.empty()) {
      code = errc::permission_denied;
      return "a session that feeds a relay carries that upload and nothing else";
    }
    code = errc::not_supported;
    for (const auto& m : *modes_)
      if (m.mode == n.mode) return {};
    return fmt::format("mode {} is disabled on this server", xdfs::to_string(n.mode));
  }

  void start_operation(wire::Negotiation n) {
    previous_.reset();
    idle_.cancel();
    errc code = errc::ok;
    if (auto why = check(n, code); !why.empty())
      return refuse_operation(n, code, fmt::format("NEGO of operation {} refused in state {}: {}", n.transfer,
                                                   session_fsm::to_string(asked_in_), why));
    ++ops_;
    if (ops_ == 1) {
      first_mode_ = n.mode;
      first_path_ = n.remote_path;
    }
    op_nego_ = n;
    op_start_ = Clock::now();
    op_env_.emplace(OperationEnv{env_.io, env_.config, env_.root_fd, env_.id, env_.peer, env_.tag, env_.opening, n,
                                 env_.client, env_.session_secret, env_.budget, channels_, env_.log,
                                 made_, &session_rate_, &env_.total_rate, env_.relays, env_.metrics});
    const ModeEntry* mode = nullptr;
    for (const auto& m : *modes_)
      if (m.mode == n.mode) mode = &m;
    try {
      op_ = mode->make(*op_env_, [this](OperationResult r) { on_operation_done(std::move(r)); });
    } catch (const std::exception& e) {
      return on_operation_done(OperationResult{errc::internal, e.what(), false, true, false});
    }
    try {
      op_->start();
    } catch (const std::exception& e) {
      // Nothing of it may be running: the session ends, telling the client why. The operation
      // stays until the session goes (its handlers may still be queued).
      previous_ = std::move(op_);
      (void)machine_.fire(SessionEvent::operation_failed);
      last_code_ = errc::internal;
      last_message_ = std::string("starting the operation: ") + e.what();
      xdfs::xdsi::tell_and_close(channels_, wire::ExceptionHeader{errc::internal, last_message_, 0, 0}, linger_,
                                 std::chrono::milliseconds(2000));
      report();
    }
  }

  void on_operation_done(OperationResult r) {
    if (machine_.state() != State::operating) return;
    const std::uint64_t bytes = op_ ? op_->bytes() : 0;
    total_bytes_ += bytes;
    // The operation may still be on the stack: one that ended cleanly goes once the loop is
    // back here. One that failed may still be telling the peer (its timers and channels'
    // goodbyes refer to it): it stays until the session goes.
    if (op_) {
      previous_ = std::move(op_);
      if (r.reusable || r.refused) boost::asio::post(env_.io, [this] { previous_.reset(); });
    }
    if (r.code != errc::ok) {
      last_code_ = r.code;
      last_message_ = r.message;
    }
    if (r.refused) {
      --ops_;  // it did not run (its number stays used)
      return refuse_operation(op_nego_, r.code, r.message);
    }
    // With more than one operation, each gets its own end line (the first once the second ended).
    const auto line = report_of(op_nego_, bytes, r.code, r.message);
    count(line);
    if (ops_ == 1)
      first_report_ = line;
    else {
      if (first_report_) env_.log(format_report(*std::exchange(first_report_, std::nullopt)));
      env_.log(format_report(line));
    }
    if (r.code != errc::ok || !r.reusable) {
      // The mode told the peer (or, ending well, closes the channels): the session is over.
      (void)machine_.fire(SessionEvent::operation_failed);
      if (r.code == errc::ok)
        for (auto& ch : channels_)
          if (ch) ch->close();
      return report();
    }
    if (machine_.fire(SessionEvent::operation_ended) == SessionAction::await_next) await_next();
  }

  // A refused operation: every channel hears why, and the session waits for the next one.
  void refuse_operation(const wire::Negotiation& n, errc code, const std::string& message) {
    if (machine_.fire(SessionEvent::operation_refused) != SessionAction::refuse_operation)
      return fail(SessionEvent::local_error, errc::state_violation, machine_.why());
    // A client may ask for missing files all day: its refusals are logged up to a point.
    if (refused_ < max_logged_refusals)
      env_.log(fmt::format("session {} refused operation {} mode={} path={}: {}: {}", env_.id.short_hex(), n.transfer,
                           xdfs::to_string(n.mode), n.remote_path, xdfs::to_string(code), message));
    else if (refused_ == max_logged_refusals)
      env_.log(fmt::format("session {}: further refused operations are not logged", env_.id.short_hex()));
    last_code_ = code;
    last_message_ = message;
    ++refused_;
    if (env_.metrics) {
      env_.metrics->add("xdfs_operations_total", {{"mode", xdfs::to_string(n.mode)}, {"outcome", xdfs::to_string(code)}});
      env_.metrics->add("xdfs_errors_total", {{"class", xdfs::to_string(recovery(code))}});
    }
    // The next operation is read only once the refusal has left on every channel: a client that
    // asks again and again without reading holds one refusal per channel, not a queue of them.
    // The idle timer covers one that never reads it.
    arm_idle();
    wire::ExceptionHeader ex{code, message, 0, 0, true};
    auto payload = wire::encode(ex);
    auto left = std::make_shared<std::size_t>(channels_.size());
    for (auto& ch : channels_)
      ch->send_control(wire::ChannelEvent::exception, payload, [this, left](const ErrorCode& ec) {
        if (machine_.state() != State::ready) return;
        if (ec) return lost_on_send(ec);
        if (--*left == 0) await_next();
      });
  }

  void lost_on_send(const ErrorCode& ec) {
    if (ec == boost::asio::error::operation_aborted) return;
    end_session(SessionEvent::peer_left);
  }

  // Between operations: one frame from each channel decides what comes next.
  void await_next() {
    next_.assign(channels_.size(), Next{});
    answered_ = 0;
    arm_idle();
    for (auto& ch : channels_) read_next(*ch);
  }

  struct Next {
    bool got = false;
    bool end = false;  // EOFT
    std::vector<std::uint8_t> nego;
  };

  void arm_idle() {
    idle_.expires_after(env_.config.idle_timeout);
    idle_.async_wait([this](const ErrorCode& ec) {
      if (ec || machine_.state() != State::ready) return;
      fail(SessionEvent::timeout, errc::timeout,
           fmt::format("no next operation and no end of the session for {} s", env_.config.idle_timeout.count() / 1000));
    });
  }

  void read_next(xdsi::Channel& ch) {
    ch.async_read_header([this, &ch](const ErrorCode& ec, const wire::FrameHeader& h) {
      if (machine_.state() != State::ready) return;
      if (ec) return lost(ch, ec);
      auto& slot = next_[ch.index()];
      if (slot.got)
        return fail(SessionEvent::local_error, errc::protocol_error,
                    fmt::format("channel {} sent a second frame in state ready", ch.index()));
      switch (h.event) {
        case wire::ChannelEvent::eoft:
          if (h.length != 0) return fail(SessionEvent::local_error, errc::protocol_error, "EOFT with a payload");
          slot.got = slot.end = true;
          return next_arrived();
        case wire::ChannelEvent::nego: {
          if (h.length > wire::max_negotiation_payload)
            return fail(SessionEvent::local_error, errc::protocol_error,
                        fmt::format("negotiation of {} bytes on channel {} (at most {})", h.length, ch.index(),
                                    wire::max_negotiation_payload));
          slot.nego.resize(h.length);
          return ch.async_read_payload(slot.nego, [this, &ch](const ErrorCode& ec) {
            if (machine_.state() != State::ready) return;
            if (ec) return lost(ch, ec);
            next_[ch.index()].got = true;
            next_arrived();
          });
        }
        case wire::ChannelEvent::exception:
          return read_exception(ch, h.length);
        default:
          return fail(SessionEvent::local_error, errc::protocol_error,
                      fmt::format("unexpected {} on channel {} in state ready: only the next operation's NEGO or EOFT may come",
                                  wire::to_string(h.event), ch.index()));
      }
    });
  }

  void read_exception(xdsi::Channel& ch, std::uint32_t length) {
    if (length > wire::max_control_payload)
      return fail(SessionEvent::local_error, errc::protocol_error, "oversized exception header");
    auto buf = std::make_shared<std::vector<std::uint8_t>>(length);
    ch.async_read_payload(*buf, [this, &ch, buf](const ErrorCode& ec) {
      if (machine_.state() != State::ready) return;
      if (ec) return lost(ch, ec);
      std::string why;
      auto ex = wire::decode_exception(*buf, &why);
      if (!ex) return fail(SessionEvent::local_error, errc::protocol_error, "bad exception header: " + why);
      fail(SessionEvent::peer_exception, ex->code, ex->message);
    });
  }

  // A channel closed between operations: the client left; nothing was running.
  void lost(xdsi::Channel& ch, const ErrorCode& ec) {
    if (ec == boost::asio::error::operation_aborted) return;
    if (auto f = ch.failure(ec, "client"); !f.peer_gone) return fail(SessionEvent::local_error, f.code, f.message);
    end_session(SessionEvent::peer_left);
  }

  void next_arrived() {
    if (++answered_ < next_.size()) return;
    idle_.cancel();
    std::size_t ends = 0;
    for (const auto& s : next_) ends += s.end;
    if (ends == next_.size()) return end_session(SessionEvent::end_asked);
    if (ends != 0)
      return fail(SessionEvent::local_error, errc::protocol_error,
                  fmt::format("{} of {} channels ended the session (EOFT) and the others asked for an operation", ends,
                              next_.size()));
    for (const auto& s : next_)
      if (s.nego != next_.front().nego)
        return fail(SessionEvent::local_error, errc::protocol_error, "the channels disagree on the next operation");
    std::string why;
    auto n = wire::decode_negotiation(next_.front().nego, &why);
    if (!n) return fail(SessionEvent::local_error, errc::protocol_error, "negotiation: " + why);
    asked_in_ = machine_.state();
    if (machine_.fire(SessionEvent::operation_asked) == SessionAction::start_operation) start_operation(std::move(*n));
  }

  // The client ended the session (EOFT on every channel, or it closed them between operations).
  void end_session(SessionEvent why) {
    if (machine_.fire(why) != SessionAction::finish) return;
    idle_.cancel();
    for (auto& ch : channels_)
      if (ch) ch->close();
    report();
  }

  // The session fails outside an operation: the table's abort tells the peer (unless the peer
  // said it first) and closes the channels.
  void fail(SessionEvent ev, errc code, const std::string& message) {
    if (machine_.finished()) return;
    if (!machine_.fire(ev)) (void)machine_.fire(SessionEvent::local_error);
    const bool tell = ev != SessionEvent::peer_exception;
    join_timer_.cancel();
    idle_.cancel();
    last_code_ = code;
    last_message_ = message;
    if (tell)
      xdsi::tell_and_close(channels_, wire::ExceptionHeader{code, message, 0, 0}, linger_, std::chrono::milliseconds(2000));
    else
      for (auto& ch : channels_)
        if (ch) ch->close();
    report();
  }

  SessionReport report_of(const wire::Negotiation& n, std::uint64_t bytes, errc code, const std::string& message) {
    SessionReport r;
    r.id = env_.id;
    r.peer = env_.peer;
    r.mode = n.mode;
    r.path = n.remote_path;
    r.channels = env_.nego.channel_count;
    r.bytes = bytes;
    r.seconds = std::chrono::duration<double>(Clock::now() - op_start_).count();
    r.code = code;
    r.message = message;
    r.operation = n.transfer;
    return r;
  }

  // An operation's counters: its outcome, its bytes by direction, its error's class.
  void count(const SessionReport& op) {
    if (!env_.metrics) return;
    auto& m = *env_.metrics;
    const char* mode = xdfs::to_string(op.mode);
    m.add("xdfs_operations_total", {{"mode", mode}, {"outcome", op.code == errc::ok ? "ok" : xdfs::to_string(op.code)}});
    if (op.code != errc::ok) m.add("xdfs_errors_total", {{"class", xdfs::to_string(recovery(op.code))}});
    // A relay's bytes arrive by the upload session that feeds its place, counted there.
    if (op.bytes && op.mode != Mode::relay) {
      // A path-mode operation moves files both ways.
      const char* dir = op.mode == Mode::path ? "both" : (op.mode == Mode::download || op.mode == Mode::pull) ? "out" : "in";
      m.add("xdfs_transfer_bytes_total", {{"mode", mode}, {"direction", dir}}, op.bytes);
    }
  }

  void report() {
    if (reported_) return;
    reported_ = true;
    // An operation cut short by the session's end has no end line of its own: it counts here.
    if (machine_.state() == State::operating && op_) count(report_of(op_nego_, op_->bytes(), last_code_, last_message_));
    SessionReport r;
    r.id = env_.id;
    r.peer = env_.peer;
    r.mode = ops_ ? first_mode_ : env_.nego.mode;
    r.path = ops_ ? first_path_ : env_.nego.remote_path;
    r.channels = env_.nego.channel_count;
    r.bytes = total_bytes_ + (machine_.state() == State::operating && op_ ? op_->bytes() : 0);
    r.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    r.code = last_code_;
    r.message = last_message_;
    r.operations = ops_ + refused_;
    env_.done(std::move(r));
  }

  SessionEnv& env_;
  std::shared_ptr<const Modes> modes_;
  session_fsm::Machine machine_{session_fsm::Side::server};
  State asked_in_ = State::joining;  // where the operation being started was asked for
  xdsi::ChannelList channels_;                            // authenticated channels by index
  std::vector<std::unique_ptr<xdsi::Channel>> leaving_;   // refused channels saying goodbye
  unsigned joined_ = 0;
  boost::asio::steady_timer join_timer_;
  boost::asio::steady_timer idle_;     // between operations
  boost::asio::steady_timer linger_;
  Clock::time_point start_;
  Clock::time_point op_start_;
  std::optional<OperationEnv> op_env_;
  std::shared_ptr<files::Made> made_ = std::make_shared<files::Made>();  // OperationEnv::made
  RateLimiter session_rate_{env_.config.max_rate};                         // OperationEnv::session_rate
  wire::Negotiation op_nego_;
  std::unique_ptr<Operation> op_;
  std::unique_ptr<Operation> previous_;  // the one that just ended, until the loop is back
  std::vector<Next> next_;
  std::size_t answered_ = 0;
  std::uint64_t ops_ = 0;
  std::uint64_t refused_ = 0;
  std::uint64_t last_transfer_ = 0;
  bool numbered_ = false;  // an operation has taken a transfer number
  static constexpr std::uint64_t max_logged_refusals = 16;
  std::uint64_t total_bytes_ = 0;
  Mode first_mode_ = Mode::upload;
  std::string first_path_;
  std::optional<SessionReport> first_report_;  // the first operation's end line, logged once a second one ran
  errc last_code_ = errc::ok;
  std::string last_message_;
  bool reported_ = false;
};

}  // namespace

std::string check_operation(const ServerConfig& config, const wire::Negotiation& n, bool write, errc& code) {
  code = errc::bad_argument;
  // The session's parameters, again: an operation never runs on values the server did not allow.
  if (n.channel_count == 0 || n.channel_count > config.max_channels)
    return fmt::format("n = {} channels (this server allows 1..{})", n.channel_count, config.max_channels);
  if (n.block_size < wire::min_block_size || n.block_size > config.max_block_size ||
      n.block_size > wire::max_block_size)
    return fmt::format("block size {} is outside {}..{}", n.block_size, wire::min_block_size, config.max_block_size);
  if (n.extended_flags & ~wire::known_flags) return fmt::format("unknown extended flags {:#x}", n.extended_flags);
  const bool memory = (n.extended_flags & wire::flag_memory) != 0;
  if (memory && !config.allow_memory_mode) return "memory mode is disabled on this server (xdfsd --allow-memory-mode)";
  if (memory && (n.mode == Mode::path || n.mode == Mode::relay || n.mode == Mode::pull))
    return fmt::format("memory mode does not apply to {} sessions", to_string(n.mode));
  if ((n.mode == Mode::upload || n.mode == Mode::relay) && config.max_file_size && n.file_size > config.max_file_size) {
    code = errc::limit_exceeded;
    return fmt::format("file size {} exceeds this server's limit of {} bytes", n.file_size, config.max_file_size);
  }
  if (auto s = files::check_relative_path(n.remote_path); !s) {
    code = s.code;
    return s.message;
  }
  if (!write && (n.mode == Mode::upload || n.mode == Mode::relay)) {
    code = errc::permission_denied;
    return "this client key may only download (read-only)";
  }
  return {};
}

HandlerFactory session_factory(Modes modes) {
  auto shared = std::make_shared<const Modes>(std::move(modes));
  return [shared](SessionEnv& env) -> std::unique_ptr<SessionHandler> { return std::make_unique<Session>(env, shared); };
}

}  // namespace runtime
}  // namespace xdfs
