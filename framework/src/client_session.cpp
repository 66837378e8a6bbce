#include "xdfs/session.hpp"

#include <unistd.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <fmt/core.h>

#include <optional>
#include <utility>

#include "xdfs/detail/session_fsm.hpp"
#include "xdfs/types.hpp"

namespace xdfs {

using xdsi::ErrorCode;
using xdsi::tcp;

namespace {
using Clock = std::chrono::steady_clock;

using session_fsm::SessionAction;
using session_fsm::SessionEvent;
using session_fsm::State;
}  // namespace

struct Session::Impl {
  Impl(const Endpoint& ep, const SessionOptions& opt) : endpoint(ep), opt(opt), resolver(io), deadline(io) {
    opening.session = SessionId::random();
    base.channel_count = opt.channels;
    base.block_size = opt.block_size;
    base.tcp_window = opt.tcp_window;
    if (opt.memory) base.extended_flags |= wire::flag_memory;
    if (opt.verify && !opt.memory) base.extended_flags |= wire::flag_manifest;
  }

  piod::PoolCache pools;  // outlives every transfer of the session
  boost::asio::io_context io{1};
  Endpoint endpoint;
  SessionOptions opt;
  tcp::resolver resolver;
  tcp::resolver::results_type results;
  boost::asio::steady_timer deadline;
  wire::Opening opening;   // what every channel says first (each with its own index and nonce)
  wire::Negotiation base;  // the session's part of every operation's negotiation
  wire::Negotiation nego;  // the operation being negotiated
  xsec::KeyPair identity;
  xsec::Key32 server_static{};
  std::string known_hosts_path;
  xsec::Key32 secret{};
  xdsi::ChannelList channels;
  session_fsm::Machine machine{session_fsm::Side::client};
  bool closed = false;        // close() ran (or the session failed): nothing more
  bool connected = false;     // all n channels authenticated once
  unsigned secured = 0;
  std::uint32_t next_join = 1;  // the next channel to connect
  // Channels joining at once (connecting and proving the session secret).
  static constexpr std::uint32_t max_joining = 32;
  unsigned answered = 0;      // channels that answered the operation's negotiation
  unsigned refusals = 0;
  std::optional<wire::NegotiationReply> reply;
  std::optional<wire::ExceptionHeader> refusal;
  // The negotiation's outcome when it is not a reply: the error, and whether the server said it.
  bool failed = false;
  Failure why;
  std::uint64_t ops = 0;
  Clock::time_point start;
  double setup = 0;

  void check_options() {
    if (opt.channels == 0) throw TransferError(errc::bad_argument, "channel count must be at least 1", false);
    if (opt.block_size < wire::min_block_size || opt.block_size > wire::max_block_size)
      throw TransferError(errc::bad_argument,
                          fmt::format("block size {} is outside {}..{}", opt.block_size, wire::min_block_size,
                                      wire::max_block_size),
                          false);
  }

  // Starts an operation's negotiation; `done` runs on the loop once it is settled (accepted,
  // refused or failed), never from inside this call.
  void start_op(wire::Negotiation op, Completion<wire::NegotiationReply> done) {
    try {
      if (waiter) throw TransferError(errc::bad_argument, "an operation is already being negotiated in this session", false);
      if (machine.state() == State::failed)
        throw TransferError(errc::session_ended, "an earlier failure ended this session", false);
      if (closed || !machine.find(SessionEvent::begin))
        throw TransferError(errc::bad_argument,
                            closed || machine.finished() ? std::string("the session is closed")
                                                         : "an operation is still running in this session",
                            false);
      if (op.remote_path.size() > wire::max_path_bytes)
        throw TransferError(errc::bad_argument, "remote path longer than 4096 bytes", false);
      if (!connected) check_options();
    } catch (...) {
      return detail::fail_later(io, std::move(done), std::current_exception());
    }
    op.channel_count = base.channel_count;
    op.block_size = base.block_size;
    op.tcp_window = base.tcp_window;
    op.extended_flags = base.extended_flags;
    op.transfer = ops++;
    nego = std::move(op);
    answered = refusals = 0;
    reply.reset();
    pending_reply.reset();
    refusal.reset();
    failed = false;
    waiter = std::move(done);
    const auto action = machine.fire(SessionEvent::begin);
    // From here every outcome, a throw included, settles through the completion.
    try {
      arm_deadline();
      if (action == SessionAction::connect_channels)
        open();
      else
        renegotiate();
    } catch (const Error& e) {
      fail(e.code(), e.context(), false);
    } catch (const std::exception& e) {
      fail(errc::internal, e.what(), false);
    } catch (...) {
      fail(errc::internal, "the negotiation failed", false);
    }
  }

