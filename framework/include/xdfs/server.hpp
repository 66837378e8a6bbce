// The server runtime: listener, authentication, admission, the session registry and shutdown.
//
// The listener thread accepts connections and, for each, reads the channel's opening and runs its
// handshake (Noise XX for a session's first channel, the cheap join for the others) under one
// deadline. Until then a connection costs a small constant and no thread, and counts against a
// server-wide and a per-address cap of pending connections (the oldest goes when one is full).
// Public-key work is queued fairly between source addresses. Only an authenticated first
// channel, whose key is authorized for what its negotiation asks, creates a session: its own
// io_context and network thread (the paper's MTEDP model: m sessions, m network threads), which
// the session's other channels join once they have proved its secret. What a session does with
// its channels is the business of a mode (xFTSM, path mode), plugged in as a factory.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "xdfs/budget.hpp"
#include "xdfs/error.hpp"
#include "xdfs/rate.hpp"
#include "xdfs/files.hpp"
#include "xdfs/metrics.hpp"
#include "xdfs/types.hpp"
#include "xdfs/wire.hpp"
#include "xdfs/xdsi.hpp"
#include "xdfs/xsec.hpp"

namespace xdfs {

/// Server settings. Every limit bounds something a client controls.
struct ServerConfig {
  std::string root;                       ///< directory served; nothing outside it is reachable
  /// Where the server keeps its identity (server_x25519, made on first start, mode 0600).
  /// Empty: $XDFS_STATE_DIR, else $XDG_STATE_HOME/xdfsd, else ~/.local/state/xdfsd. It must not
  /// lie inside the root (a client could read the server's key).
  std::string state_dir;
  /// Client keys admitted, with their permissions. Empty: <state_dir>/authorized_keys.
  /// Read at each session start, so edits apply without a restart.
  std::string authorized_keys;
  /// The xdfsd servers this one may forward a relay to (the next hosts of a chain): their keys,
  /// a line each, as `xdfsd --print-key` prints them. Empty: <state_dir>/relay_peers. Read at
  /// each relay's start and at each change of its hops. Without it, this server takes relays
  /// only as the last host of a chain.
  std::string relay_peers;
  /// Hops named by a relay's master are trusted as if they were relay peers: for a pulling
  /// host's own server, which admits only the master it pulls from (xduc get).
  bool relay_trust_master = false;
  /// A directory beside the root for relay places of at most `relay_memory_max` bytes (a
  /// pulling host's set parts, on a memory file system: their bytes then reach the root's disk
  /// once, as the files they hold). A place that does not fit there is written under the root
  /// as any other. Empty: none.
  std::string relay_memory_dir;
  std::uint64_t relay_memory_max = 0;
  /// The server's key itself, instead of <state_dir>/server_x25519 (a pulling host serves with
  /// its client key, which its master pins).
  std::optional<xsec::Key32> key;
  std::string listen = "127.0.0.1:7721";  ///< HOST:PORT; port 0 picks a free one
  unsigned max_sessions = 64;             ///< authenticated sessions at once; more are refused
  unsigned max_channels = 256;            ///< n per session; more is refused
  /// Per client key, unless its authorized_keys line says otherwise (sessions=N, channels=N):
  unsigned max_sessions_per_key = 16;     ///< sessions at once
  unsigned max_channels_per_key = 1024;   ///< channels at once, over all its sessions
  /// Connections that have not authenticated yet (reading their opening, in their handshake):
  unsigned max_pending = 1024;            ///< server-wide; when full, the oldest pending connection goes
  unsigned max_pending_per_address = 64;  ///< from one source address (IPv6: one /64); when full, its oldest goes
  std::uint32_t max_block_size = 16u << 20;
  std::uint32_t max_tcp_window = 64u << 20;
  std::size_t ring_bytes = 32u << 20;     ///< per-session pool between network and disk (less if memory is short)
  /// Memory the whole server may use: an eighth of it (at most 32 MiB) is kept for the process
  /// itself, the rest is shared by the sessions (each one's own overhead, its ring, path-mode
  /// requests and replies), which wait for it or are refused. 0: default_memory_limit() (a
  /// quarter of the machine's memory, at most 2 GiB).
  std::size_t memory_limit = 0;
  /// Largest file a client may upload; 0: what the target file system has free.
  std::uint64_t max_file_size = 0;
  /// Weakest protection accepted (xsec::Protect: 0 clear, 1 integrity, 2 private).
  std::uint8_t min_protect = 0;
  std::chrono::milliseconds handshake_timeout{5000};   ///< opening + handshake must complete in this
  std::chrono::milliseconds join_timeout{10000};       ///< all n channels must arrive in this
  std::chrono::milliseconds idle_timeout{60000};       ///< a session with no progress this long ends
  bool fsync = false;                     ///< fdatasync received files before renaming them into place
  /// How long an interrupted upload's partial file and its resume record are kept for the
  /// client to continue it (swept at start and every hour after); 0: uploads are not resumable.
  std::chrono::seconds partial_expiry{24 * 3600};
  /// Bytes per second one session's file transfers may move, over all its channels (0: no limit).
  std::uint64_t max_rate = 0;
  /// Bytes per second all sessions' file transfers together may move (0: no limit).
  std::uint64_t max_total_rate = 0;
  bool allow_memory_mode = false;         ///< accept memory-to-memory sessions (benchmarks)
  /// An upload to an existing FIFO under the root writes into it, in order, for the process
  /// reading it (which must have it open); without this, such an upload replaces the FIFO.
  bool allow_fifo = false;
  unsigned path_workers = 4;              ///< path mode: threads per session doing file-system work
  /// Helper threads the process's transfers hash, seal and open blocks on beside their disk
  /// threads (piod::BlockWorkers; 0: none); the default is one per core but one, at most 7.
  /// The pool is the process's, made once: the first Server made gives it this
  /// (BlockWorkers::configure), unless the program set it before; a reload that changes it
  /// says it needs a restart.
  unsigned block_workers = piod::BlockWorkers::default_helpers();
  /// Downloads send file data to the sockets by sendfile(2) where they can (clear mode, a
  /// regular file); false (xdfsd --no-zero-copy) reads every block into user space first.
  bool zero_copy = true;
  /// Downloads (and relays) to a peer on this host go by sendfile too (xdfsd
  /// --loopback-sendfile); by default they are read first: over loopback, sendfile's packets
  /// of at most 17 pages cost the host more than the copy they save (perf/zerocopy.py).
  bool loopback_sendfile = false;
  /// A pulled set travels in parts (xduc get -r): packs of its small files of at most this many
  /// bytes, and each file over 16 MiB on its own (xdfsd --pull-pack-size; 64K to 128M).
  std::uint64_t pull_pack_size = std::uint64_t(128) << 20;
  /// Debug lines in the log too (xdfsd --debug): how each transfer goes.
  bool debug = false;
  /// Where log lines go (one line each, no newline, escaped: nothing from a peer can break a
  /// line or drive a terminal). Default: stderr with a timestamp.
  std::function<void(const std::string&)> log;
};

/// What a finished session (or one operation of it) reports; the runtime logs it as an end line.
struct SessionReport {
  SessionId id;
  std::string peer;
  Mode mode = Mode::upload;   ///< of the first operation (the session's), or of this operation
  std::string path;
  unsigned channels = 0;
  std::uint64_t bytes = 0;
  double seconds = 0;
  errc code = errc::ok;
  std::string message;
  std::uint64_t operations = 1;  ///< the session's operations (a session's end line shows it when > 1)
  std::optional<std::uint64_t> operation;  ///< set: this is the end line of that operation
};

namespace runtime {

class RelayRegistry;

/// Who a session's client is, as its authentication established.
struct Client {
  xsec::Key32 key{};
  std::string fingerprint;   ///< "SHA256:..." for log lines
  bool write = true;         ///< rw (else ro: nothing may be changed)
  /// Its sessions at once: its authorized_keys line's sessions=N, or max_sessions_per_key.
  unsigned max_sessions = 0;
};

/// Given to a mode when a session starts. Lives as long as the session.
struct SessionEnv {
  boost::asio::io_context& io;   ///< the session's own loop, run by its network thread
  const ServerConfig& config;    ///< state_dir and authorized_keys resolved
  int root_fd;                   ///< O_PATH descriptor of what the client may see (its key's subdirectory)
  SessionId id;
  std::string peer;
  /// Names this session's temporary files: the server run's own mark, then the session, so that
  /// what a crashed run left behind is found and removed when the server starts again.
  std::string tag;
  wire::Opening opening;         ///< channel 0's opening: protection level and cipher
  wire::Negotiation nego;        ///< what the client asked for (checked against the limits)
  Client client;
  xsec::Key32 session_secret{};  ///< the block keys of the session derive from it
  MemoryBudget& budget;          ///< server-wide: reserve before allocating for a peer
  RateLimiter& total_rate;       ///< server-wide: ServerConfig::max_total_rate
  RelayRegistry* relays;         ///< server-wide: places in relay chains (null: no relays)
  /// The mode calls this once when the session ends (on the session thread).
  std::function<void(SessionReport)> done;
  /// One log line (escaped by the runtime).
  std::function<void(const std::string&)> log;
  Metrics* metrics = nullptr;    ///< server-wide counters (null: none kept)
};

/// A mode's per-session state machine. All calls arrive on the session's thread.
class SessionHandler {
public:
  virtual ~SessionHandler() = default;
  /// An authenticated channel of this session: channel 0 first (it ran Noise XX), then the
  /// others as they prove the session secret. Its frames are protected from now on.
  virtual void add_channel(std::unique_ptr<xdsi::Channel> ch) = 0;
  /// The server is stopping: fail the session, remove partial files, tell the peer.
  virtual void shutdown() = 0;
  /// One of the session's handlers threw: fail the session now with this reason, tell the
  /// peer, remove partial files. Other sessions never see it.
  virtual void crash(const std::string& what) = 0;
};

using HandlerFactory = std::function<std::unique_ptr<SessionHandler>(SessionEnv& env)>;

// ---------------------------------------------------------------------------------------------
// Modes. A session is who and which n channels; a mode is what those channels carry for one
// operation. The session (framework) admits the operation, makes it with its mode's factory, and
// takes the channels back when it ended on every one (EOFR both ways) for the next.

/// Given to an operation; lives as long as it.
struct OperationEnv {
  boost::asio::io_context& io;
  const ServerConfig& config;
  int root_fd;                   ///< what the client may see
  SessionId id;
  std::string peer;
  std::string tag;               ///< names temporary files (run mark and session)
  const wire::Opening& opening;  ///< protection level and cipher
  wire::Negotiation nego;        ///< this operation (checked against the limits and the client's rights)
  Client client;
  xsec::Key32 session_secret{};  ///< xsec::data_key(session_secret, direction, nego.transfer)
  MemoryBudget& budget;
  xdsi::ChannelList& channels;   ///< all n, each with nothing of this operation read or sent yet
  std::function<void(const std::string&)> log;
  /// What the session's operations made under the root (directories, received files): the
  /// entries whose modes its client may set later, in any operation of the session.
  std::shared_ptr<files::Made> made;
  /// What file transfers take their bytes from: the session's limit (ServerConfig::max_rate)
  /// and the server's (max_total_rate); either may be unlimited.
  RateLimiter* session_rate = nullptr;
  RateLimiter* total_rate = nullptr;
  RelayRegistry* relays = nullptr;  ///< places in relay chains (null: no relays)
  Metrics* metrics = nullptr;       ///< server-wide counters (null: none kept)
};

/// How an operation ended.
struct OperationResult {
  errc code = errc::ok;
  std::string message;
  bool from_peer = false;
  /// Refused before it started: nothing was sent on the channels, the session answers every
  /// channel with the refusal and stays ready for the next operation.
  bool refused = false;
  /// It ended on every channel (EOFR both ways, nothing of it left to read or send): the
  /// channels are ready for the next operation. Otherwise the operation has told the peer and
  /// is closing the channels, and the session ends.
  bool reusable = false;
};

/// One operation of a mode. All calls arrive on the session's thread.
class Operation {
public:
  virtual ~Operation() = default;
  /// Opens what it needs and answers on every channel (a NEGO_REPLY), or reports a refusal.
  virtual void start() = 0;
  /// The server stops or a handler threw: fail now, remove partial files, tell the peer.
  virtual void abort(errc code, const std::string& message) = 0;
  /// Bytes moved so far (for the end line).
  virtual std::uint64_t bytes() const noexcept = 0;
};

/// Called once by an operation when it has ended (on the session's thread).
using OperationDone = std::function<void(OperationResult)>;
using OperationFactory = std::function<std::unique_ptr<Operation>(OperationEnv& env, OperationDone done)>;

/// The modes a server offers: what each Mode of a negotiation runs. A mode not listed is
/// refused ("disabled on this server").
struct ModeEntry {
  Mode mode;
  OperationFactory make;
};
using Modes = std::vector<ModeEntry>;

/// The framework's session over these modes: what Server takes.
HandlerFactory session_factory(Modes modes);

/// Whether a negotiated operation fits the server's limits and the client's rights; the
/// reason otherwise (empty if it fits), with its code.
std::string check_operation(const ServerConfig& config, const wire::Negotiation& n, bool write, errc& code);

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
  /// (partial files removed) and returns. handle_signals also ignores SIGXFSZ and SIGPIPE, so
  /// that a write past the process's file size limit fails its session only, and a log written
  /// to a pipe nobody reads any more loses its lines, not the process (one that serves without
  /// handle_signals should ignore both itself).
  void run(bool handle_signals = false);
  /// Thread-safe request to stop.
  void stop();
  /// Sessions registered right now (thread-safe).
  std::size_t active_sessions() const noexcept;
  /// Connections not authenticated yet (thread-safe).
  std::size_t pending_connections() const noexcept;
  /// Channels refused at the handshake so far (thread-safe).
  std::size_t rejected_channels() const noexcept;
  /// The sessions' share of the memory limit.
  const MemoryBudget& memory() const noexcept;
  /// The server's public key.
  const xsec::Key32& public_key() const noexcept;
  /// Its places in relay chains (thread-safe).
  runtime::RelayRegistry& relays() noexcept;

