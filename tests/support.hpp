// Test support: temporary trees, deterministic data, a server in-process or as a real xdfsd
// process, xduc runs, and a raw client that speaks the wire format by hand.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "xdfs/server.hpp"
#include "xdfs/wire.hpp"
#include "xdfs/xsec.hpp"

namespace xt {

/// A fresh directory under /tmp, removed with everything in it at scope exit.
class TempDir {
public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

private:
  std::string path_;
};

/// Writes `size` bytes of deterministic pseudo-random data (seeded) to `path`.
void write_random_file(const std::string& path, std::uint64_t size, std::uint64_t seed);
std::vector<std::uint8_t> random_bytes(std::size_t size, std::uint64_t seed);
void write_file(const std::string& path, const std::string& content);
std::string read_file(const std::string& path);
bool files_equal(const std::string& a, const std::string& b);
bool exists(const std::string& path);
/// Names in a directory (without . and ..), sorted.
std::vector<std::string> list_dir(const std::string& dir);

/// xdfs::Server with the xFTSM mode on a background thread, on 127.0.0.1 and a free port.
class InProcessServer {
public:
  explicit InProcessServer(xdfs::ServerConfig cfg);
  ~InProcessServer();
  std::uint16_t port() const { return port_; }
  xdfs::Server& server() { return *server_; }
  std::vector<std::string> log_lines();
  /// Waits (bounded) until a log line contains `text`.
  bool wait_for_log(const std::string& text, int timeout_ms = 10000);
  /// Waits (bounded) until at least `want` log lines contain `text`; how many do then.
  std::size_t wait_for_log_lines(const std::string& text, std::size_t want, int timeout_ms = 10000);

private:
  std::mutex mu_;
  std::condition_variable grew_;
  std::vector<std::string> log_;
  std::unique_ptr<xdfs::Server> server_;
  std::thread thread_;
  std::uint16_t port_ = 0;
};

/// A real xdfsd process on 127.0.0.1:0 (or where a --listen among extra_args says). Its stderr
/// is collected; the port is read from it.
/// `wrapper` runs it under another program (prlimit, say): its arguments, before xdfsd's path.
class XdfsdProcess {
public:
  XdfsdProcess(const std::string& root, std::vector<std::string> extra_args = {},
               std::vector<std::string> wrapper = {});
  ~XdfsdProcess();
  std::uint16_t port() const { return port_; }
  pid_t pid() const { return pid_; }
  bool alive();
  /// Sends sig and waits (at most timeout_ms, then SIGKILL) for exit; returns the exit status
  /// (or 128+signal; -2 if it had to be killed).
  int stop(int sig, int timeout_ms = 30000);
  /// Everything xdfsd logged so far.
  std::string log();
  /// Waits (bounded) until the log contains `text`; true if it did.
  bool wait_for_log(const std::string& text, int timeout_ms = 10000);

private:
  pid_t pid_ = -1;
  int err_fd_ = -1;
  std::uint16_t port_ = 0;
  std::mutex mu_;
  std::condition_variable grew_;
  std::string log_;
  std::thread reader_;
  int exit_status_ = -1;
  bool killed_ = false;
};

struct RunResult {
  int status = -1;  ///< exit code, or 128+signal
  std::string out;
  std::string err;
};
/// Runs a program to completion with stdin from /dev/null; after timeout_ms it is killed
/// (status 128+9). No test waits without a bound.
/// `pid`, when given, holds the child's pid while it runs (for a test that kills it).
RunResult run(const std::string& program, const std::vector<std::string>& args, int timeout_ms = 300000,
              std::atomic<pid_t>* pid = nullptr);
RunResult xduc(const std::vector<std::string>& args, int timeout_ms = 300000, std::atomic<pid_t>* pid = nullptr);

/// What a raw test client says: its opening (in the clear) and its negotiation (inside Noise XX).
struct Hello {
  xdfs::wire::Opening opening;
  xdfs::wire::Negotiation nego;
};

using Frame = std::pair<xdfs::wire::FrameHeader, std::vector<std::uint8_t>>;

/// One end of a hand-driven connection: it speaks the wire format by hand and, once keyed,
/// seals what it sends and checks what it reads, so that a test's crafted frames pass the
/// peer's checks (or fail them, when the test says so).
class RawPeer {
public:
  explicit RawPeer(int fd) : fd_(fd) {}
  ~RawPeer();
  RawPeer(const RawPeer&) = delete;
  RawPeer& operator=(const RawPeer&) = delete;
  int fd() const { return fd_; }
  void send_bytes(const void* data, std::size_t n);
  void send_bytes(const std::vector<std::uint8_t>& v) { send_bytes(v.data(), v.size()); }
  /// Sends a frame, sealed by the connection's keys once it has them (with one bit of its tag
  /// flipped if corrupt_tag: what a forger without the keys would send).
  void send_frame(const xdfs::wire::FrameHeader& h, const std::vector<std::uint8_t>& payload = {},
                  bool corrupt_tag = false);
  /// Sends a data frame for [offset, offset + data.size()): in integrity and private modes its
  /// payload is sealed with the session's block key first, as a real disk thread does.
  void send_block(xdfs::wire::ChannelEvent event, std::uint64_t offset, const std::vector<std::uint8_t>& data,
                  bool corrupt_tag = false);
  void shutdown_write();
  /// Reads one frame within timeout; nullopt on EOF/timeout/bad header or a frame that fails
  /// its check.
  std::optional<Frame> read_frame(int timeout_ms = 10000);
  /// Reads frames until an EXCEPTION arrives (skipping others); nullopt if none.
  std::optional<xdfs::wire::ExceptionHeader> read_exception(int timeout_ms = 10000);
  /// True if the peer closed (EOF or reset) within the timeout, discarding any data.
  bool wait_closed(int timeout_ms = 10000);
  /// Exactly n bytes within the timeout (false on EOF or timeout).
  bool read_exact(void* dst, std::size_t n, int timeout_ms);
  /// Every byte this end has sent (a recording an attacker could replay).
  const std::vector<std::uint8_t>& sent() const { return sent_; }
  /// Sends every byte on its own (with TCP_NODELAY: its own segment), so that the peer reads
  /// each frame a byte at a time.
  bool trickle = false;
  /// If set, the next send sends one byte of urgent data (MSG_OOB, out of band: the peer's
  /// stream goes on without it) before byte *urgent_before of what it sends. Not with trickle.
  std::optional<std::size_t> urgent_before;
  /// If set, the next send sends its first *pause_after bytes, waits 100 ms, then sends the
  /// rest: the peer finds them in the socket in two parts. Not with trickle.
  std::optional<std::size_t> pause_after;
  /// Blocks carry their digest after their data, as a real disk thread writes it (the
  /// negotiation's flag_manifest, set when the handshake sends or reads it).
  bool manifest = false;

protected:
  /// From now on frames are sealed and checked with these keys, and the blocks this end sends
  /// with the session's block key in that direction (clear mode: none).
  void protect_with(const xdfs::wire::Opening& o, const xdfs::xsec::Key32& send, const xdfs::xsec::Key32& recv,
                    const xdfs::xsec::Key32& secret, bool blocks_client_to_server);
  int fd_ = -1;
  std::unique_ptr<xdfs::xsec::FrameProtector> guard_;
  std::unique_ptr<xdfs::xsec::BlockCrypto> blocks_;
  std::optional<Frame> held_;  // read ahead (a handshake's last word), given out first
  std::vector<std::uint8_t> sent_;
};

/// A hand-driven client channel for bad-input tests: the real handshakes, then crafted frames.
class RawChannel : public RawPeer {
public:
  /// Connects to 127.0.0.1:port, from source_ip (any loopback address) if given.
  explicit RawChannel(std::uint16_t port, const std::string& source_ip = {});
  void send_preamble(std::uint16_t version = xdfs::protocol_version);
  /// Sends the preamble and the NEGO frame carrying this opening.
  void send_opening(const xdfs::wire::Opening& o);
  /// Sends the opening and runs Noise XX as the test client (the identity in $XDFS_CONFIG_DIR
  /// unless one is given), with the negotiation in message 3; from then on frames are
  /// protected. Waits for the server's confirmation (the session exists then; at most
  /// confirm_ms): an exception instead is kept for read_exception(). False if the server
  /// refused before its message 2.
  bool establish(const Hello& h, const xdfs::xsec::KeyPair* id = nullptr, int confirm_ms = 10000);
  /// Joins as channel `index` of the session `h` opened on another RawChannel, proving `secret`.
  /// False if the server's answer did not verify.
  bool join(const Hello& h, std::uint32_t index, const xdfs::xsec::Key32& secret);
  /// The server key seen in establish().
  xdfs::xsec::Key32 server_key() const { return server_key_; }
  xdfs::xsec::Key32 session_secret() const { return secret_; }
  /// The bytes establish() or send_opening() sent first (preamble and NEGO frame).
  const std::vector<std::uint8_t>& opening() const { return opening_; }

private:
  xdfs::xsec::Key32 server_key_{};
  xdfs::xsec::Key32 secret_{};
  std::vector<std::uint8_t> opening_;
};

/// A hostile server for client tests: it accepts connections on loopback, runs the server side
/// of Noise XX with its own key (a client pins it on first use), and then sends whatever the
/// test crafts: replies, blocks, path replies. Channel 0 only (no joins).
class RawServer {
public:
  RawServer();
  ~RawServer();
  std::uint16_t port() const { return port_; }
  const xdfs::xsec::KeyPair& key() const { return key_; }

