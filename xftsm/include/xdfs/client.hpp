// The xDFS client API for files (xFTSM): move a file to or from an xdfsd over n parallel channels.
//
//   xdfs::TransferOptions opt;
//   opt.channels = 4;
//   auto r = xdfs::upload("big.iso", {"server", 7721}, "incoming/big.iso", opt);
//
// or several over one session, whose channels are set up once:
//
//   xdfs::Session s({"server", 7721}, opt);
//   for (auto& f : files) xdfs::upload(s, f, "incoming/", opt);
//   s.close();
//
// Each call's network thread is the calling thread, plus one disk thread; async_upload and
// async_download run on the thread that runs the session's io_context instead. Failures throw
// xdfs::TransferError, whose code() says what went wrong and whose what() is one line.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "xdfs/error.hpp"
#include "xdfs/session.hpp"

namespace xdfs {

struct Progress {
  std::uint64_t bytes = 0;   ///< bytes the receiver has written
  std::uint64_t total = 0;   ///< bytes in the file
  double seconds = 0;        ///< since the channels were accepted
  bool stream = false;       ///< an upload of a stream: total is known (and set) only at its end
};

/// A file transfer's options: the session's (SessionOptions), then the transfer's own.
struct TransferOptions : SessionOptions {
  std::size_t ring_bytes = 32u << 20;    ///< pool between network and disk
  bool fsync = false;                    ///< download: fdatasync before renaming into place
  /// Memory-to-memory benchmark mode (SessionOptions::memory): the size to move. Upload sends
  /// memory_size zero bytes that the server discards; download receives memory_size bytes the
  /// server makes up, and discards them. The local path is ignored.
  std::uint64_t memory_size = 0;
  /// Bytes per second over all channels together (0: no limit): the sender waits before each
  /// block, the receiver before it reads each one.
  std::uint64_t limit_rate = 0;
  /// Downloads into a regular file, with the manifest (verify): written as ".NAME.xdfs-partial"
  /// with a resume record beside it, kept when the transfer is interrupted (the peer or the
  /// link lost, a timeout; not a cancel, a digest that differs or a source that changed), and
  /// continued by the next download of the same file to the same name. Uploads resume at the
  /// server's side likewise (xdfsd --partial-expiry). false: every transfer starts at byte 0.
  bool resume = true;
  /// Upload: feed the relay registered at the server under this ticket (32 bytes; empty: an
  /// ordinary upload). The server takes the path, size and mtime from the relay.
  std::vector<std::uint8_t> relay_ticket;
  /// Upload of a file that is still being written (an xdfsd forwarding its relay's copy): only
  /// bytes below *available are read, the rest waited for. relay_size and relay_mtime_ns then
  /// stand for the file's own (the relay's size, and the source's mtime).
  const std::atomic<std::uint64_t>* available = nullptr;
  std::uint64_t relay_size = 0;
  std::int64_t relay_mtime_ns = 0;
  /// With `available`: the digests the blocks came with, sent instead of ones made here
  /// (piod::Source::digests), and the test hook that damages what is read (Source::test_corrupt).
  const piod::DigestLog* relay_digests = nullptr;
  std::uint8_t relay_test_corrupt = 0;
  /// Called on the network thread every progress_interval and once at the end.
  std::function<void(const Progress&)> progress;
  std::chrono::milliseconds progress_interval{200};
};

struct TransferResult {
  std::uint64_t bytes = 0;
  double seconds = 0;          ///< from the first connect (or the negotiation) to the receiver's confirmation
  unsigned channels = 0;
  double setup_seconds = 0;    ///< of those, until all n channels were secured and accepted the transfer
  /// The whole-file digest both ends computed and found equal (docs/manifest.md), in hex, for
  /// the session's block size; empty when the session does not verify (SessionOptions::verify).
  std::string digest;
  /// A resumed transfer: the bytes the receiver had already (verified by the digest, not
  /// sent again); bytes - resumed_from crossed the network this time.
  std::uint64_t resumed_from = 0;
};

/// Sends the regular file `local` to `remote_path` (relative to the server's root) in a
/// session of its own. The server writes it under a temporary name and renames it into place
/// only when it is whole. `local` may also be a pipe or FIFO, or "-" for standard input: a
/// stream, sent until it ends (its size and digest known then; never resumed), to a
/// `remote_path` that names the file.
TransferResult upload(const std::string& local, const Endpoint& server, const std::string& remote_path,
                      const TransferOptions& options = {});

/// Fetches `remote_path` into `local` in a session of its own. A regular destination is written
/// under a temporary name and renamed into place when whole; an existing directory receives the
/// remote file's name; a non-regular destination (/dev/null, a FIFO) or "-" (standard output) is
/// written in place.
TransferResult download(const Endpoint& server, const std::string& remote_path, const std::string& local,
                        const TransferOptions& options = {});

/// The same as one operation of an open session (the first one opens it): the channels stay
/// for the session's next operation. The session's options apply; of `options`, only the
/// transfer's own fields (ring, fsync, memory size, progress) do. A refusal of this transfer
/// (no such file, ...) throws and leaves the session usable; other failures end it.
TransferResult upload(Session& session, const std::string& local, const std::string& remote_path,
                      const TransferOptions& options = {});
TransferResult download(Session& session, const std::string& remote_path, const std::string& local,
                        const TransferOptions& options = {});

namespace detail {
void start_upload(Session& session, const std::string& local, const std::string& remote_path,
                  const TransferOptions& options, Completion<TransferResult> done);
void start_download(Session& session, const std::string& remote_path, const std::string& local,
                    const TransferOptions& options, Completion<TransferResult> done);
}  // namespace detail

/// The asynchronous forms of upload(session, ...) and download(session, ...), for any Asio
/// completion token (a callback, use_future, use_awaitable, ...); the completion signature is
/// void(std::exception_ptr, TransferResult), the exception what the blocking form would throw.
/// They return at once, from any thread: the transfer starts and runs on the thread that runs
/// session.io(), and its completion runs through the handler's executor (by default on that
/// thread). One operation at a time per
/// session: the next may start from the completion. The blocking forms are these, with the
/// calling thread running the loop until the completion.
///
///   xdfs::async_upload(s, "a.iso", "in/", opt, [&](std::exception_ptr e, xdfs::TransferResult r) {
///     if (!e) xdfs::async_upload(s, "b.iso", "in/", opt, next);
///   });
///   s.io().run();
namespace detail {
/// async_upload and async_download: `start` (start_upload or start_download) on the session's loop.
template <class Token, class Start>
auto async_transfer(Session& session, Start start, std::string from, std::string to, TransferOptions options,
                    Token&& token) {
  return boost::asio::async_initiate<Token, void(std::exception_ptr, TransferResult)>(
      [&session, start](auto handler, std::string f, std::string t, TransferOptions o) {
        auto done = completion<TransferResult>(std::move(handler), session.io().get_executor());
        // Started on the session's loop, whichever thread asks.
        boost::asio::dispatch(session.io(), [&session, start, f = std::move(f), t = std::move(t), o = std::move(o), done] {
          start(session, f, t, o, done);
        });
      },
      token, std::move(from), std::move(to), std::move(options));
}
}  // namespace detail

template <class Token>
auto async_upload(Session& session, std::string local, std::string remote_path, TransferOptions options,
                  Token&& token) {
  return detail::async_transfer(session, &detail::start_upload, std::move(local), std::move(remote_path),
                                std::move(options), std::forward<Token>(token));
}

template <class Token>
auto async_download(Session& session, std::string remote_path, std::string local, TransferOptions options,
                    Token&& token) {
  return detail::async_transfer(session, &detail::start_download, std::move(remote_path), std::move(local),
                                std::move(options), std::forward<Token>(token));
}

}  // namespace xdfs