  // The negotiation has an outcome (or failed): it is settled on the loop, once.
  void poke() {
    if (!waiter || settling) return;
    if (!failed && !reply && !(refusal && answered == base.channel_count)) return;
    settling = true;
    boost::asio::post(io, [this] { settle(); });
  }

  void settle() {
    settling = false;
    if (!waiter) return;
    auto done = std::exchange(waiter, nullptr);
    deadline.cancel();
    wire::NegotiationReply r;
    std::exception_ptr e;
    try {
      r = conclude();
    } catch (...) {
      e = std::current_exception();
    }
    done(e, r);
  }

  // What the table makes of the negotiation's outcome.
  wire::NegotiationReply conclude() {
    if (failed) {
      (void)machine.fire(why.code == errc::timeout ? SessionEvent::timeout
                         : why.from_peer           ? SessionEvent::peer_exception
                                                   : SessionEvent::local_error);
      close_channels();
      if (why.operation.empty())
        why.operation = connected ? fmt::format("negotiation of operation {}", nego.transfer) : std::string("session set-up");
      throw TransferError(why);
    }
    if (refusal) {
      if (!connected) setup = std::chrono::duration<double>(Clock::now() - start).count();
      connected = true;  // the channels are up: a later operation negotiates on them
      if (machine.fire(SessionEvent::refused) != SessionAction::report_refusal) {
        close_channels();
        throw TransferError(errc::state_violation, machine.why(), false);
      }
      throw TransferError(refusal->code, refusal->message, true);
    }
    if (machine.fire(SessionEvent::accepted) != SessionAction::start_operation) {
      close_channels();
      throw TransferError(errc::state_violation, machine.why(), false);
    }
    if (!connected) {
      connected = true;
      setup = std::chrono::duration<double>(Clock::now() - start).count();
    }
    return *reply;
  }

  // The blocking form: start, then run the loop on this thread until it is settled.
  wire::NegotiationReply begin(wire::Negotiation op) {
    bool done = false;
    std::exception_ptr err;
    wire::NegotiationReply out;
    start_op(std::move(op), [&](std::exception_ptr e, wire::NegotiationReply r) {
      done = true;
      err = e;
      out = std::move(r);
    });
    // However this frame is left, no completion refers to it afterwards.
    struct Forget {
      Impl& d;
      bool& done;
      ~Forget() {
        if (!done) d.waiter = nullptr;
      }
    } forget{*this, done};
    io.restart();
    try {
      while (!done && io.run_one()) {
      }
    } catch (...) {
      // A handler threw (a notice callback): the session is over, as for any failure (`forget`
      // drops the completion).
      fail(errc::internal, "a handler threw during the negotiation", false);
      (void)machine.fire(SessionEvent::local_error);
      close_channels();
      throw;
    }
    if (!done) {
      fail(errc::internal, "the session's event loop stopped", false);
      io.restart();
      while (!done && io.run_one()) {
      }
    }
    if (!done) throw TransferError(errc::internal, "the session's event loop stopped", false);
    if (err) std::rethrow_exception(err);
    return out;
  }

  void arm_deadline() {
    const auto until = Clock::now() + opt.connect_timeout;
    tick(until);
  }

  // The connect deadline, and the user's cancel, while an operation is negotiated.
  void tick(Clock::time_point until) {
    deadline.expires_after(std::chrono::milliseconds(100));
    deadline.async_wait([this, until](const ErrorCode& ec) {
      if (ec || machine.state() != State::negotiating || failed) return;
      if (opt.cancel && opt.cancel->load()) return fail(errc::cancelled, "cancelled by the user", false);
      if (Clock::now() >= until)
        return fail(errc::timeout,
                    fmt::format("{}:{} did not accept the {} within {} ms", endpoint.host, endpoint.port,
                                connected ? "operation" : "session", opt.connect_timeout.count()),
                    false);
      tick(until);
    });
  }

  void fail(errc c, const std::string& m, bool r) { fail(Failure(c, m, r)); }
  void fail(Failure f) {
    if (failed) return;
    failed = true;
    why = std::move(f);
    resolver.cancel();
    for (auto& ch : channels)
      if (ch) ch->close();
    poke();
  }

  // The session is over: its channels close; what is queued for them runs when the loop next does.
  void close_channels() noexcept {
    closed = true;
    deadline.cancel();
    for (auto& ch : channels)
      if (ch) ch->close();
  }

