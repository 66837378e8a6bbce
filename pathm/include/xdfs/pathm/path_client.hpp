// xPathM on the client: the engine that sends a path operation's requests over a session's n
// channels, many outstanding on every channel, matches replies by request id, and copies whole
// trees. RemoteFs (xdfs/remote_fs.hpp) gives it a session; its calls are the API.
//
// Batches of files go to a bounded WorkPool, never the network thread; the request bytes
// outstanding are bounded by a window.
#pragma once

#include <boost/asio/async_result.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "xdfs/budget.hpp"
#include "xdfs/completion.hpp"
#include "xdfs/pathm/fsops.hpp"
#include "xdfs/pathm/messages.hpp"
#include "xdfs/pathm/pool.hpp"
#include "xdfs/xdsi.hpp"
#include "xdfs/error.hpp"
#include "xdfs/pathm/buffer.hpp"

namespace xdfs::pathm {

namespace asio = boost::asio;
using xdsi::ChannelList;

/// A tree copy's progress as it goes: what is copied, and of how much as far as known yet.
struct TreeProgress {
  std::uint64_t files = 0;        ///< files copied
  std::uint64_t bytes = 0;        ///< file bytes copied (of files whole or still on the way)
  std::uint64_t files_total = 0;  ///< files to copy, as far as known
  std::uint64_t bytes_total = 0;  ///< their bytes
  /// The totals are whole: the local walk (upload) or the server's listing (download) is in,
  /// and with sync what is up to date is left out. Before, they only grow as entries come.
  bool totals_final = false;
};

struct TreeOptions {
  bool sync = false;       ///< skip files whose size and mtime match at the destination
  bool checksum = false;   ///< with sync: compare content (SHA-256) instead of mtime
  bool follow = false;     ///< copy what symlinks point to instead of the links
  bool fsync = false;      ///< fdatasync each file before it is renamed into place (download)
  unsigned workers = 4;    ///< local threads for reading (upload) or writing (download) files
  std::size_t batch_bytes = 1u << 20;  ///< file bytes per batch of small files
  std::size_t window = 0;  ///< request bytes outstanding; 0: 8 blocks per channel, at least 32 MiB
  /// Memory a copy may hold for the server's listing of the tree (names and attributes);
  /// a listing beyond it fails the copy with limit_exceeded. 0: no bound.
  std::size_t max_listing = std::size_t(2) << 30;
  /// A tree copy over a session (pathm::upload_tree/download_tree with a file copier, as
  /// xdfs::upload_tree gives): files of at least this many bytes travel as file transfers of
  /// their own (xFTSM: blocks sealed and written on disk threads) instead of path-mode chunks.
  /// 0: every file goes in path mode.
  std::uint64_t large_file = std::uint64_t(64) << 20;
  /// Called on the thread running the copy as entries are listed and as files move (for each
  /// batch or chunk answered): keep it cheap.
  std::function<void(const TreeProgress&)> progress;
};

/// What a tree copy leaves to its caller when its large files travel another way (file
/// transfers on the same session, after this path operation): those files, and the attributes
/// of the directories, which must be set after the files are in place.
struct LargeFiles {
  std::uint64_t threshold = 0;  ///< in: files of at least this many bytes are left out (0: none)
  std::vector<Entry> files;     ///< out: those files (paths relative to the tree, as listed)
  std::vector<Entry> dirs;      ///< out, when files is not empty: the directories, attributes not set yet
  std::shared_ptr<files::Made> made;  ///< out (download): what this copy made here
  /// out: the files and bytes the copy's progress counts against (these files among them).
  std::uint64_t files_total = 0, bytes_total = 0;
};

/// One entry of a tree that could not be copied.
struct TreeFailure {
  std::string path;  ///< relative to the tree
  errc code = errc::ok;
  std::string message;
  bool remote = false;  ///< the server hit it (else this side)
};

struct TreeResult {
  std::uint64_t files = 0, directories = 0, symlinks = 0, bytes = 0;  ///< copied
  std::uint64_t skipped = 0;  ///< already up to date (sync), or neither file, directory nor symlink
  std::uint64_t requests = 0;
  std::uint64_t swept = 0;  ///< download: temporary files of an earlier, killed download removed
  /// Of files and bytes: those that went as file transfers of their own (TreeOptions::large_file),
  /// and the seconds those transfers took.
  std::uint64_t large_files = 0, large_bytes = 0;
  double large_seconds = 0;
  std::vector<TreeFailure> failures;  ///< entries not copied (the copy went on without them)
  /// What ended the session, when something did (the copy stopped there; a new session could go
  /// on): the failure of the file it was copying, or of the end of a path operation.
  std::optional<TreeFailure> session_failure;
};

/// A tree copy that finished with entries it could not copy (as rsync, it copies everything
/// else first). result() holds what was copied and every failure; a failure of the session
/// itself is an xdfs::Error instead.
class TreeError : public Error {
public:
  explicit TreeError(TreeResult r);
  const TreeResult& result() const noexcept { return result_; }

private:
  TreeResult result_;
};

enum class PathEvent : std::uint8_t;
class PathMachine;

/// Sends path requests over the channels of an accepted path session. Calls block the calling
/// thread, which runs the session's io_context meanwhile. Failures throw xdfs::Error; a tree copy
/// that could not copy some entries copies all the others first, then throws TreeError.
class PathClient {
public:
  PathClient(asio::io_context& io, ChannelList& channels, std::uint32_t block_size, const std::atomic<bool>* cancel,
         std::chrono::milliseconds idle_timeout);
  ~PathClient();

