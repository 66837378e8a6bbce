#include "xdfs/client.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

#include <cerrno>
#include <cstring>
#include <memory>
#include <utility>

#include "xdfs/files.hpp"
#include "xdfs/types.hpp"
#include "xdfs/xsec.hpp"
#include "xdfs/detail/xftsm_fsm.hpp"
#include "xdfs/detail/xftsm_engine.hpp"

namespace xdfs {
namespace {

using namespace xftsm;
using Clock = std::chrono::steady_clock;
using xdsi::ErrorCode;

std::string basename_of(const std::string& p) {
  auto s = p;
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  auto slash = s.rfind('/');
  return slash == std::string::npos ? s : s.substr(slash + 1);
}

// One file transfer as an operation of a session: the session negotiates it, this runs the
// engine on the session's channels and loop.
//
// It completes through a Completion on the session's loop: start_upload/start_download begin it
// and return at once; the blocking calls run the loop until it is done.
class ClientTransfer final : public TransferHost, public std::enable_shared_from_this<ClientTransfer> {
public:
  ClientTransfer(Session& session, Mode mode, std::string remote, const TransferOptions& opt)
      : session_(session),
        machine_(mode == Mode::upload ? Role::client_upload : Role::client_download),
        opt_(opt),
        memory_(session.options().memory),
        ticker_(session.io()) {
    nego_.mode = mode;
    nego_.remote_path = std::move(remote);
    const auto bs = session.options().block_size;
    slots_ = static_cast<std::uint32_t>(std::max<std::size_t>(opt.ring_bytes / std::max<std::uint32_t>(bs, 1), 4));
  }

