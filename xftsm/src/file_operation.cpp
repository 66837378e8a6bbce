#include <fcntl.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include <boost/asio/steady_timer.hpp>
#include <fmt/core.h>

#include <chrono>
#include <map>

#include "xdfs/files.hpp"
#include "xdfs/relay_registry.hpp"
#include "xdfs/xsec.hpp"
#include "xdfs/detail/xftsm_fsm.hpp"
#include "xdfs/xftsm/server_mode.hpp"
#include "xdfs/detail/xftsm_engine.hpp"

namespace xdfs::xftsm {
namespace {

using Clock = std::chrono::steady_clock;

// How long a session waits for memory for its ring before it gives up (a client waits 15 s for
// the server's answer by default).
constexpr std::chrono::milliseconds memory_wait{10000};

// One file transfer, upload or download, on a session's channels.
class FileOperation final : public runtime::Operation, public TransferHost {
public:
  FileOperation(runtime::OperationEnv& env, runtime::OperationDone done)
      : env_(env),
        nego_(env.nego),
        done_(std::move(done)),
        machine_(env.nego.mode == Mode::upload ? Role::server_upload : Role::server_download),
        ring_wait_(env.io) {}

  void start() override {
    // The channels joined this operation (its negotiation came on all n): the table opens it.
    if (machine_.fire(TransferEvent::channel_joined) != TransferAction::register_session ||
        machine_.fire(TransferEvent::all_joined) != TransferAction::open_and_reply)
      return refuse(errc::state_violation, machine_.why());
    open_and_reply();
  }

  void abort(errc code, const std::string& message) override {
    if (sender_) return sender_->abort(code, message);
    if (receiver_) return receiver_->abort(code, message);
    // Still opening (waiting for memory): the peer hears why and the channels close.
    if (machine_.finished()) return;
    (void)machine_.fire(TransferEvent::local_error);
    ring_wait_.cancel();
    (void)pending_.keep();  // a resumable upload's partial file stays for its client
    if (relay_) {
      std::lock_guard lock(relay_->m);
      relay_->feeding = false;
    }
    tell_and_close(env_.channels, wire::ExceptionHeader{code, message, 0, 0}, linger(), std::chrono::milliseconds(2000));
    done_(runtime::OperationResult{code, message, false, false, false});
  }

  std::uint64_t bytes() const noexcept override {
    return sender_ ? sender_->bytes_done() : receiver_ ? receiver_->bytes_done() : 0;
  }

  files::Status commit() override {
    if (!pending_.active()) return files::Status::ok();  // memory mode: nothing to make final
    // A relay's copy is kept only if it is the master's file: its upstream's digests prove
    // only that it arrived as that upstream sent it.
    if (relay_ && !relay_->plan.digest.empty()) {
      const auto d = receiver_ ? receiver_->digest() : std::nullopt;
      if (!d || !std::equal(d->begin(), d->end(), relay_->plan.digest.begin(), relay_->plan.digest.end()))
        return files::Status{errc::integrity_error,
                             "its whole-file digest is not the one the relay's master gave: not kept"};
    }
    struct stat st {};
    const bool known = ::fstat(pending_.fd(), &st) == 0;
    // A relay's copy takes the source's permission bits, as a tree copy gives what it made:
    // before it is whole under its name, which is what a pulling host watches for (and takes the
    // mode from); if it is not made whole, the partial copy gets back the mode it can be resumed
    // with.
    const bool moded = relay_ && relay_->plan.mode != 0 && known;
    if (moded && ::fchmod(pending_.fd(), static_cast<mode_t>(relay_->plan.mode & 0777) & ~files::process_umask()) != 0)
      return files::Status::from_errno(errno, "chmod '" + nego_.remote_path + "'");
    auto s = pending_.commit(receiver_ ? receiver_->size() : nego_.file_size, env_.config.fsync);
    if (!s && moded) (void)::fchmod(pending_.fd(), st.st_mode & 07777);  // (still its descriptor)
    // The session made it: its client may set its mode later (a tree copy does, after its
    // large files went).
    if (s && known && env_.made) env_.made->add(st, files::Made::key(nego_.remote_path));
    if (s && relay_ && !relay_->plan.digest.empty()) {
      std::lock_guard lock(relay_->m);
      relay_->committed = true;
    }
    return s;
  }