  Entry stat(const std::string& path);
  /// Calls chunk() with each chunk of the listing as it arrives; returns the number of chunks.
  std::size_t list(const std::string& path, bool recursive, const std::function<void(std::vector<Entry>&)>& chunk);
  void mkdir(const std::string& path, bool parents);
  void remove(const std::string& path, bool recursive);
  void rename(const std::string& from, const std::string& to);
  /// SHA-256 (hex) of a remote file or range.
  std::string checksum(const std::string& path, std::uint64_t offset = 0, std::uint64_t length = 0);
  /// The whole file's manifest digest for a block size, in hex: what a transfer of it with that
  /// block size reports (TransferResult::digest).
  std::string manifest_digest(const std::string& path, std::uint32_t block_size);
  /// Sends a put request as is (tests use it to check what the server refuses).
  void put(std::vector<Entry> entries);

  /// Asynchronous forms of the single-request calls, for any Asio completion token; each
  /// completes with std::exception_ptr (the xdfs::Error the blocking call would throw) and its
  /// result, through the handler's executor (by default on the thread that runs the session's
  /// loop). They return at once, from any thread, and start on the loop; many may be
  /// outstanding at once, spread over the channels. The blocking calls are these with the
  /// calling thread running the loop. A caller that runs the loop itself gives its RemoteFs
  /// SessionOptions::keep_alive = 0 (the keep-alive thread runs the loop between blocking calls),
  /// and runs it until its completions are in (run_one, or stop()): while the operation is
  /// open, a read waits on every channel, so the loop never runs out of work. A completion that
  /// throws ends the path operation (errc::internal), as any handler of the client does.
  template <class Token>
  auto async_stat(std::string path, Token&& token) {
    return initiate<Entry>(std::forward<Token>(token), [path = std::move(path)](PathClient& c, Completion<Entry> done) {
      c.start_stat(path, std::move(done));
    });
  }
  template <class Token>
  auto async_mkdir(std::string path, bool parents, Token&& token) {
    return initiate<>(std::forward<Token>(token), [r = request(Op::mkdir, std::move(path), parents)](
                                                      PathClient& c, Completion<> done) { c.start_plain(r, std::move(done)); });
  }
  template <class Token>
  auto async_remove(std::string path, bool recursive, Token&& token) {
    return initiate<>(std::forward<Token>(token), [r = request(Op::remove, std::move(path), recursive)](
                                                      PathClient& c, Completion<> done) { c.start_plain(r, std::move(done)); });
  }
  template <class Token>
  auto async_rename(std::string from, std::string to, Token&& token) {
    Request r = request(Op::rename, std::move(from), false);
    r.to = std::move(to);
    return initiate<>(std::forward<Token>(token),
                      [r = std::move(r)](PathClient& c, Completion<> done) { c.start_plain(r, std::move(done)); });
  }
  /// Calls chunk() (on the loop) with each chunk of the listing as it arrives; completes with the
  /// number of chunks.
  template <class Token>
  auto async_list(std::string path, bool recursive, std::function<void(std::vector<Entry>&)> chunk, Token&& token) {
    return initiate<std::size_t>(std::forward<Token>(token),
                                 [path = std::move(path), recursive, chunk = std::move(chunk)](
                                     PathClient& c, Completion<std::size_t> done) { c.start_list(path, recursive, chunk, std::move(done)); });
  }
  /// SHA-256 (hex) of a remote file or range.
  template <class Token>
  auto async_checksum(std::string path, std::uint64_t offset, std::uint64_t length, Token&& token) {
    Request r = request(Op::checksum, std::move(path), false);
    r.offset = offset;
    r.length = length;
    return initiate<std::string>(std::forward<Token>(token), [r = std::move(r)](PathClient& c, Completion<std::string> done) {
      c.start_checksum(r, std::move(done));
    });
  }

