// The server runtime: listener, handshake checks, the session registry and shutdown.
//
// The listener thread accepts connections, reads each channel's preamble and negotiation header
// under a deadline and checks them. The first channel of a session GUID creates the session,
// which gets its own io_context and network thread (the paper's MTEDP model: m sessions, m
// network threads); later channels of that GUID are handed to that thread. What a session does
// with its channels is the business of a mode (xFTSM, path mode), plugged in as a factory.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "xdfs/error.hpp"
#include "xdfs/types.hpp"
#include "xdfs/wire.hpp"
#include "xdfs/xdsi.hpp"
#include "xdfs/xsec.hpp"

namespace xdfs {

/// Server settings. Every limit bounds something a client controls.
struct ServerConfig {
  std::string root;                       ///< directory served; nothing outside it is reachable
  /// Where the server keeps its identity (server_x25519, made on first start, mode 0600).
  /// Empty: $XDFS_STATE_DIR, else $XDG_STATE_HOME/xdfsd, else ~/.local/state/xdfsd.
  std::string state_dir;
  /// Client keys admitted, with their permissions. Empty: <state_dir>/authorized_keys.
  /// Read at each session start, so edits apply without a restart.
  std::string authorized_keys;
  std::string listen = "127.0.0.1:7721";  ///< HOST:PORT; port 0 picks a free one
  unsigned max_sessions = 64;             ///< sessions at once; more are refused
  unsigned max_channels = 256;            ///< n per session; more is refused
  std::uint32_t max_block_size = 16u << 20;
  std::uint32_t max_tcp_window = 64u << 20;
  std::size_t ring_bytes = 32u << 20;     ///< per-session pool between network and disk
  std::chrono::milliseconds handshake_timeout{10000};  ///< preamble + negotiation must arrive in this
  std::chrono::milliseconds join_timeout{10000};       ///< all n channels must arrive in this
  std::chrono::milliseconds idle_timeout{60000};       ///< a session with no progress this long ends
  bool fsync = false;                     ///< fdatasync received files before renaming them into place
  bool allow_memory_mode = false;         ///< accept memory-to-memory sessions (benchmarks)
  unsigned path_workers = 4;              ///< path mode: threads per session doing file-system work
  /// Where log lines go (one line each, no newline). Default: stderr with a timestamp.
  std::function<void(const std::string&)> log;
};

/// What a finished session reports; the runtime logs it as the session's end line.
struct SessionReport {
  SessionId id;
  std::string peer;
  Mode mode = Mode::upload;
  std::string path;
  unsigned channels = 0;
  std::uint64_t bytes = 0;
  double seconds = 0;
  errc code = errc::ok;
  std::string message;
};

namespace runtime {

/// Given to a mode when a session registers. Lives as long as the session.
struct SessionEnv {
  boost::asio::io_context& io;   ///< the session's own loop, run by its network thread
  const ServerConfig& config;    ///< state_dir and authorized_keys resolved
  int root_fd;                   ///< O_PATH descriptor of the root
  const xsec::KeyPair& key;      ///< the server's identity
  SessionId id;
  std::string peer;
  wire::Negotiation first;       ///< the first channel's negotiation
  /// The mode calls this once when the session ends (on the session thread).
  std::function<void(SessionReport)> done;
  /// The mode calls this once when all channels are in (for the start log line).
  std::function<void(const std::string&)> log;
};

/// A mode's per-session state machine. All calls arrive on the session's thread.
class SessionHandler {
public:
  virtual ~SessionHandler() = default;
  /// A channel that passed the handshake checks and names this session's GUID. `opening` is
  /// the preamble and NEGO frame as received: the security handshake binds them.
  virtual void add_channel(xdsi::tcp::socket socket, wire::Negotiation nego, std::vector<std::uint8_t> opening,
                           std::string peer) = 0;
  /// The server is stopping: fail the session, remove partial files, tell the peer.
  virtual void shutdown() = 0;
};

using HandlerFactory = std::function<std::unique_ptr<SessionHandler>(SessionEnv& env)>;

}  // namespace runtime

/// A running xdfsd. Construct, then run() on the thread that should be the listener.
class Server {
public:
  /// Opens the root and binds the listening socket; throws xdfs::Error on failure.
  Server(ServerConfig config, runtime::HandlerFactory factory);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  /// The bound port (useful with port 0).
  std::uint16_t port() const noexcept;
  /// Serves until stop() or, if handle_signals, SIGINT/SIGTERM; then ends every session
  /// (partial files removed) and returns.
  void run(bool handle_signals = false);
  /// Thread-safe request to stop.
  void stop();
  /// Sessions registered right now (thread-safe).
  std::size_t active_sessions() const noexcept;
  /// Channels refused at the handshake so far (thread-safe).
  std::size_t rejected_channels() const noexcept;
  /// The server's public key.
  const xsec::Key32& public_key() const noexcept;

private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Formats a session's end line.
std::string format_report(const SessionReport& r);

}  // namespace xdfs