  /// A client's channel 0 after the handshake: what it asked for, and the keyed connection.
  class Conn : public RawPeer {
  public:
    Conn(int fd, Hello h) : RawPeer(fd), hello(std::move(h)) {}
    Hello hello;
    xdfs::xsec::Key32 secret{};
    void key(const xdfs::xsec::Key32& send, const xdfs::xsec::Key32& recv);
    void send_reply(const xdfs::wire::NegotiationReply& r);
  };
  /// Accepts the next connection and runs the handshake (confirming it); null on failure.
  std::unique_ptr<Conn> accept(int timeout_ms = 10000);

private:
  int listen_fd_ = -1;
  std::uint16_t port_ = 0;
  xdfs::xsec::KeyPair key_;
};

/// A real upload and download through xduc (-p 3 and -p 2) against the server at port, whose
/// root is `root`: the proof that it still serves everyone else.
void check_serving(std::uint16_t port, const std::string& root, const std::string& local);

/// Waits (bounded) until every thread of a process sent SIGSTOP is stopped.
bool wait_stopped(pid_t pid, int timeout_ms = 10000);

/// Resident memory of a process (VmRSS) and its peak (VmHWM), in KiB; 0 if unknown.
std::uint64_t rss_kib(pid_t pid);
std::uint64_t peak_rss_kib(pid_t pid);
/// User and system CPU time a process has used so far, in seconds.
double cpu_seconds(pid_t pid);

/// Fails the test for every temporary ".part" file left in dir: a failure path forgot to clean up.
void check_no_partials(const std::string& dir);

/// Runs fn and returns the code of the xdfs::TransferError it throws (errc::ok if none), with
/// whether the server reported it and the one-line message.
xdfs::errc error_of(const std::function<void()>& fn, bool* remote = nullptr, std::string* what = nullptr);

/// The test client's identity (made by the test runner).
xdfs::xsec::KeyPair test_identity();

/// A first channel's opening and negotiation with sensible defaults for raw tests (64 KiB
/// blocks, clear mode: data frames stay plain blocks, control frames are still authenticated).
Hello make_hello(xdfs::Mode mode, const std::string& path, std::uint32_t n, std::uint64_t file_size = 0);

/// The header of an upload's data frame (xFTSMU) of `length` bytes at `offset`.
xdfs::wire::FrameHeader upload_block(std::uint64_t offset, std::uint32_t length);
/// The header of a sender's EOFR (no digest) saying the file ends at `offset`.
xdfs::wire::FrameHeader eofr_header(std::uint64_t offset);

}  // namespace xt

