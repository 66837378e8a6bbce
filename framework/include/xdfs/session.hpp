// The client's side of an xDFS session: who, and on which n channels.
//
// A Session connects its n channels, authenticates them (Noise XX on the first, the cheap join
// on the others) and then carries operations one after another: each is negotiated on every
// channel, run by a mode (an xFTSM file transfer, a path-mode session, ...) on the session's
// channels and event loop, and ended on every channel with EOFR both ways, after which the
// channels are ready for the next. close() ends the session (EOFT on every channel).
//
// The session knows no mode: a mode starts its operation's negotiation (start(), or begin(),
// which blocks), runs its engine on io() and channels(), and reports the end with end_operation().
//
// Asynchronous use: every completion runs on the thread that runs io() (the caller's own loop;
// the blocking calls run it themselves until they are done). A session is not thread-safe: one
// thread runs its loop and makes its calls.
#pragma once

#include <boost/asio/async_result.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/io_context.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "xdfs/completion.hpp"
#include "xdfs/error.hpp"
#include "xdfs/piod.hpp"
#include "xdfs/wire.hpp"
#include "xdfs/xdsi.hpp"
#include "xdfs/xsec.hpp"

namespace xdfs {

struct Endpoint {
  std::string host = "127.0.0.1";
  std::uint16_t port = 7721;
};

/// What every session needs, whatever its operations.
struct SessionOptions {
  unsigned channels = 1;                 ///< n parallel TCP channels
  std::uint32_t block_size = 1u << 20;   ///< bytes per block
  std::uint32_t tcp_window = 0;          ///< SO_SNDBUF/SO_RCVBUF; 0 = kernel autotuning
  std::chrono::milliseconds connect_timeout{15000};  ///< connect + negotiation of an operation
  std::chrono::milliseconds idle_timeout{60000};     ///< no progress this long fails the operation
  /// RemoteFs: while no call runs, a keep-alive this often, so that the server's idle timeout
  /// (xdfsd --idle-timeout, 60 s by default) does not end the session; 0 = none.
  std::chrono::milliseconds keep_alive{20000};
  /// xSec: how frames are protected (every channel is authenticated in every mode).
  xsec::Protect protect = xsec::Protect::private_;
  /// This client's private key; empty: <config>/id_x25519, made on first use (mode 0600).
  /// <config> is $XDFS_CONFIG_DIR, else $XDG_CONFIG_HOME/xdfs, else ~/.config/xdfs.
  std::string identity_file;
  /// This client's key itself, instead of identity_file (an xdfsd relaying with its own key).
  std::optional<xsec::Key32> identity_secret;
  /// Pinned server keys; empty: <config>/known_hosts.
  std::string known_hosts_file;
  /// The server's key, if known already (a relay's next hop, as its master saw it): any other
  /// is refused, and known_hosts is neither read nor written.
  std::optional<xsec::Key32> server_key;
  /// Refuse a server whose key is not pinned yet (default: pin it on first use, with a notice).
  bool strict_host_key = false;
  /// Runs on the session's loop once the server's key is accepted (pinned, or the expected
  /// one), before anything of the operation reaches the server: a pulling host authorizes its
  /// master here, before the master can call back. An exception from it fails the handshake.
  /// Every session made from these options calls it, each with its own server's key.
  std::function<void(const xsec::Key32&)> server_key_accepted;
  /// One-line notices for the user (a new key made, a server key pinned).
  std::function<void(const std::string&)> notice;
  /// Debug lines: how a transfer goes (zero copy, or why not). Null: none.
  std::function<void(const std::string&)> debug;
  /// Set to true from any thread (a signal handler too) to cancel; partial files are removed.
  const std::atomic<bool>* cancel = nullptr;
  /// Memory-to-memory benchmark sessions (no file at the server; it must allow them).
  bool memory = false;
  /// The content manifest (docs/manifest.md): every block travels with its SHA-256 and is
  /// checked before it counts, and both ends compare the whole-file digest. false (xduc
  /// --no-verify) saves the hashing for raw speed; memory sessions never hash.
  bool verify = true;
  /// Uploads send file data to the sockets by sendfile(2) where they can (clear mode, a regular
  /// file); false (xduc --no-zero-copy) reads every block into user space first.
  bool zero_copy = true;
  /// Uploads to a server on this host go by sendfile too (xduc --loopback-sendfile); by
  /// default they are read first: over loopback, sendfile's packets of at most 17 pages cost
  /// the host more than the copy they save (perf/zerocopy.py).
  bool loopback_sendfile = false;
};

class Session {
public:
  /// Does not connect yet: the first begin() does.
  Session(const Endpoint& server, const SessionOptions& options);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  /// Starts an operation and blocks until the server accepted it on every channel (its reply)
  /// or refused it. The first call connects and authenticates the n channels and negotiates
  /// inside the handshake; later ones send the negotiation on every channel. The session fills
  /// in channel_count, block_size, tcp_window, extended_flags and the transfer number. A refusal
  /// throws TransferError and leaves the session ready for the next operation; any other
  /// failure throws and leaves it closed.
  wire::NegotiationReply begin(wire::Negotiation op);
  /// The same, asynchronous: `done` runs on the session's loop (never inside this call) with the
  /// reply, or with the failure that begin() would throw.
  void start(wire::Negotiation op, Completion<wire::NegotiationReply> done);
  /// start() for any Asio completion token, from any thread (it starts on the loop); the
  /// signature is void(std::exception_ptr, wire::NegotiationReply).
  template <class Token>
  auto async_begin(wire::Negotiation op, Token&& token) {
    return boost::asio::async_initiate<Token, void(std::exception_ptr, wire::NegotiationReply)>(
        [this](auto handler, wire::Negotiation n) {
          auto done = detail::completion<wire::NegotiationReply>(std::move(handler), io().get_executor());
          // Started on the session's loop, whichever thread asks.
          boost::asio::dispatch(io(), [this, n = std::move(n), done]() mutable { start(std::move(n), done); });
        },
        token, std::move(op));
  }
  /// The running operation ended. ok: it ended on every channel (EOFR both ways) and the
  /// channels are ready for the next; otherwise the mode has told the peer and the session is
  /// over (its channels close). Callable from a handler: it runs nothing itself, so the mode
  /// keeps what its handlers refer to until the handlers already queued have run (it posts its
  /// own clean-up, or runs the loop's ready handlers before it goes).
  void end_operation(bool ok);
  /// Ends the session: EOFT on every channel, then closes them. Idempotent; never throws. It runs
  /// the loop itself: call it between operations and not from a handler (a negotiation still
  /// waiting completes as cancelled; a running operation is ended first by its own mode).
  void close() noexcept;