  /// Where run() reports its state to a service manager (systemd's sd_notify): "READY=1" once
  /// listening, "RELOADING=1" then "READY=1" around a reload, "STOPPING=1" when it stops.
  /// Set before run().
  void on_state(std::function<void(const std::string&)> notify);
  /// What SIGHUP does when run() handles signals: `next` makes the settings anew (from the
  /// config file and the command line), or returns nullopt with the reason in `why`; the server
  /// then applies what can change while it runs (see reload()). Set before run().
  void on_reload(std::function<std::optional<ServerConfig>(std::string& why)> next);
  /// Applies the settings that can change while the server runs (thread-safe; done on the
  /// listener thread): the limits on sessions, channels, pending connections, blocks, files and
  /// the session rate, the timeouts, the protection floor, fsync, memory and FIFO modes, path
  /// workers, zero copy, debug lines, the authorized keys and relay peers files (read again at
  /// once). Sessions already running keep the settings they started with. What needs a restart
  /// (root, listen, state directory, memory limit, total rate, partial expiry, the key) is left
  /// as it was and named in the log line that says what was applied.
  void reload(ServerConfig next);

  /// Counters for monitoring (thread-safe).
  Metrics& metrics() noexcept;
  /// The counters and the gauges of this moment in Prometheus' text format (thread-safe).
  std::string metrics_text() const;

private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Formats a session's end line.
std::string format_report(const SessionReport& r);

}  // namespace xdfs