  // close_channels, and runs what is ready (the caller's thread runs the loop, not a handler).
  void shut() noexcept {
    close_channels();
    try {
      io.restart();
      io.poll();
    } catch (...) {
    }
  }

  // The first operation: connect, authenticate, negotiate inside the handshake.
  void open() {
    const std::string dir = xsec::default_config_dir();
    const std::string id_path = opt.identity_file.empty() ? dir + "/id_x25519" : opt.identity_file;
    known_hosts_path = opt.known_hosts_file.empty() ? dir + "/known_hosts" : opt.known_hosts_file;
    try {
      bool created = false;
      identity = opt.identity_secret ? xsec::KeyPair::from_secret(*opt.identity_secret)
                                     : xsec::load_or_create_key(id_path, &created);
      if (created && opt.notice)
        opt.notice("made a new client key " + xsec::fingerprint(identity.public_key) + " in " + id_path);
    } catch (const Error& e) {
      return fail(e.code(), e.context(), false);
    }
    opening.protect = static_cast<std::uint8_t>(opt.protect);
    opening.cipher = static_cast<std::uint8_t>(xsec::preferred_cipher());
    start = Clock::now();
    resolver.async_resolve(endpoint.host, std::to_string(endpoint.port),
                           [this](const ErrorCode& ec, tcp::resolver::results_type r) {
                             if (failed) return;
                             if (ec)
                               return fail(errc::connection_failed,
                                           "cannot resolve '" + endpoint.host + "': " + ec.message(), false);
                             results = r;
                             channels.resize(opt.channels);
                             connect(0);
                           });
  }

  void connect(std::uint32_t i) {
    channels[i] = std::make_unique<xdsi::Channel>(tcp::socket(io), i);
    auto& ch = *channels[i];
    boost::asio::async_connect(ch.socket(), results, [this, &ch](const ErrorCode& ec, const tcp::endpoint&) {
      if (failed) return;
      if (ec) {
        const errc c = ec == boost::asio::error::connection_refused ? errc::connection_refused : errc::connection_failed;
        return fail(c, fmt::format("{}:{}: {}", endpoint.host, endpoint.port, ec.message()), false);
      }
      on_connected(ch);
    });
  }

  // Each channel opens with the preamble and its opening in the clear; channel 0 then runs Noise
  // XX and sends the negotiation inside it (once the server's key checked out), the others join.
  void on_connected(xdsi::Channel& ch) {
    xdsi::SocketOptions so;
    so.tcp_window = opt.tcp_window;
    xdsi::apply(ch, so);
    auto o = opening;
    o.channel_index = ch.index();
    o.join = ch.index() != 0;
    if (o.join) {
      o.join_nonce.resize(32);
      xsec::random_fill(o.join_nonce);
    }
    auto payload = wire::encode(o);
    wire::FrameHeader h;
    h.event = wire::ChannelEvent::nego;
    h.length = static_cast<std::uint32_t>(payload.size());
    auto pre = wire::encode_preamble();
    auto hb = wire::encode(h);
    std::vector<std::uint8_t> bytes(pre.size() + hb.size() + payload.size());
    auto at = std::copy(pre.begin(), pre.end(), bytes.begin());
    at = std::copy(hb.begin(), hb.end(), at);
    std::copy(payload.begin(), payload.end(), at);
    std::vector<std::uint8_t> sent = bytes;
    ch.send_raw(std::move(bytes), [this, &ch](const ErrorCode& ec) {
      if (ec) channel_lost(ch, ec);
    });
    const auto mode = static_cast<xsec::Protect>(opening.protect);
    const auto c = static_cast<xsec::Cipher>(opening.cipher);
    if (!o.join) {
      xsec::client_establish(ch, std::move(sent), identity, mode, c, wire::encode(nego),
                             [this](const xsec::Key32& k) { return accept_server(k); },
                             [this, &ch](xsec::HandshakeResult r) {
                               if (failed) return;
                               if (r.code != errc::ok) return fail(r.code, r.message, r.remote);
                               secret = r.session_secret;
                               on_secured(ch);
                               // The others join a few at a time: a server counts a connection
                               // against its source address's cap (xdfsd's default is 64) until
                               // it has read its opening, so 255 at once would push each other
                               // out. 32 leave room for another client on this host; 16 at once
                               // took 1000 channels 158 ms to join on loopback, 32 take 101 ms.
                               next_join = 1;
                               while (next_join < opt.channels && next_join <= max_joining) connect(next_join++);
                             });
    } else {
      xsec::client_join(ch, std::move(sent), o.join_nonce, secret, mode, c, [this, &ch](xsec::HandshakeResult r) {
        if (failed) return;
        if (r.code != errc::ok) return fail(r.code, r.message, r.remote);
        on_secured(ch);
        if (next_join < opt.channels) connect(next_join++);
      });
    }
  }