  void start_upload(const std::string& local, Completion<TransferResult> done) {
    done_ = std::move(done);
    try {
      if (memory_) {
        size_ = opt_.memory_size;
        nego_.file_size = size_;
        if (nego_.remote_path.empty() || nego_.remote_path.back() == '/') nego_.remote_path += "memory";
        memory_source_ = true;
        return begin();
      }
      // "-" is standard input (its own descriptor, so that closing it leaves the program's).
      const bool std_in = local == "-";
      // A pipe on standard input is opened afresh, so that its reads may be non-blocking (the
      // disk thread waits with poll and sees a stop) without changing the program's descriptor.
      int fd = -1;
      struct stat in {};
      if (std_in && ::fstat(STDIN_FILENO, &in) == 0 && S_ISFIFO(in.st_mode))
        fd = ::open("/proc/self/fd/0", O_RDONLY | O_CLOEXEC | O_NONBLOCK);
      if (fd < 0)
        fd = std_in ? ::fcntl(STDIN_FILENO, F_DUPFD_CLOEXEC, 3)
                    : ::open(local.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
      const std::string what = std_in ? std::string("standard input") : "'" + local + "'";
      if (fd < 0) throw TransferError(errc_from_errno(errno), what + ": " + std::strerror(errno), false);
      source_ = files::Fd(fd);
      struct stat sb {};
      if (::fstat(fd, &sb) != 0) throw TransferError(errc_from_errno(errno), "stat " + what, false);
      if (S_ISDIR(sb.st_mode)) throw TransferError(errc::is_directory, what + " is a directory", false);
      // A pipe, a FIFO, or standard input that is not a whole regular file: a stream, whose size
      // is known at its end (a FIFO without a writer yet is waited for, as cat would).
      stream_ = S_ISFIFO(sb.st_mode) || (std_in && !(S_ISREG(sb.st_mode) && ::lseek(fd, 0, SEEK_CUR) == 0));
      if (stream_) {
        nego_.open_ended = true;
      } else {
        if (!S_ISREG(sb.st_mode)) throw TransferError(errc::not_regular_file, what + " is not a regular file", false);
        size_ = opt_.available ? opt_.relay_size : static_cast<std::uint64_t>(sb.st_size);
        nego_.file_size = size_;
        nego_.source_mtime_ns = opt_.available ? opt_.relay_mtime_ns : files::mtime_ns(sb);
        nego_.fresh = !opt_.resume;
      }
      nego_.relay_ticket = opt_.relay_ticket;
      if (nego_.remote_path.empty() || nego_.remote_path.back() == '/') {
        if (std_in) throw TransferError(errc::bad_argument, "uploading standard input needs a remote file name, not a directory", false);
        nego_.remote_path += basename_of(local);
      }
    } catch (...) {
      return refuse(std::current_exception());
    }
    begin();
  }

  void start_download(const std::string& local, Completion<TransferResult> done) {
    done_ = std::move(done);
    try {
      if (memory_) {
        nego_.file_size = opt_.memory_size;
        sink_ = piod::Sink{-1, true, true};
      } else {
        prepare_sink(local);
      }
    } catch (...) {
      return refuse(std::current_exception());
    }
    nego_.window = std::uint64_t(slots_) * session_.options().block_size;
    begin();
  }

  /// Ends the transfer with an internal error (a handler threw out of the loop).
  void abort_internal(const std::string& why) {
    if (ended_) {
      // Ended, but the engine threw before its channels were closed: close them and wind up.
      if (failure_ && !winding_) {
        for (auto& ch : session_.channels())
          if (ch) ch->close();
        wind_up();
      }
      return;
    }
    if (sender_ && !sender_->finished()) return sender_->abort(errc::internal, why);
    if (receiver_ && !receiver_->finished()) return receiver_->abort(errc::internal, why);
    fail(errc::internal, why);
  }

  bool done() const noexcept { return delivered_; }
  /// Its completion will not be called (its caller has gone).
  void forget() noexcept { done_ = nullptr; }

  files::Status commit() override {
    if (pending_.active()) return pending_.commit(size_, opt_.fsync);
    return files::Status::ok();
  }

  // The engine ended: at once when it succeeded; after a failure, once its channels are closed.
  void finished(const Failure& f) override {
    end(f);
    if (!f) wind_up();
  }
  void closed() override { wind_up(); }

private:
  void prepare_sink(std::string local) {
    if (local == "-") {
      sink_ = piod::Sink{STDOUT_FILENO, false, false};
      return;
    }
    struct stat sb {};
    if (::stat(local.c_str(), &sb) == 0 && S_ISDIR(sb.st_mode)) {
      local += "/" + basename_of(nego_.remote_path);
    }
    if (::stat(local.c_str(), &sb) == 0 && !S_ISREG(sb.st_mode)) {
      if (S_ISDIR(sb.st_mode)) throw TransferError(errc::is_directory, "'" + local + "' is a directory", false);
      // /dev/null needs no writes at all.
      if (S_ISCHR(sb.st_mode) && sb.st_rdev == makedev(1, 3)) {
        sink_ = piod::Sink{-1, true, true};
        return;
      }
      // A device or FIFO is written in place, in order, and never replaced.
      int fd = ::open(local.c_str(), O_WRONLY | O_CLOEXEC | O_NOCTTY);
      if (fd < 0) throw TransferError(errc_from_errno(errno), "'" + local + "': " + std::strerror(errno), false);
      in_place_ = files::Fd(fd);
      sink_ = piod::Sink{fd, false, false};
      return;
    }
    auto [dir, name] = files::split_parent(local);
    int dfd = ::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) throw TransferError(errc_from_errno(errno), "directory '" + dir + "': " + std::strerror(errno), false);
    // Resumable: a partial copy of the same source (its record says) goes on where it was;
    // the server hears its size and mtime and sends the rest if the file is still that one.
    std::optional<files::ResumeRecord> found;
    std::string notice;
    if (auto st = files::PendingFile::open(files::Fd(dfd), name, session_.tag(), opt_.resume && session_.manifest(),
                                           pending_, found, notice);
        !st)
      throw TransferError(st.code, st.message, false);
    if (pending_.resumable()) {
      resume_source_ = source_id();
      if (found && found->key.source == resume_source_ && found->key.block_size == session_.options().block_size) {
        nego_.resume_offset = resume_point(found->prefix, found->key.size, found->key.block_size);
        nego_.file_size = found->key.size;
        nego_.source_mtime_ns = found->key.mtime_ns;
      } else if (found) {
        notice = "'" + pending_.temp_name() + "' is a partial copy of another source: starting over";
        pending_.restart();
      }
      say(notice);
    }
    sink_ = piod::Sink{pending_.fd(), true, false};
  }

  // What a resumed download must come from: the server, the path, the block size.
  std::string source_id() const {
    const auto& e = session_.endpoint();
    return "xdfs://" + e.host + ":" + std::to_string(e.port) + "/" + nego_.remote_path;
  }

  void debug(const std::string& line) override {
    if (session_.options().debug) session_.options().debug(line);
  }
  void say(const std::string& notice) {
    if (!notice.empty() && session_.options().notice) session_.options().notice(notice);
  }

  // Nothing was started (a local file that cannot be read, ...): the completion still runs on the loop.
  void refuse(std::exception_ptr e) {
    (void)pending_.keep();
    boost::asio::post(session_.io(), [self = shared_from_this(), e] { self->deliver(e, {}); });
  }

