// xPathM on the server: the engine that answers a path operation's requests on a session's n
// channels, many outstanding on every channel. Not API: the server's path mode
// (xdfs/pathm/server_mode.hpp) runs it.
//
// It runs on the session's network thread and does no file-system work there: requests go to a
// bounded WorkPool, and what a worker produces comes back to the network thread to be sent. It
// stops reading a channel while its workers hold more than their share of request bytes.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "xdfs/budget.hpp"
#include "xdfs/detail/path_fsm.hpp"
#include "xdfs/pathm/fsops.hpp"
#include "xdfs/pathm/messages.hpp"
#include "xdfs/pathm/pool.hpp"
#include "xdfs/metrics.hpp"
#include "xdfs/xdsi.hpp"
#include "xdfs/pathm/buffer.hpp"

namespace xdfs::pathm {

namespace asio = boost::asio;
using xdsi::ChannelList;

struct ServerParams {
  std::uint32_t block_size = 1 << 20;
  unsigned workers = 4;
  bool read_only = false;
  bool fsync = false;
  std::string tag;  ///< names temporary files (the session id)
  std::chrono::milliseconds idle_timeout{60000};
  /// The server's memory budget: request and reply bytes are reserved in it before they are
  /// allocated (null: no budget).
  MemoryBudget* budget = nullptr;
  /// Largest file a put may create (0: what the file system has free).
  std::uint64_t max_file_size = 0;
  /// What the session's operations made (null: this operation's own).
  std::shared_ptr<files::Made> made;
  /// Server-wide counters: each request counts by its kind (null: none kept).
  Metrics* metrics = nullptr;
};

/// Serves path requests on a root directory until the client ends the operation (EOFR on every
/// channel, answered with EOFR on every channel once every request is answered).
class PathServer {
public:
  /// done(ok) when the operation ended cleanly (the channels are ready for the session's next),
  /// done(code) on the first failure (the peer was told; the channels close).
  using Done = std::function<void(errc, const std::string&, bool from_peer)>;
  PathServer(asio::io_context& io, ChannelList& channels, int root, const ServerParams& p, Done done);
  ~PathServer();
  void start();
  void abort(errc code, const std::string& message);
  std::uint64_t bytes() const noexcept { return bytes_.load(); }
  std::uint64_t requests() const noexcept { return requests_; }

private:
  struct Shared;
  using Held = std::shared_ptr<Reservation>;
  /// What a request's arrival carries to its action's handler.
  struct Arrived {
    xdsi::Channel* ch = nullptr;
    std::shared_ptr<Buffer> buf;
    Held held;
  };
  /// Feeds e to the table and runs the action it answers: one handler per action.
  void on(PathEvent e, const Arrived& w);
  void on(PathEvent e) { on(e, Arrived()); }
  /// serve: the watchdog, and every channel read.
  void serve();
  /// execute: the request goes to a worker; its channel reads on.
  void execute_later(const Arrived& w);
  /// send_eofr: the workers stop, unfinished files go, EOFR on every channel.
  void send_eofr();
  /// finish: the operation ended on every channel.
  void finish();
  void channel_failed(xdsi::Channel& ch, const xdsi::ErrorCode& ec);
  void read_loop(xdsi::Channel& ch);
  /// A request's header arrived: read its payload now if the session's bound and the server's
  /// memory allow it, else park the channel (it is not read until they do).
  void admit(xdsi::Channel& ch, const wire::FrameHeader& h);
  void execute(xdsi::Channel* ch, std::shared_ptr<Buffer> buf, Held held);
  void answer(xdsi::Channel* ch, std::shared_ptr<Buffer>& buf, Held& held);
  void send_reply(xdsi::Channel* ch, Encoded e, std::function<void()> sent = {});
  /// abort, with the failure event ev (the table's row to failed).
  void fail(errc code, const std::string& message, bool from_peer, bool tell, PathEvent ev = PathEvent::local_error);
  void resume();
  /// all_answered, once the client ended on every channel and every request has left.
  void maybe_end();
  void arm_watchdog();
  // Requests read but not answered yet: a few per worker keep them busy; more would only hold
  // memory (a get may answer with two blocks).
  std::size_t max_busy() const noexcept { return 4u * p_.workers; }

  struct Parked {
    xdsi::Channel* ch;
    wire::FrameHeader h;
  };

  asio::io_context& io_;
  ChannelList& channels_;
  int root_;
  ServerParams p_;
  Done done_;
  TreeWriter writer_;
  std::shared_ptr<Shared> shared_;
  std::vector<Parked> parked_;  // channels whose next request waits for room (its header is read)
  std::size_t inflight_ = 0;  // bytes of requests not answered yet, and of replies not sent yet
  std::size_t busy_ = 0;      // requests a worker holds
  std::size_t sending_ = 0;   // replies handed to a channel and not written out yet
  std::size_t limit_;
  std::atomic<std::uint64_t> bytes_{0};
  std::uint64_t requests_ = 0;
  asio::steady_timer watchdog_;
  asio::steady_timer linger_;
  asio::steady_timer retry_;   // memory was short: parked requests try again
  bool retry_armed_ = false;
  std::chrono::steady_clock::time_point last_;
  PathMachine machine_{PathSide::server};
  std::vector<bool> eofr_ = std::vector<bool>(channels_.size(), false);  // per channel: the client ended there
  std::size_t eofrs_ = 0;
  WorkPool pool_;  // last: joined first
};

}  // namespace xdfs::pathm