  void on_secured(xdsi::Channel& ch) {
    ++secured;
    read_answer(ch);
  }

  // The server's key checked, then handed to the caller's hook (SessionOptions::server_key_accepted).
  xsec::HandshakeResult accept_server(const xsec::Key32& key) {
    auto r = check_server(key);
    if (r.code != errc::ok || !opt.server_key_accepted) return r;
    try {
      opt.server_key_accepted(key);
    } catch (const Error& e) {
      r.code = e.code();
      r.message = e.context();
    } catch (const std::exception& e) {
      r.code = errc::internal;
      r.message = e.what();
    } catch (...) {
      r.code = errc::internal;
      r.message = "the accepted server key's hook failed";
    }
    return r;
  }

  // Known hosts: trust on first use (with a notice) unless strict; a changed key is refused.
  xsec::HandshakeResult check_server(const xsec::Key32& key) {
    xsec::HandshakeResult r;
    const std::string where = endpoint.host + ":" + std::to_string(endpoint.port);
    server_static = key;
    if (opt.server_key) {
      if (*opt.server_key == key) return r;
      r.code = errc::auth_failed;
      r.message = "the server at " + where + " offered key " + xsec::fingerprint(key) + ", not the expected " +
                  xsec::fingerprint(*opt.server_key);
      return r;
    }
    xsec::KnownHosts hosts(known_hosts_path);
    auto pinned = hosts.lookup(where);
    if (pinned && *pinned == key) return r;
    r.code = errc::auth_failed;
    if (pinned) {
      r.message = "the server key of " + where + " changed: pinned " + xsec::fingerprint(*pinned) + ", offered " +
                  xsec::fingerprint(key) + "; if that is expected, remove its line from " + known_hosts_path;
      return r;
    }
    if (opt.strict_host_key) {
      r.message = "unknown server key " + xsec::fingerprint(key) + " for " + where +
                  " (--strict-host-key: add it to " + known_hosts_path + " first)";
      return r;
    }
    try {
      hosts.add(where, key);
    } catch (const Error& e) {
      r.message = e.what();
      return r;
    }
    if (opt.notice) opt.notice("new server " + where + " with key " + xsec::fingerprint(key) + " pinned in " + known_hosts_path);
    return xsec::HandshakeResult{};
  }

  // A later operation: its negotiation on every channel, then one answer from each.
  void renegotiate() {
    auto payload = wire::encode(nego);
    for (auto& ch : channels) {
      auto* c = ch.get();
      c->send_control(wire::ChannelEvent::nego, payload, [this, c](const ErrorCode& ec) {
        if (ec) channel_lost(*c, ec);
      });
      read_answer(*c);
    }
  }

  // One frame per channel answers an operation: its reply, or an exception that refuses it
  // (the session goes on) or ends the session.
  void read_answer(xdsi::Channel& ch) {
    ch.async_read_header([this, &ch](const ErrorCode& ec, const wire::FrameHeader& h) {
      if (failed) return;
      if (ec) return channel_lost(ch, ec);
      if (h.event != wire::ChannelEvent::nego_reply && h.event != wire::ChannelEvent::exception)
        return fail(errc::protocol_error,
                    std::string("server answered the negotiation with ") + wire::to_string(h.event), false);
      if (h.length > wire::max_control_payload)
        return fail(errc::protocol_error, "oversized answer to the negotiation", false);
      auto buf = std::make_shared<std::vector<std::uint8_t>>(h.length);
      ch.async_read_payload(*buf, [this, &ch, buf, ev = h.event](const ErrorCode& ec) {
        if (failed) return;
        if (ec) return channel_lost(ch, ec);
        on_answer(ev, *buf);
      });
    });
  }

  void on_answer(wire::ChannelEvent ev, const std::vector<std::uint8_t>& payload) {
    std::string why;
    if (ev == wire::ChannelEvent::exception) {
      auto ex = wire::decode_exception(payload, &why);
      if (!ex) return fail(errc::protocol_error, "bad exception header: " + why, false);
      // A refusal must come on every channel; one after a reply on another channel is a bad answer.
      if (!ex->refused) return fail(ex->code, ex->message, true);
      if (pending_reply) return fail(errc::protocol_error, "the server both accepted and refused the operation", false);
      refusal = *ex;
      ++answered;
      return poke();
    }
    auto r = wire::decode_reply(payload, &why);
    if (!r) return fail(errc::protocol_error, "bad negotiation reply: " + why, false);
    if (refusal) return fail(errc::protocol_error, "the server both refused and accepted the operation", false);
    if (r->block_size != nego.block_size || (pending_reply && !(*pending_reply == *r)))
      return fail(errc::protocol_error, "negotiation replies disagree", false);
    pending_reply = *r;
    if (++answered == base.channel_count) reply = pending_reply;
    poke();
  }