  void debug(const std::string& line) override {
    if (env_.config.debug) env_.log(fmt::format("session {} debug: {}", env_.id.short_hex(), line));
  }

  void finished(const Failure& f) override {
    if (relay_) {
      // Every block written was checked first: what is here stays for the next upstream.
      std::lock_guard lock(relay_->m);
      relay_->feeding = false;
      relay_->upstream_code = f ? f.code : errc::ok;
      relay_->upstream_message = f ? f.message : std::string();
      if (!f) {
        relay_->whole = true;
        if (auto d = receiver_ ? receiver_->digest() : std::nullopt) relay_->digest.assign(d->begin(), d->end());
      } else if (f.code == errc::integrity_error || f.code == errc::size_mismatch || f.code == errc::protocol_error ||
                 relay_->discard.load()) {
        // What its upstream sent is in doubt: it goes, and the next upload starts a new file
        // (the forwarder, reading this one, starts over with that).
        pending_.discard();
        relay_->file = files::Fd();
        ++relay_->feeds;
        relay_->written.store(0);
        ++relay_->relinks;
        relay_->hop_cancel.store(true);
      } else {
        // Its place ended too (the master went away, or gave up on this host) or the upstream
        // did: what was verified stays for the next place of the same file, from any master
        // session of the same key (a master restarted, a host pulling again).
        (void)pending_.keep();
      }
    } else if (f) {
      settle_partial(pending_, f);
    }
    // Success leaves every channel clear (EOFR both ways); a failure told the peer and closes them.
    done_(runtime::OperationResult{f.code, f.message, f.from_peer, false, !f});
  }

private:
  int root_fd() const noexcept { return env_.root_fd; }

  // The block protection of this session's data direction (none in clear mode).
  xsec::BlockCrypto* crypto() {
    const auto mode = static_cast<xsec::Protect>(env_.opening.protect);
    if (mode == xsec::Protect::clear) return nullptr;
    if (!block_crypto_)
      block_crypto_ = std::make_unique<xsec::BlockCrypto>(mode, static_cast<xsec::Cipher>(env_.opening.cipher),
                                                          xsec::data_key(env_.session_secret, nego_.mode == Mode::upload, nego_.transfer));
    return block_crypto_.get();
  }

  // The ring this session gets: what it asks for while memory is plentiful; when it is getting
  // short, a quarter of what is left (the sessions that come next get some too), never below two
  // slots, which still overlap disk and network. False when not even that fits.
  bool reserve_ring(TransferParams& p) {
    const std::size_t per_slot = std::size_t(p.block_size) + piod::slot_tag_room;
    const std::size_t used = env_.budget.used(), limit = env_.budget.limit();
    const std::size_t free = used < limit ? limit - used : 0;
    std::uint32_t want = pool_slots(p);
    if (std::size_t(want) * per_slot * 4 > free)
      want = static_cast<std::uint32_t>(std::max<std::size_t>(2, std::min<std::size_t>(want, free / 4 / per_slot)));
    for (std::uint32_t slots = want;; slots = std::max<std::uint32_t>(2, slots / 2)) {
      if (auto r = Reservation::take(&env_.budget, slots * per_slot)) {
        ring_ = std::move(*r);
        p.slots = slots;
        return true;
      }
      if (slots <= 2) return false;
    }
  }

  // The records of blocks apart beyond the min_apart every transfer keeps (small blocks: 64
  // rings of them, apart_for) come from the budget too; when it has no room for them, this
  // transfer keeps min_apart (it never waits for them, only for its ring).
  void reserve_apart(TransferParams& p) {
    const std::size_t want = apart_for(p);
    p.max_apart = min_apart;
    apart_.reset();
    if (want == min_apart) return;
    if (auto r = Reservation::take(&env_.budget, (want - min_apart) * apart_record_bytes)) {
      apart_ = std::move(*r);
      p.max_apart = want;
    }
  }