  /// Whether another operation may begin.
  bool usable() const noexcept;
  /// Whether the channels are connected and authenticated (an operation ran or runs).
  bool opened() const noexcept;
  boost::asio::io_context& io() noexcept;
  xdsi::ChannelList& channels() noexcept;
  const SessionOptions& options() const noexcept;
  const Endpoint& endpoint() const noexcept;
  xsec::Protect protect() const noexcept;
  /// Blocks travel with their digests in this session (verify, and not a memory session).
  bool manifest() const noexcept;
  xsec::Cipher cipher() const noexcept;
  /// The key that protects the blocks of the current operation in one direction.
  xsec::Key32 data_key(bool client_to_server) const;
  /// The number of the current (or last) operation.
  std::uint64_t transfer() const noexcept;
  /// The server's public key, as its handshake proved it (zero before the first operation).
  const xsec::Key32& server_key() const noexcept;
  /// Seconds from the first connect until the first operation was accepted on every channel.
  double setup_seconds() const noexcept;
  /// Operations begun so far (accepted or refused).
  std::uint64_t operations() const noexcept;
  /// A name for the session in temporary file names: "dl-", this process's id, the session's
  /// id (short), so that a later copy tells a killed one's files from a running one's.
  std::string tag() const;
  /// Block pools kept between the session's transfers (fresh memory costs a fault per page).
  piod::PoolCache& pool_cache() noexcept;

private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace xdfs