  void channel_lost(xdsi::Channel& ch, const ErrorCode& ec) {
    if (ec == boost::asio::error::operation_aborted || failed) return;
    auto f = ch.failure(ec, "server");
    if (f.peer_gone) f.message += " during the negotiation";
    fail(std::move(f));
  }

  void close() noexcept {
    if (closed) return;
    // A negotiation still waiting completes (cancelled) when the loop next runs.
    if (waiter) fail(errc::cancelled, "the session was closed", false);
    // The table: from ready, the end is told (EOFT on every channel); before any operation
    // there is nothing to tell; anywhere else the channels just close.
    const bool tell = machine.fire(SessionEvent::end_asked) == SessionAction::finish && connected;
    closed = true;
    if (tell) {
      try {
        // EOFT on every channel: the session ends. Wait (briefly) for it to leave, then close.
        auto left = std::make_shared<unsigned>(0);
        for (auto& ch : channels) {
          if (!ch || !ch->open()) continue;
          ++*left;
          wire::FrameHeader h;
          h.event = wire::ChannelEvent::eoft;
          ch->send(h, std::vector<std::uint8_t>{}, [left](const ErrorCode&) { --*left; });
        }
        io.restart();
        deadline.expires_after(std::chrono::seconds(2));
        bool late = false;
        deadline.async_wait([&late](const ErrorCode& ec) {
          if (!ec) late = true;
        });
        while (*left > 0 && !late && io.run_one()) {
        }
        deadline.cancel();
      } catch (...) {
      }
    }
    shut();
  }

  std::optional<wire::NegotiationReply> pending_reply;
  Completion<wire::NegotiationReply> waiter;       // the running negotiation's completion
  bool settling = false;  // its settle() is posted
};

Session::Session(const Endpoint& server, const SessionOptions& options) : impl_(std::make_unique<Impl>(server, options)) {}

Session::~Session() { close(); }

wire::NegotiationReply Session::begin(wire::Negotiation op) { return impl_->begin(std::move(op)); }

void Session::start(wire::Negotiation op, Completion<wire::NegotiationReply> done) { impl_->start_op(std::move(op), std::move(done)); }

void Session::end_operation(bool ok) {
  auto& d = *impl_;
  if (d.machine.state() != State::operating) return;
  if (d.machine.fire(ok ? SessionEvent::operation_ended : SessionEvent::operation_failed) && ok) return;
  d.close_channels();
}

void Session::close() noexcept { impl_->close(); }

bool Session::usable() const noexcept { return !impl_->closed && impl_->machine.find(SessionEvent::begin) != nullptr; }
bool Session::opened() const noexcept { return impl_->connected; }
boost::asio::io_context& Session::io() noexcept { return impl_->io; }
xdsi::ChannelList& Session::channels() noexcept { return impl_->channels; }
const SessionOptions& Session::options() const noexcept { return impl_->opt; }
const Endpoint& Session::endpoint() const noexcept { return impl_->endpoint; }
bool Session::manifest() const noexcept { return (impl_->base.extended_flags & wire::flag_manifest) != 0; }
xsec::Protect Session::protect() const noexcept { return static_cast<xsec::Protect>(impl_->opening.protect); }
xsec::Cipher Session::cipher() const noexcept { return static_cast<xsec::Cipher>(impl_->opening.cipher); }
xsec::Key32 Session::data_key(bool client_to_server) const {
  return xsec::data_key(impl_->secret, client_to_server, impl_->nego.transfer);
}
std::uint64_t Session::transfer() const noexcept { return impl_->nego.transfer; }
const xsec::Key32& Session::server_key() const noexcept { return impl_->server_static; }
double Session::setup_seconds() const noexcept { return impl_->setup; }
std::uint64_t Session::operations() const noexcept { return impl_->ops; }
std::string Session::tag() const {
  // As a tree download's own temporary files: "dl-PID-HEX", so that what a killed copy left
  // is told from a running one's and swept (pathm::sweep_stale_downloads).
  return "dl-" + std::to_string(::getpid()) + "-" + impl_->opening.session.short_hex();
}
piod::PoolCache& Session::pool_cache() noexcept { return impl_->pools; }

}  // namespace xdfs