  // Starts the engine once its ring is reserved: a receiver into sink, or a sender from source.
  // When memory for even the smallest ring is taken, the session waits for other sessions to
  // give some back (they end every second or so under load), then gives up with a clear error.
  void start_engine(TransferParams p, std::optional<piod::Sink> sink, std::optional<piod::Source> source) {
    if (machine_.finished()) return;
    if (!reserve_ring(p)) {
      const auto now = Clock::now();
      if (waiting_since_ == Clock::time_point{}) waiting_since_ = now;
      if (now - waiting_since_ > memory_wait)
        return refuse(errc::limit_exceeded,
                          fmt::format("the server's memory for transfers ({} MiB) stayed in use by other sessions "
                                      "for {} s; try again later",
                                      env_.budget.limit() >> 20, memory_wait.count() / 1000));
      ring_wait_.expires_after(std::chrono::milliseconds(50));
      ring_wait_.async_wait([this, p, sink, source](const xdsi::ErrorCode& ec) {
        if (!ec) start_engine(p, sink, source);
      });
      return;
    }
    reserve_apart(p);
    wire::NegotiationReply reply;
    reply.block_size = nego_.block_size;
    reply.resume_offset = p.start_offset;
    reply.mtime_ns = mtime_ns_;
    reply.in_place = static_cast<bool>(fifo_);
    if (sink) {
      receiver_ = std::make_unique<Receiver>(env_.io, machine_, env_.channels, *this, p, *sink);
      reply.window = receiver_->window();
      send_reply(reply);
      receiver_->start();
    } else {
      reply.file_size = p.file_size;
      sender_ = std::make_unique<Sender>(env_.io, machine_, env_.channels, *this, p, *source);
      send_reply(reply);
      sender_->start();
    }
  }