  /// The tree at local (a directory) becomes remote; remote is made if missing.
  /// With `large`: the files of at least large->threshold bytes are left out (in large->files)
  /// and so are the directories' attributes if any file was (large->dirs).
  TreeResult upload_tree(const std::string& local, const std::string& remote, const TreeOptions& o,
                         LargeFiles* large = nullptr);
  /// The tree at remote becomes local; local is made if missing. `large` as for upload_tree.
  TreeResult download_tree(const std::string& remote, const std::string& local, const TreeOptions& o,
                           LargeFiles* large = nullptr);
  /// Sets the mtimes and modes of entries under remote (paths relative to it), as a tree upload
  /// does at its end; an entry that fails is added to r's failures.
  void set_attrs(const std::string& remote, const std::vector<Entry>& entries, TreeResult& r);

  /// Ends the path operation: EOFR on every channel, then waits for the server's on every
  /// channel. True if it ended cleanly (the channels are ready for the session's next
  /// operation); false if the session failed (its channels are closed or closing).
  bool close();
  /// Tells the server that an idle session is still wanted (a NOOP frame), so that its idle
  /// timeout does not end it. Does nothing while a call is running or after the session ended.
  /// Safe from another thread: RemoteFs calls it on a timer.
  void keep_alive();
  /// Whether the server reported the last error.
  bool remote_error() const noexcept { return remote_; }
  /// The failure that ended the operation, if one did (code, words, channel, whose).
  std::optional<Failure> failure() const;

private:
  using OnReply = std::function<void(Reply&, std::shared_ptr<Buffer>)>;
  static Request request(Op op, std::string path, bool recursive) {
    Request r;
    r.op = op;
    r.path = std::move(path);
    r.recursive = recursive;
    return r;
  }
  /// An async_ call: its completion wrapped for the token, started on the loop.
  template <class... Result, class Token, class Start>
  auto initiate(Token&& token, Start start) {
    return boost::asio::async_initiate<Token, void(std::exception_ptr, Result...)>(
        [this](auto handler, Start s) {
          auto done = detail::completion<Result...>(std::move(handler), io_.get_executor());
          boost::asio::dispatch(io_, [this, s = std::move(s), done]() mutable { s(*this, std::move(done)); });
        },
        token, std::move(start));
  }
  /// Sends r and completes `done` with its reply (or the failure): the one way a single-request
  /// call runs, blocking or not. Returns the request's id.
  std::uint64_t start_call(Request r, Completion<Reply> done);
  void start_stat(const std::string& path, Completion<Entry> done);
  void start_plain(const Request& r, Completion<> done);
  void start_checksum(const Request& r, Completion<std::string> done);
  using Chunk = std::function<void(std::vector<Entry>&)>;
  std::uint64_t start_list(const std::string& path, bool recursive, Chunk chunk, Completion<std::size_t> done);
  /// Why no call can start (the operation failed or ended), or null.
  std::exception_ptr ended() const;
  /// A blocking call: runs the loop until `done`; if the operation fails first, forgets the
  /// call `id` (its completion refers to the caller's frame) and throws.
  void wait_for(std::uint64_t id, const bool& done);
  /// Completes every async call still waiting with the operation's failure.
  void fail_calls();
  /// While calls wait on the caller's loop: the user's cancel and the idle timeout.
  void watch_calls();
  /// A request that awaits its reply. Its handler runs once per reply and may refer to the
  /// caller's locals: only a listing (`many`) has more than one reply, and the request is
  /// forgotten at its final reply, so no handler can run after its caller has returned.
  struct Pending {
    std::size_t channel;
    bool many;
    OnReply on;
  };
  /// What an event carries to its action's handler: a request to send, or a reply that came.
  struct Work {
    std::uint64_t id = 0;
    Encoded* request = nullptr;
    OnReply* on_reply = nullptr;
    bool many = false;
    xdsi::Channel* ch = nullptr;
    std::shared_ptr<Buffer> buf;
  };
  /// Feeds e to the table and runs the action it answers: one handler per action.
  void on(PathEvent e, Work& w);
  /// send_request: on the channel with the fewest requests outstanding.
  void send_request(Work& w);
  /// deliver_reply: to the handler of the request it answers.
  void deliver_reply(Work& w);
  /// send_eofr: EOFR on every channel.
  void send_eofr();
  void read_loop(xdsi::Channel& ch);
  void read_reply_in_parts(xdsi::Channel& ch, std::shared_ptr<Buffer> buf, std::size_t have, std::size_t total);
  void finish_reply(xdsi::Channel& ch, std::shared_ptr<Buffer> buf, const xdsi::ErrorCode& ec);
  void send(std::uint64_t id, Encoded e, OnReply on, bool many = false);
  std::uint64_t new_id() noexcept { return next_id_++; }
  Reply call(Request r);
  void wait(const std::function<bool()>& done);
  void fail(errc code, const std::string& message, bool remote);
  /// The failure event ev of the table, then abort: the server is told unless `tell` is false.
  void fail_as(PathEvent ev, errc code, const std::string& message, bool remote, bool tell);
  /// A failure of a channel (as XDSI names it): the server is not told when it is gone.
  void fail(const Failure& f);
  void check() const;
  std::string remote_join(const std::string& base, const std::string& rel) const;
  std::vector<bool> same_content(int local_root, const std::string& remote, const std::vector<Entry>& files,
                                 const std::vector<std::size_t>& which);
  /// Sends entries' attributes (or puts entries without bytes) in batches; `failed(k)` for each
  /// entry k the server could not take. Returns at once; `waiting` counts the batches out.
  void put_meta(Op op, const std::string& remote, const std::vector<Entry>& v, std::size_t& waiting,
                const std::function<void(std::size_t, const Entry&)>& failed);
  void keep_changed(std::vector<Entry>& v, bool files, const TreeOptions& o, int local_root, const std::string& remote,
                    const std::function<Entry(const Entry&)>& at_destination, std::uint64_t& skipped);