  void begin() {
    start_ = Clock::now();
    first_ = !session_.opened();
    // The machine's way to an accepted transfer: the session does the connecting (for the
    // first operation) and the negotiation; a refusal or failure there fails the machine too.
    if (machine_.fire(TransferEvent::start) != TransferAction::connect_channels)
      return refuse(std::make_exception_ptr(TransferError(errc::internal, machine_.why(), false)));
    session_.start(nego_, [self = shared_from_this()](std::exception_ptr e, wire::NegotiationReply reply) {
      self->on_begun(e, reply);
    });
  }

  void on_begun(std::exception_ptr e, const wire::NegotiationReply& reply) {
    if (e) {
      (void)machine_.fire(TransferEvent::local_error);
      // A server that could not be reached or refused: a partial copy stays for the next try.
      (void)pending_.keep();
      return deliver(e, {});
    }
    accepted_at_ = Clock::now();
    setup_ = first_ ? session_.setup_seconds() : std::chrono::duration<double>(accepted_at_ - start_).count();
    if (!machine_.fire(TransferEvent::connected)) return fail(errc::state_violation, machine_.why());
    auto action = machine_.fire(TransferEvent::accepted);
    if (!action) return fail(errc::state_violation, machine_.why());
    try {
      start_engine(*action, reply);
      if (!ended_) tick();
    } catch (const std::exception& ex) {
      abort_internal(ex.what());
    }
  }

  // The end, on the loop: the session takes its channels back (or closes them) once what the
  // loop has queued for the engine has run; then the engine and its disk thread go, and the
  // completion runs.
  void wind_up() {
    if (winding_) return;
    winding_ = true;
    ticker_.cancel();
    boost::asio::post(session_.io(), [self = shared_from_this()] {
      self->session_.end_operation(!self->failure_);
      boost::asio::post(self->session_.io(), [self] {
        if (!self->failure_) self->digest_ = self->sender_ ? self->sender_->digest() : self->receiver_ ? self->receiver_->digest() : std::nullopt;
        if (!self->failure_ && self->stream_ && self->sender_) self->size_ = self->sender_->size();
        self->sender_.reset();
        self->receiver_.reset();
        if (self->failure_) {
          auto& f = self->failure_;
          if (f.operation.empty())
            f.operation = std::string(self->nego_.mode == Mode::upload ? "upload" : "download") + " '" +
                          self->nego_.remote_path + "'";
          return self->deliver(std::make_exception_ptr(TransferError(f)), {});
        }
        try {
          if (self->opt_.progress) self->opt_.progress(Progress{self->size_, self->size_, self->seconds_});
        } catch (...) {
          return self->deliver(std::current_exception(), {});  // the caller's own exception, as it threw it
        }
        self->deliver(nullptr, TransferResult{self->size_, self->seconds_,
                                              static_cast<unsigned>(self->session_.channels().size()), self->setup_,
                                              self->digest_ ? manifest::hex(*self->digest_) : std::string(),
                                              self->resumed_});
      });
    });
  }

  void deliver(std::exception_ptr e, TransferResult r) {
    if (delivered_) return;
    delivered_ = true;
    auto done = std::exchange(done_, nullptr);
    if (done) done(e, r);
  }