namespace xt {

/// A man in the middle on loopback: forwards each connection to the server frame by frame, in
/// both directions, and lets a test rewrite a channel's opening, tamper with any protected
/// frame, and see every byte that crossed.
class Relay {
public:
  enum class Dir { up, down };  ///< client to server, server to client
  enum class Verdict { pass, drop, duplicate, flip_payload_bit, flip_header_bit, swap_with_next, cut };
  /// A protected frame (one after its connection's handshake): which way it goes, which
  /// connection (0 for the first accepted), the frame, and its place among that connection's
  /// data frames in that direction (SIZE_MAX for a control frame).
  struct Seen {
    Dir dir;
    std::size_t conn;
    const xdfs::wire::FrameHeader& header;
    std::size_t data_index;
  };
  using Hook = std::function<Verdict(const Seen& f)>;

  Relay(std::uint16_t target, xdfs::xsec::Protect mode);
  ~Relay();
  std::uint16_t port() const { return port_; }
  std::function<void(std::vector<std::uint8_t>& opening)> rewrite_opening;
  /// Rewrites the client's clear handshake frames (nth: 0 for Noise message 1 or a join's
  /// proof, 1 for message 3), header and payload.
  std::function<void(std::size_t nth, std::vector<std::uint8_t>& frame)> rewrite_client_handshake;
  Hook hook;
  /// Every byte that went one way so far, all connections in arrival order.
  std::vector<std::uint8_t> bytes(Dir d);

private:
  void serve(int client, std::size_t conn);
  void pump(Dir dir, std::size_t conn, int from, int to, bool join);
  void record(Dir d, const std::uint8_t* p, std::size_t n);
  int listen_fd_ = -1;
  std::uint16_t port_ = 0;
  std::uint16_t target_;
  xdfs::xsec::Protect mode_;
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<std::thread> workers_;
  std::vector<int> fds_;
  std::vector<std::uint8_t> up_, down_;
  std::atomic<bool> stop_{false};
};

}  // namespace xt