  void open_and_reply() {
    env_.log(fmt::format("session {} start{} peer={} mode={} path={} channels={} block={} protect={} client={}",
                         env_.id.short_hex(), nego_.transfer ? fmt::format(" op={}", nego_.transfer) : std::string(),
                         env_.peer, to_string(nego_.mode), nego_.remote_path, nego_.channel_count, nego_.block_size,
                         xsec::to_string(static_cast<xsec::Protect>(env_.opening.protect)), env_.client.fingerprint));
    TransferParams p;
    p.block_size = nego_.block_size;
    p.slots = static_cast<std::uint32_t>(std::max<std::size_t>(env_.config.ring_bytes / nego_.block_size, 4));
    p.idle_timeout = env_.config.idle_timeout;
    p.manifest = (nego_.extended_flags & wire::flag_manifest) != 0;
    p.limits = {env_.session_rate, env_.total_rate};
    p.zero_copy = env_.config.zero_copy;
    p.loopback_sendfile = env_.config.loopback_sendfile;
    const bool memory = (nego_.extended_flags & wire::flag_memory) != 0;
    // A stream may grow to this server's file size limit; without one, to what its file system
    // had free when it began (a file's size is checked against that before it starts).
    p.open_ended = nego_.open_ended;
    std::uint64_t stream_limit = env_.config.max_file_size ? std::min(env_.config.max_file_size, wire::max_file_size)
                                                            : wire::max_file_size;
    if (nego_.mode == Mode::upload && memory) {
      p.file_size = nego_.open_ended ? stream_limit : nego_.file_size;
      p.data_event = wire::ChannelEvent::xftsmu;
      start_engine(p, piod::Sink{-1, true, true, crypto()}, std::nullopt);
    } else if (nego_.mode == Mode::download && memory) {
      if (nego_.window < nego_.block_size)
        return refuse(errc::bad_argument, fmt::format("window of {} bytes is smaller than one block", nego_.window));
      p.file_size = nego_.file_size;
      p.window = nego_.window;
      p.data_event = wire::ChannelEvent::xftsmd;
      start_engine(p, std::nullopt, piod::Source{-1, p.file_size, true, crypto()});
    } else if (nego_.mode == Mode::upload && fifo_target()) {
      // Into a FIFO (xdfsd --allow-fifo): in order, as it comes, for whoever reads it; nothing
      // to rename or resume.
      if (!fifo_) return;  // refused
      p.file_size = nego_.open_ended ? stream_limit : nego_.file_size;
      p.data_event = wire::ChannelEvent::xftsmu;
      start_engine(p, piod::Sink{fifo_.get(), false, false, crypto()}, std::nullopt);
    } else if (nego_.mode == Mode::upload) {
      auto [dir, name] = files::split_parent(nego_.remote_path);
      files::Fd dirfd;
      if (auto st = files::open_beneath(root_fd(), dir, O_PATH | O_DIRECTORY, 0, dirfd); !st)
        return refuse(st.code, st.message);
      // With the manifest an upload is resumable: it is written as ".NAME.xdfs-partial" with a
      // resume record beside it, and an earlier one from the same source goes on where it was.
      std::uint64_t start = 0;
      std::optional<files::ResumeRecord> found;
      std::string notice;
      // A stream is never resumed: its sender cannot read it again.
      if (auto st = files::PendingFile::open(std::move(dirfd), name, env_.tag,
                                             p.manifest && !nego_.open_ended && env_.config.partial_expiry.count() > 0,
                                             pending_, found, notice);
          !st)
        return refuse(st.code, st.message);
      if (!nego_.relay_ticket.empty()) {
        if (auto st = attach_relay(p); !st) return refuse(st.code, st.message);
      }
      if (pending_.resumable()) {
        // A relay's file goes on from where it is whichever upstream feeds it.
        const files::ResumeKey key{relay_ ? "relay from " + relay_->master_fingerprint + " to " + nego_.remote_path
                                          : "upload from " + env_.client.fingerprint + " to " + nego_.remote_path,
                                   nego_.file_size, nego_.source_mtime_ns, nego_.block_size};
        if (found && nego_.fresh) {
          pending_.restart();  // the client asked to start over
        } else if (found && found->key == key) {
          start = resume_point(found->prefix, nego_.file_size, nego_.block_size);
        } else if (found) {
          notice = "the partial upload of '" + nego_.remote_path + "' was of another source: starting over";
          pending_.restart();
        }
        if (!notice.empty()) env_.log(fmt::format("session {}: {}", env_.id.short_hex(), notice));
        pending_.set_key(key);
      }
      // Without a size limit of its own the server takes what the file system can hold: an
      // upload that cannot fit is refused now, not when the disk is full; a stream stops there.
      if (env_.config.max_file_size == 0 && !nego_.open_ended) {
        if (auto st = files::check_room(pending_.dir(), nego_.file_size - start, "'" + nego_.remote_path + "'"); !st)
          return refuse(st.code, st.message);
      } else if (env_.config.max_file_size == 0) {
        if (const auto free = files::room(pending_.dir())) stream_limit = std::min(stream_limit, *free);
      }
      p.file_size = nego_.open_ended ? stream_limit : nego_.file_size;
      p.data_event = wire::ChannelEvent::xftsmu;
      p.start_offset = start;
      piod::Sink sink{pending_.fd(), true, false, crypto()};
      if (pending_.resumable()) sink.checkpoint = &checkpoint_;
      if (relay_) {
        sink.written = &relay_->written;
        sink.digests = &relay_->digests;
      }
      start_engine(p, sink, std::nullopt);
    } else {
      if (auto st = files::open_beneath(root_fd(), nego_.remote_path, O_RDONLY | O_NONBLOCK | O_NOCTTY, 0, source_); !st)
        return refuse(st.code, st.message);
      struct stat sb {};
      if (::fstat(source_.get(), &sb) != 0)
        return refuse(errc_from_errno(errno), "stat '" + nego_.remote_path + "'");
      if (S_ISDIR(sb.st_mode)) return refuse(errc::is_directory, "'" + nego_.remote_path + "' is a directory");
      if (!S_ISREG(sb.st_mode))
        return refuse(errc::not_regular_file, "'" + nego_.remote_path + "' is not a regular file");
      if (nego_.window < nego_.block_size)
        return refuse(errc::bad_argument, fmt::format("window of {} bytes is smaller than one block", nego_.window));
      p.file_size = static_cast<std::uint64_t>(sb.st_size);
      p.window = nego_.window;
      p.data_event = wire::ChannelEvent::xftsmd;
      mtime_ns_ = files::mtime_ns(sb);
      // The client holds a verified prefix of this file: the rest is sent, if the file is the
      // one it began from (same size and mtime); else all of it, and the client starts over.
      if (nego_.resume_offset > 0) {
        if (!p.manifest)
          return refuse(errc::bad_argument, "a resumed download needs the content manifest (the client's --no-verify)");
        if (nego_.file_size == p.file_size && nego_.source_mtime_ns == mtime_ns_) {
          if (nego_.resume_offset % nego_.block_size != 0 || nego_.resume_offset >= p.file_size)
            return refuse(errc::bad_argument, fmt::format("resume offset {} is not whole blocks before the end of the file",
                                                          nego_.resume_offset));
          p.start_offset = nego_.resume_offset;
        }
      }
      start_engine(p, std::nullopt, piod::Source{source_.get(), p.file_size, false, crypto()});
    }
  }