  void start_engine(TransferAction action, const wire::NegotiationReply& reply) {
    TransferParams p;
    p.block_size = session_.options().block_size;
    p.slots = slots_;
    p.idle_timeout = session_.options().idle_timeout;
    p.manifest = session_.manifest();
    p.zero_copy = session_.options().zero_copy;
    p.loopback_sendfile = session_.options().loopback_sendfile;
    if (opt_.limit_rate) {
      limit_ = std::make_unique<RateLimiter>(opt_.limit_rate);
      p.limits.push_back(limit_.get());
    }
    // A memory source seals (integrity, private) a slot's bytes as they are: a fresh pool's zeros.
    if (!memory_) p.pools = &session_.pool_cache();
    auto& io = session_.io();
    auto& channels = session_.channels();
    if (action == TransferAction::start_sending) {
      if (reply.window < p.block_size) return fail(errc::protocol_error, "server window is smaller than one block");
      // The server holds this much of the file already: it must be whole blocks before the end,
      // and with the manifest, which proves it at the end (a server that claims blocks it does
      // not have fails there, it cannot make this side skip them unnoticed).
      server_in_place_ = reply.in_place;
      if (reply.resume_offset > 0 && (!p.manifest || memory_source_ || stream_ || server_in_place_ ||
                                      reply.resume_offset % p.block_size != 0 || reply.resume_offset >= size_))
        return fail(errc::protocol_error, "the server claims " + std::to_string(reply.resume_offset) + " bytes of a " +
                                              std::to_string(size_) + "-byte file it cannot have");
      p.start_offset = resumed_ = reply.resume_offset;
      // A stream may be as long as the protocol allows; the server stops one beyond its limit.
      p.file_size = stream_ ? wire::max_file_size : size_;
      p.open_ended = stream_;
      p.window = reply.window;
      p.data_event = wire::ChannelEvent::xftsmu;
      piod::Source source{source_.get(), p.file_size, memory_source_, crypto(true)};
      source.available = opt_.available;
      source.digests = opt_.relay_digests;
      source.test_corrupt = opt_.relay_test_corrupt;
      sender_ = std::make_unique<Sender>(io, machine_, channels, *this, p, source);
      sender_->start();
    } else if (action == TransferAction::start_receiving) {
      size_ = reply.file_size;
      if (nego_.resume_offset > 0) {
        if (reply.resume_offset == 0) {
          say("the source changed since '" + pending_.temp_name() + "' began: starting over");
          pending_.restart();
        } else if (reply.resume_offset != nego_.resume_offset || reply.file_size != nego_.file_size) {
          return fail(errc::protocol_error, "the server resumes at " + std::to_string(reply.resume_offset) +
                                                " of a " + std::to_string(reply.file_size) + "-byte file; asked for " +
                                                std::to_string(nego_.resume_offset) + " of " +
                                                std::to_string(nego_.file_size));
        }
      } else if (reply.resume_offset != 0) {
        return fail(errc::protocol_error, "the server resumes a download that was not asked to resume");
      }
      p.start_offset = resumed_ = reply.resume_offset;
      if (pending_.resumable()) {
        pending_.set_key(files::ResumeKey{resume_source_, size_, reply.mtime_ns, p.block_size});
        sink_.checkpoint = &checkpoint_;
      }
      if (pending_.active())
        if (auto st = files::check_room(pending_.dir(), size_ - resumed_, "'" + pending_.final_name() + "'"); !st)
          return fail(st.code, st.message);
      p.file_size = size_;
      p.data_event = wire::ChannelEvent::xftsmd;
      sink_.opener = crypto(false);
      receiver_ = std::make_unique<Receiver>(io, machine_, channels, *this, p, sink_);
      receiver_->start();
    } else {
      fail(errc::state_violation, std::string("accepted transfer asks for ") + to_string(action));
    }
  }

  // A failure before the engine runs: the channels close (the server's side of the transfer
  // fails with them) and the session ends.
  void fail(errc code, const std::string& message) {
    (void)machine_.fire(TransferEvent::local_error);
    for (auto& ch : session_.channels())
      if (ch) ch->close();
    end(code, message, false);
    wind_up();
  }

  // The block protection of this transfer's direction (none in clear mode).
  xsec::BlockCrypto* crypto(bool client_to_server) {
    if (session_.protect() == xsec::Protect::clear) return nullptr;
    block_crypto_ = std::make_unique<xsec::BlockCrypto>(session_.protect(), session_.cipher(),
                                                        session_.data_key(client_to_server));
    return block_crypto_.get();
  }

  void end(errc code, const std::string& message, bool remote) { end(Failure(code, message, remote)); }
  void end(const Failure& f) {
    if (ended_) return;
    ended_ = true;
    failure_ = f;
    // What went was read once (a stream), or written as it came (a FIFO at the server; standard
    // output or a device here): a new attempt would repeat or lose some of it.
    failure_.once = f && (stream_ || server_in_place_ || (nego_.mode == Mode::download && !memory_ && !pending_.active()));
    seconds_ = std::chrono::duration<double>(Clock::now() - start_).count();
    if (f) settle_partial(pending_, f);
    ticker_.cancel();
  }

  void tick() {
    ticker_.expires_after(opt_.progress_interval);
    ticker_.async_wait([this, self = shared_from_this()](const ErrorCode& ec) {
      if (ec || ended_) return;
      const auto* cancel = session_.options().cancel;
      if (cancel && cancel->load()) {
        if (sender_) return sender_->abort(errc::cancelled, "cancelled by the user");
        if (receiver_) return receiver_->abort(errc::cancelled, "cancelled by the user");
        return fail(errc::cancelled, "cancelled by the user");
      }
      if (opt_.progress && (sender_ || receiver_)) {
        const std::uint64_t done = sender_ ? sender_->bytes_done() : receiver_->bytes_done();
        opt_.progress(Progress{done, size_, std::chrono::duration<double>(Clock::now() - accepted_at_).count(), stream_});
      }
      tick();
    });
  }