  asio::io_context& io_;
  ChannelList& channels_;
  std::uint32_t block_size_;
  const std::atomic<bool>* cancel_;
  std::chrono::milliseconds idle_timeout_;
  std::unordered_map<std::uint64_t, Pending> pending_;
  std::vector<std::size_t> outstanding_;  // per channel
  std::uint64_t next_id_ = 1;
  std::uint64_t requests_ = 0;
  errc code_ = errc::ok;
  std::string message_;
  bool remote_ = false;
  std::optional<ChannelIndex> channel_;  // where the failure happened, when on a channel
  std::unique_ptr<PathMachine> machine_;  // the client's table (xdfs/detail/path_fsm.hpp)
  std::size_t eofr_unsent_ = 0;  // our EOFRs not written yet
  bool eofr_lost_ = false;  // one of our EOFRs failed to leave: the operation did not end cleanly
  std::vector<bool> eofr_;  // per channel: the server's EOFR arrived
  std::size_t eofrs_ = 0;
  std::chrono::steady_clock::time_point last_;
  std::recursive_mutex call_mu_;  // one call at a time (trees call stat, list and mkdir inside)
  std::unordered_map<std::uint64_t, Completion<Reply>> calls_;  // single-request calls waiting
  asio::steady_timer watch_;  // watch_calls()
  bool watching_ = false;
};

}  // namespace xdfs::pathm