  // An upload that carries a relay ticket feeds the place a master registered under it (the
  // listener checked the ticket and gave it the place's file): one upload at a time, with the
  // manifest, into one file that the place's forwarder reads as it grows.
  files::Status attach_relay(const TransferParams& p) {
    auto slot = env_.relays ? env_.relays->find(nego_.relay_ticket) : nullptr;
    if (!slot || slot->cancel.load()) return files::Status{errc::auth_failed, "no relay here holds that ticket"};
    if (!p.manifest) return files::Status{errc::bad_argument, "a relayed upload needs the content manifest"};
    // The listener gave it the place's file; anything else is not this relay.
    if (nego_.remote_path != slot->path || nego_.file_size != slot->size || nego_.source_mtime_ns != slot->mtime_ns ||
        nego_.open_ended)
      return files::Status{errc::permission_denied, "a relayed upload writes its relay's file and nothing else"};
    std::lock_guard lock(slot->m);
    if (slot->whole) return files::Status{errc::bad_argument, "the relay's file is whole here already"};
    if (slot->feeding) return files::Status{errc::limit_exceeded, "another upload feeds this relay now"};
    struct stat mine {}, kept {};
    if (::fstat(pending_.fd(), &mine) != 0) return files::Status{errc_from_errno(errno), "stat of the relay's file"};
    // Its forwarder reads the file the uploads write: a later upload goes on in the same one,
    // unless nothing of it was verified yet (then none was kept, and this one is new).
    const bool same = slot->file && ::fstat(slot->file.get(), &kept) == 0 && kept.st_ino == mine.st_ino &&
                      kept.st_dev == mine.st_dev;
    if (slot->file && !same && slot->written.load() > 0)
      return files::Status{errc::not_supported,
                           "the relay's partial file was not kept (xdfsd --partial-expiry 0): it cannot go on here"};
    if (slot->file && !same) {
      ++slot->relinks;  // the forwarder reads the old one: it starts again with this one
      slot->skipped.clear();
      slot->hop_cancel.store(true);
    }
    if (!same) {
      const int fd = ::open(("/proc/self/fd/" + std::to_string(pending_.fd())).c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) return files::Status{errc_from_errno(errno), std::string("the relay's file: ") + std::strerror(errno)};
      slot->file = files::Fd(fd);
    }
    slot->feeding = true;
    ++slot->feeds;
    slot->upstream.assign(env_.client.key.begin(), env_.client.key.end());
    slot->upstream_code = errc::ok;
    slot->upstream_message.clear();
    relay_ = std::move(slot);
    env_.log(fmt::format("session {}: feeds the relay of '{}' for {}", env_.id.short_hex(), nego_.remote_path,
                         relay_->master_fingerprint));
    return files::Status::ok();
  }