  Session& session_;
  Machine machine_;
  TransferOptions opt_;
  bool memory_;
  wire::Negotiation nego_;  // the session fills in its own fields and the transfer number
  std::uint32_t slots_ = 32;
  boost::asio::steady_timer ticker_;
  files::Fd source_;
  bool memory_source_ = false;
  bool stream_ = false;  // upload of a stream: its size is size_ once it ended
  bool server_in_place_ = false;  // upload the server writes as it comes (a FIFO)
  files::Fd in_place_;
  files::PendingFile pending_;
  PartialCheckpoint checkpoint_{pending_};  // the disk thread records a resumable download's progress
  std::string resume_source_;               // what the partial copy is of (source_id())
  std::uint64_t resumed_ = 0;               // bytes the receiver had already
  piod::Sink sink_;
  std::uint64_t size_ = 0;
  std::unique_ptr<xsec::BlockCrypto> block_crypto_;  // used by the disk thread: outlives the engines
  std::unique_ptr<RateLimiter> limit_;               // TransferOptions::limit_rate: outlives the engines
  std::unique_ptr<Sender> sender_;
  std::unique_ptr<Receiver> receiver_;
  Clock::time_point start_;
  Clock::time_point accepted_at_;
  bool first_ = false;      // this transfer opens the session
  double setup_ = 0;
  Completion<TransferResult> done_;
  bool ended_ = false;      // the engine (or this) ended the transfer
  bool winding_ = false;    // wind_up() ran
  bool delivered_ = false;  // the completion ran
  Failure failure_;  // how it ended (ok: it did not fail)
  std::optional<manifest::Digest> digest_;  // the whole-file digest both ends agreed on
  double seconds_ = 0;
};

// Runs the session's loop on this thread until t is done. A handler that throws out of the loop
// ends this transfer with its reason (and its partial file), not the calling program.
void run_until_done(Session& session, ClientTransfer& t) {
  auto& io = session.io();
  io.restart();
  while (!t.done()) {
    try {
      if (!io.run_one()) break;
    } catch (const std::exception& e) {
      t.abort_internal(e.what());
    } catch (...) {
      t.abort_internal("a handler threw");
    }
  }
  if (!t.done()) {
    t.abort_internal("the session's event loop stopped");
    io.restart();
    while (!t.done() && io.run_one()) {
    }
  }
}

template <class Start>
TransferResult blocking(Session& session, Mode mode, const std::string& remote, const TransferOptions& options,
                        Start start) {
  std::exception_ptr err;
  TransferResult out;
  auto t = std::make_shared<ClientTransfer>(session, mode, remote, options);
  // However this frame is left, the transfer's completion no longer refers to it.
  struct Forget {
    ClientTransfer& t;
    ~Forget() { t.forget(); }
  } forget{*t};
  start(*t, [&err, &out](std::exception_ptr e, TransferResult r) {
    err = e;
    out = r;
  });
  run_until_done(session, *t);
  if (!t->done()) throw TransferError(errc::internal, "the session's event loop stopped", false);
  if (err) std::rethrow_exception(err);
  return out;
}

}  // namespace

namespace detail {

void start_upload(Session& session, const std::string& local, const std::string& remote_path,
                  const TransferOptions& options, Completion<TransferResult> done) {
  auto t = std::make_shared<ClientTransfer>(session, Mode::upload, remote_path, options);
  t->start_upload(local, std::move(done));
}

void start_download(Session& session, const std::string& remote_path, const std::string& local,
                    const TransferOptions& options, Completion<TransferResult> done) {
  auto t = std::make_shared<ClientTransfer>(session, Mode::download, remote_path, options);
  t->start_download(local, std::move(done));
}

}  // namespace detail

TransferResult upload(Session& session, const std::string& local, const std::string& remote_path,
                      const TransferOptions& options) {
  return blocking(session, Mode::upload, remote_path, options,
                  [&](ClientTransfer& t, Completion<TransferResult> done) { t.start_upload(local, std::move(done)); });
}

TransferResult download(Session& session, const std::string& remote_path, const std::string& local,
                        const TransferOptions& options) {
  return blocking(session, Mode::download, remote_path, options,
                  [&](ClientTransfer& t, Completion<TransferResult> done) { t.start_download(local, std::move(done)); });
}

TransferResult upload(const std::string& local, const Endpoint& server, const std::string& remote_path,
                      const TransferOptions& options) {
  Session s(server, options);
  auto r = upload(s, local, remote_path, options);
  s.close();
  return r;
}

TransferResult download(const Endpoint& server, const std::string& remote_path, const std::string& local,
                        const TransferOptions& options) {
  Session s(server, options);
  auto r = download(s, remote_path, local, options);
  s.close();
  return r;
}

}  // namespace xdfs
