#include "xdfs/client.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <boost/asio/steady_timer.hpp>

#include <cerrno>
#include <cstring>
#include <memory>

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
class ClientTransfer final : public TransferHost {
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

  TransferResult upload(const std::string& local) {
    if (memory_) {
      size_ = opt_.memory_size;
      nego_.file_size = size_;
      if (nego_.remote_path.empty() || nego_.remote_path.back() == '/') nego_.remote_path += "memory";
      memory_source_ = true;
      return run();
    }
    int fd = ::open(local.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) throw TransferError(errc_from_errno(errno), "'" + local + "': " + std::strerror(errno), false);
    source_ = files::Fd(fd);
    struct stat sb {};
    if (::fstat(fd, &sb) != 0) throw TransferError(errc_from_errno(errno), "stat '" + local + "'", false);
    if (S_ISDIR(sb.st_mode)) throw TransferError(errc::is_directory, "'" + local + "' is a directory", false);
    if (!S_ISREG(sb.st_mode)) throw TransferError(errc::not_regular_file, "'" + local + "' is not a regular file", false);
    size_ = static_cast<std::uint64_t>(sb.st_size);
    nego_.file_size = size_;
    if (nego_.remote_path.empty() || nego_.remote_path.back() == '/') nego_.remote_path += basename_of(local);
    return run();
  }

  TransferResult download(const std::string& local) {
    if (memory_) {
      nego_.file_size = opt_.memory_size;
      sink_ = piod::Sink{-1, true, true};
    } else {
      prepare_sink(local);
    }
    nego_.window = std::uint64_t(slots_) * session_.options().block_size;
    return run();
  }

  files::Status commit() override {
    if (pending_.active()) return pending_.commit(size_, opt_.fsync);
    return files::Status::ok();
  }

  void finished(const Failure& f) override { end(f); }

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
    if (auto st = files::PendingFile::create(files::Fd(dfd), name, session_.tag(), pending_); !st)
      throw TransferError(st.code, st.message, false);
    sink_ = piod::Sink{pending_.fd(), true, false};
  }

  TransferResult run() {
    start_ = Clock::now();
    const bool first = !session_.opened();
    wire::NegotiationReply reply;
    // The machine's way to an accepted transfer: the session does the connecting (for the
    // first operation) and the negotiation; a refusal or failure there fails the machine too.
    if (machine_.fire(TransferEvent::start) != TransferAction::connect_channels) throw TransferError(errc::internal, machine_.why(), false);
    try {
      reply = session_.begin(nego_);
    } catch (const TransferError&) {
      (void)machine_.fire(TransferEvent::local_error);
      pending_.discard();
      throw;
    }
    accepted_at_ = Clock::now();
    const double setup = first ? session_.setup_seconds() : std::chrono::duration<double>(accepted_at_ - start_).count();
    if (!machine_.fire(TransferEvent::connected)) throw TransferError(errc::state_violation, machine_.why(), false);
    auto action = machine_.fire(TransferEvent::accepted);
    if (!action) throw TransferError(errc::state_violation, machine_.why(), false);
    try {
      auto& io = session_.io();
      io.restart();  // the negotiation ran it dry
      start_engine(*action, reply);
      tick();
      while (!ended_ && io.run_one()) {
      }
    } catch (const std::exception& e) {
      // A handler that throws ends this transfer with its reason (and its partial file), not the
      // calling program.
      if (sender_) sender_->abort(errc::internal, e.what());
      if (receiver_) receiver_->abort(errc::internal, e.what());
      end(errc::internal, e.what(), false);
    }
    if (!ended_) end(errc::internal, "the session's event loop stopped", false);
    ticker_.cancel();
    if (failure_) {
      // The engine may still be telling the server why (bounded by its linger): let it finish
      // before the engine goes.
      try {
        session_.io().restart();
        session_.io().run();
      } catch (...) {
      }
    }
    // The session takes its channels back (or closes them) while the engine still exists: what
    // the loop still holds for it runs first. Then the disk thread goes too.
    session_.end_operation(!failure_);
    sender_.reset();
    receiver_.reset();
    if (failure_) {
      if (failure_.operation.empty())
        failure_.operation = std::string(nego_.mode == Mode::upload ? "upload" : "download") + " '" + nego_.remote_path + "'";
      throw TransferError(failure_);
    }
    if (opt_.progress) opt_.progress(Progress{size_, size_, seconds_});
    return TransferResult{size_, seconds_, static_cast<unsigned>(session_.channels().size()), setup};
  }

  void start_engine(TransferAction action, const wire::NegotiationReply& reply) {
    TransferParams p;
    p.block_size = session_.options().block_size;
    p.slots = slots_;
    p.idle_timeout = session_.options().idle_timeout;
    if (!memory_) p.pools = &session_.pool_cache();  // a memory source sends a slot's bytes as they are
    auto& io = session_.io();
    auto& channels = session_.channels();
    if (action == TransferAction::start_sending) {
      if (reply.window < p.block_size) return fail(errc::protocol_error, "server window is smaller than one block");
      p.file_size = size_;
      p.window = reply.window;
      p.data_event = wire::ChannelEvent::xftsmu;
      sender_ = std::make_unique<Sender>(io, machine_, channels, *this, p,
                                         piod::Source{source_.get(), size_, memory_source_, crypto(true)});
      sender_->start();
    } else if (action == TransferAction::start_receiving) {
      size_ = reply.file_size;
      if (pending_.active())
        if (auto st = files::check_room(pending_.dir(), size_, "'" + pending_.final_name() + "'"); !st)
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
    seconds_ = std::chrono::duration<double>(Clock::now() - start_).count();
    if (f) pending_.discard();
    ticker_.cancel();
  }

  void tick() {
    ticker_.expires_after(opt_.progress_interval);
    ticker_.async_wait([this](const ErrorCode& ec) {
      if (ec || ended_) return;
      const auto* cancel = session_.options().cancel;
      if (cancel && cancel->load()) {
        if (sender_) return sender_->abort(errc::cancelled, "cancelled by the user");
        if (receiver_) return receiver_->abort(errc::cancelled, "cancelled by the user");
        return fail(errc::cancelled, "cancelled by the user");
      }
      if (opt_.progress && (sender_ || receiver_)) {
        const std::uint64_t done = sender_ ? sender_->bytes_done() : receiver_->bytes_done();
        opt_.progress(Progress{done, size_, std::chrono::duration<double>(Clock::now() - accepted_at_).count()});
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
  files::Fd in_place_;
  files::PendingFile pending_;
  piod::Sink sink_;
  std::uint64_t size_ = 0;
  std::unique_ptr<xsec::BlockCrypto> block_crypto_;  // used by the disk thread: outlives the engines
  std::unique_ptr<Sender> sender_;
  std::unique_ptr<Receiver> receiver_;
  Clock::time_point start_;
  Clock::time_point accepted_at_;
  bool ended_ = false;
  Failure failure_;  // how it ended (ok: it did not fail)
  double seconds_ = 0;
};

}  // namespace

TransferResult upload(Session& session, const std::string& local, const std::string& remote_path,
                      const TransferOptions& options) {
  ClientTransfer t(session, Mode::upload, remote_path, options);
  return t.upload(local);
}

TransferResult download(Session& session, const std::string& remote_path, const std::string& local,
                        const TransferOptions& options) {
  ClientTransfer t(session, Mode::download, remote_path, options);
  return t.download(local);
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