  // With --allow-fifo: whether the upload's path is an existing FIFO (opened for writing into
  // fifo_, or the operation refused: nobody reads it). Only a FIFO is opened for writing here:
  // the path is looked at first without opening what it names.
  bool fifo_target() {
    if (!env_.config.allow_fifo) return false;
    files::Fd probe;
    struct stat sb {};
    if (!files::open_beneath(root_fd(), nego_.remote_path, O_PATH, 0, probe) || ::fstat(probe.get(), &sb) != 0 ||
        !S_ISFIFO(sb.st_mode))
      return false;
    // A writer's non-blocking open succeeds only while a reader has the FIFO open.
    const int fd = ::open(("/proc/self/fd/" + std::to_string(probe.get())).c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      refuse(err == ENXIO ? errc::not_supported : errc_from_errno(err),
             "'" + nego_.remote_path + "' is a FIFO " +
                 (err == ENXIO ? std::string("that nobody reads") : std::string("that cannot be opened: ") + std::strerror(err)));
      return true;
    }
    files::Fd held(fd);
    // One upload at a time writes into it: blocks of two would interleave for its reader.
    if (::flock(held.get(), LOCK_EX | LOCK_NB) != 0) {
      refuse(errc::limit_exceeded, "'" + nego_.remote_path + "' is a FIFO another upload is writing into");
      return true;
    }
    fifo_ = std::move(held);
    env_.log(fmt::format("session {}: writing into the FIFO '{}' as the data comes", env_.id.short_hex(), nego_.remote_path));
    return true;
  }

  void send_reply(const wire::NegotiationReply& reply) {
    auto payload = wire::encode(reply);
    for (auto& ch : env_.channels) ch->send_control(wire::ChannelEvent::nego_reply, payload);
  }

  // The transfer cannot start (no such file, no memory, ...): nothing was sent, the session
  // refuses it on every channel and stays ready for the next operation.
  void refuse(errc code, const std::string& message) {
    if (machine_.finished()) return;
    if (relay_) {
      std::lock_guard lock(relay_->m);
      relay_->feeding = false;
    }
    (void)machine_.fire(TransferEvent::local_error);
    ring_wait_.cancel();
    (void)pending_.keep();  // what an earlier attempt recorded stays; a new partial file goes
    done_(runtime::OperationResult{code, message, false, true, true});
  }

  boost::asio::steady_timer& linger() {
    if (!linger_timer_) linger_timer_.emplace(env_.io);
    return *linger_timer_;
  }

  runtime::OperationEnv& env_;
  wire::Negotiation nego_;
  runtime::OperationDone done_;
  Machine machine_;
  boost::asio::steady_timer ring_wait_;   // memory for the ring was short: look again
  std::optional<boost::asio::steady_timer> linger_timer_;
  Clock::time_point waiting_since_{};
  files::PendingFile pending_;
  PartialCheckpoint checkpoint_{pending_};  // the disk thread records a resumable upload's progress
  std::int64_t mtime_ns_ = 0;               // download: the file's, for the client's resume record
  files::Fd source_;
  files::Fd fifo_;  // an upload into a FIFO (--allow-fifo)
  std::unique_ptr<xsec::BlockCrypto> block_crypto_;  // used by the disk thread: outlives the engines
  Reservation ring_;                                 // the engine's pool, in the server's memory budget
  Reservation apart_;                                // its records of blocks apart beyond min_apart
  std::unique_ptr<Sender> sender_;
  std::unique_ptr<Receiver> receiver_;
  std::shared_ptr<runtime::RelaySlot> relay_;  // the place in a relay chain this upload feeds
};

}  // namespace

runtime::Modes server_modes() {
  auto make = [](runtime::OperationEnv& env, runtime::OperationDone done) -> std::unique_ptr<runtime::Operation> {
    return std::make_unique<FileOperation>(env, std::move(done));
  };
  return {runtime::ModeEntry{Mode::upload, make}, runtime::ModeEntry{Mode::download, make}};
}

}  // namespace xdfs::xftsm
