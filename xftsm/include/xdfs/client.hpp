// The xDFS client API: move one file to or from an xdfsd over n parallel channels.
//
//   xdfs::TransferOptions opt;
//   opt.channels = 4;
//   auto r = xdfs::upload("big.iso", {"server", 7721}, "incoming/big.iso", opt);
//
// Each call runs one session: its network thread is the calling thread, plus one disk thread.
// Failures throw xdfs::Error, whose code() says what went wrong and whose what() is one line.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "xdfs/error.hpp"
#include "xdfs/pathm/engine.hpp"
#include "xdfs/xsec.hpp"

namespace xdfs {

struct Endpoint {
  std::string host = "127.0.0.1";
  std::uint16_t port = 7721;
};

struct Progress {
  std::uint64_t bytes = 0;   ///< bytes the receiver has written
  std::uint64_t total = 0;   ///< bytes in the file
  double seconds = 0;        ///< since the channels were accepted
};

struct TransferOptions {
  unsigned channels = 1;                 ///< n parallel TCP channels
  std::uint32_t block_size = 1u << 20;   ///< bytes per block
  std::uint32_t tcp_window = 0;          ///< SO_SNDBUF/SO_RCVBUF; 0 = kernel autotuning
  std::size_t ring_bytes = 32u << 20;    ///< pool between network and disk
  std::chrono::milliseconds connect_timeout{15000};  ///< connect + negotiation
  std::chrono::milliseconds idle_timeout{60000};     ///< no progress this long fails the transfer
  /// RemoteFs: while no call runs, a keep-alive this often, so that the server's idle timeout
  /// (xdfsd --idle-timeout, 60 s by default) does not end the session; 0 = none.
  std::chrono::milliseconds keep_alive{20000};
  bool fsync = false;                    ///< download: fdatasync before renaming into place
  /// Memory-to-memory benchmark mode: no disk at either end. Upload sends memory_size zero
  /// bytes that the server discards; download receives memory_size bytes the server makes up,
  /// and discards them. The local path is ignored. The server must allow it.
  bool memory = false;
  std::uint64_t memory_size = 0;
  /// Called on the network thread every progress_interval and once at the end.
  std::function<void(const Progress&)> progress;
  std::chrono::milliseconds progress_interval{200};
  /// xSec: how frames are protected (every channel is authenticated in every mode).
  xsec::Protect protect = xsec::Protect::private_;
  /// This client's private key; empty: <config>/id_x25519, made on first use (mode 0600).
  /// <config> is $XDFS_CONFIG_DIR, else $XDG_CONFIG_HOME/xdfs, else ~/.config/xdfs.
  std::string identity_file;
  /// Pinned server keys; empty: <config>/known_hosts.
  std::string known_hosts_file;
  /// Refuse a server whose key is not pinned yet (default: pin it on first use, with a notice).
  bool strict_host_key = false;
  /// One-line notices for the user (a new key made, a server key pinned).
  std::function<void(const std::string&)> notice;
  /// Set to true from any thread (a signal handler too) to cancel; partial files are removed.
  const std::atomic<bool>* cancel = nullptr;
};

struct TransferResult {
  std::uint64_t bytes = 0;
  double seconds = 0;          ///< from the first connect to the receiver's confirmation
  unsigned channels = 0;
  double setup_seconds = 0;    ///< of those, until all n channels were secured and accepted
};

/// Thrown by upload/download; remote() tells whether the server reported the error.
class TransferError : public Error {
public:
  TransferError(errc code, const std::string& context, bool remote) : Error(code, context), remote_(remote) {}
  bool remote() const noexcept { return remote_; }

private:
  bool remote_;
};

/// Sends the regular file `local` to `remote_path` (relative to the server's root). The server
/// writes it under a temporary name and renames it into place only when it is whole.
TransferResult upload(const std::string& local, const Endpoint& server, const std::string& remote_path,
                      const TransferOptions& options = {});

/// Fetches `remote_path` into `local`. A regular destination is written under a temporary name
/// and renamed into place when whole; an existing directory receives the remote file's name;
/// a non-regular destination (/dev/null, a FIFO) or "-" (standard output) is written in place.
TransferResult download(const Endpoint& server, const std::string& remote_path, const std::string& local,
                        const TransferOptions& options = {});

/// A path-mode session (xPathM): remote file operations and whole directory trees over n
/// channels, many requests outstanding at once.
///
///   xdfs::RemoteFs fs({"server", 7721}, opt);
///   fs->mkdir("incoming/run7", true);
///   fs->upload_tree("results/", "incoming/run7", {});
///   fs.close();
///
/// The constructor connects and authenticates; every call then blocks until its answer (or
/// throws xdfs::Error). Paths are relative to the server's root. Calls are serialized; between
/// them a background thread sends keep-alives (TransferOptions::keep_alive), so an idle RemoteFs
/// stays connected until close().
class RemoteFs {
public:
  explicit RemoteFs(const Endpoint& server, const TransferOptions& options = {});
  ~RemoteFs();
  RemoteFs(const RemoteFs&) = delete;
  RemoteFs& operator=(const RemoteFs&) = delete;
  pathm::Client* operator->();
  pathm::Client& client();
  /// Ends the session cleanly (also done by the destructor).
  void close();

private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace xdfs
