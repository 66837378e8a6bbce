#include "xdfs/detail/xftsm_engine.hpp"

#include <boost/asio/post.hpp>

#include <fmt/core.h>

#include <fcntl.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace xdfs::xftsm {

using wire::FrameHeader;
using xdsi::ErrorCode;
namespace werr = boost::asio::error;

namespace {

constexpr std::uint8_t max_per_channel = 2;

// The wake-up descriptor of the engine's event loop: its own copy of the pipe's eventfd.
int dup_or_throw(int fd) {
  const int d = ::dup(fd);
  if (d < 0) throw Error(errc_from_errno(errno), std::string("dup of the disk wake-up descriptor: ") + std::strerror(errno));
  return d;
}

}  // namespace

std::uint32_t pool_slots(const TransferParams& p) noexcept {
  const std::uint64_t bs = p.block_size ? p.block_size : 1;
  const std::uint64_t blocks = p.file_size / bs + (p.file_size % bs != 0);  // no overflow near 2^64
  return static_cast<std::uint32_t>(std::max<std::uint64_t>(std::min<std::uint64_t>(p.slots, blocks), 2));
}

std::size_t apart_for(const TransferParams& p) noexcept {
  return std::max<std::size_t>(min_apart, 64 * std::size_t(pool_slots(p)));
}

// ---------------------------------------------------------------------------------------------
// Engine

Engine::Engine(asio::io_context& io, Machine& machine, ChannelList& channels, TransferHost& host,
               const TransferParams& p)
    : io_(io),
      machine_(machine),
      channels_(channels),
      host_(host),
      params_(p),
      pipe_(p.block_size, pool_slots(p), p.pools),
      wake_(io, dup_or_throw(pipe_.net_wake().fd())),
      watchdog_(io),
      linger_(io),
      last_activity_(std::chrono::steady_clock::now()),
      end_(p.open_ended ? piod::BlockPipe::no_end : p.file_size),
      // Digests wait for a missing block; more apart than this means a block the peer withholds.
      max_apart_(p.max_apart ? p.max_apart : apart_for(p)) {
  if (p.manifest && p.open_ended) manifest_.emplace(manifest::FileDigest::OpenEnded{}, p.block_size, max_apart_);
  else if (p.manifest) manifest_.emplace(p.file_size, p.block_size, max_apart_);
  std::erase_if(params_.limits, [](RateLimiter* r) { return !r || !r->limited(); });
  arm_watchdog();
}

Engine::~Engine() = default;

std::optional<TransferAction> Engine::fire(TransferEvent e) {
  if (machine_.finished()) return std::nullopt;
  auto a = machine_.fire(e);
  if (!a) fail(errc::state_violation, machine_.why(), false, true);
  return a;
}

void Engine::abort(errc code, const std::string& message) { fail(code, message, false, true); }

void Engine::fail(Failure f, bool tell_peer, TransferEvent ev) {
  if (machine_.finished()) return;
  // Force the machine to failed even if ev is not in the table here (every live state has it).
  if (!machine_.fire(ev)) (void)machine_.fire(TransferEvent::local_error);
  // The disk thread ends before the host closes the file: a write still queued would otherwise
  // land in whatever file reuses the descriptor, another session's upload among them.
  stop_disk();
  watchdog_.cancel();
  ErrorCode ignored;
  wake_.cancel(ignored);
  // The host drops its partial file first: once the peer reads the exception, nothing of this
  // transfer may be left to see.
  host_.finished(f);
  if (tell_peer) {
    tell_and_close(channels_, wire::ExceptionHeader{f.code, f.message, f.channel.value_or(ChannelIndex(0)).value(), done_bytes_}, linger_,
                   params_.linger, [this] { host_.closed(); });
  } else {
    close_all();
    host_.closed();
  }
}

void Engine::finish_ok() {
  // The operation ended on every channel: nothing of it is left to read or send there, and the
  // channels stay open for the session's next operation.
  watchdog_.cancel();
  ErrorCode ignored;
  wake_.cancel(ignored);
  stop_disk();
  host_.finished(Failure{});
}

std::string Engine::unexpected(const xdsi::Channel& ch, const FrameHeader& h) const {
  return std::string("unexpected ") + wire::to_string(h.event) + " on channel " + std::to_string(ch.index()) +
         " in state " + to_string(machine_.state());
}

void Engine::close_all() noexcept {
  linger_.cancel();
  for (auto& ch : channels_)
    if (ch) ch->close();
}

void Engine::arm_watchdog() {
  watchdog_.expires_after(std::chrono::milliseconds(250));
  watchdog_.async_wait([this](const xdsi::ErrorCode& ec) {
    if (ec || machine_.finished()) return;
    // Hashing a resumed transfer's kept prefix (either side's disk thread) is progress too.
    if (const auto h = pipe_.prefix_hashed().load(std::memory_order_relaxed); h != hashed_seen_) {
      hashed_seen_ = h;
      touch();
    }
    if (std::chrono::steady_clock::now() - last_activity_ > params_.idle_timeout) {
      fail(errc::timeout, "no progress for " + std::to_string(params_.idle_timeout.count() / 1000) + " s", false, true,
           TransferEvent::timeout);
      return;
    }
    arm_watchdog();
  });
}

void Engine::watch_disk() {
  wake_.async_wait(asio::posix::stream_descriptor::wait_read, [this](const xdsi::ErrorCode& ec) {
    if (ec || machine_.finished()) return;
    pipe_.net_wake().drain();
    if (pipe_.failed()) {
      fail(pipe_.error_code(), pipe_.error_text(), false, true);
      return;
    }
    on_disk();
    if (!machine_.finished()) watch_disk();
  });
}

bool Engine::handle_common(xdsi::Channel& ch, const FrameHeader& h) {
  switch (h.event) {
    case wire::ChannelEvent::noop:
    case wire::ChannelEvent::conm:
      if (h.length != 0) {
        fail(errc::protocol_error, std::string(wire::to_string(h.event)) + " with a payload", false, true);
        return true;
      }
      if (h.event == wire::ChannelEvent::noop && params_.open_ended) on_noop();
      return true;
    case wire::ChannelEvent::exception:
      read_exception(ch, h.length);
      return true;
    default:
      return false;
  }
}

void Engine::read_exception(xdsi::Channel& ch, std::uint32_t length) {
  auto buf = std::make_shared<std::vector<std::uint8_t>>(length);
  ch.async_read_payload(*buf, [this, buf, &ch](const xdsi::ErrorCode& ec) {
    if (machine_.finished()) return;
    if (ec) return channel_error(ch, ec);
    std::string why;
    auto ex = wire::decode_exception(*buf, &why);
    if (!ex) return fail(errc::protocol_error, "bad exception header: " + why, false, false);
    fail(ex->code, ex->message, true, false, TransferEvent::peer_exception);
  });
}

std::uint64_t Engine::channel_total(std::uint64_t (xdsi::Channel::*count)() const noexcept) const noexcept {
  std::uint64_t n = 0;
  for (const auto& ch : channels_) n += ((*ch).*count)();
  return n;
}

void Engine::channel_error(xdsi::Channel& ch, const xdsi::ErrorCode& ec) {
  if (machine_.finished() || ec == werr::operation_aborted) return;
  const bool client = machine_.role() == Role::client_upload || machine_.role() == Role::client_download;
  auto f = ch.failure(ec, client ? "server" : "client");
  const auto ev = f.peer_gone ? TransferEvent::channel_lost : TransferEvent::local_error;
  fail(std::move(f), true, ev);
}

void Engine::eofr_everywhere(std::uint64_t offset) {
  std::vector<std::uint8_t> payload;
  if (manifest_) {
    const auto d = own_digest();
    if (!d) return;
    payload.assign(d->begin(), d->end());
  }
  for (auto& ch : channels_) {
    FrameHeader h;
    h.event = wire::ChannelEvent::eofr;
    h.offset = offset;
    h.length = static_cast<std::uint32_t>(payload.size());
    ++eofr_unsent_;
    ch->send(h, std::vector<std::uint8_t>(payload), [this, c = ch.get()](const xdsi::ErrorCode& ec) {
      --eofr_unsent_;
      if (machine_.finished()) return;
      if (ec) return channel_error(*c, ec);
      maybe_finish();
    });
  }
}

std::chrono::steady_clock::duration Engine::pace(std::uint64_t n) noexcept {
  auto wait = std::chrono::steady_clock::duration::zero();
  const auto now = std::chrono::steady_clock::now();
  for (auto* r : params_.limits) wait = std::max(wait, r->take(n, now));
  return wait;
}

std::optional<manifest::Digest> Engine::own_digest() {
  auto d = manifest_ ? manifest_->result() : std::nullopt;
  if (manifest_ && !d) fail(errc::internal, "the whole-file digest is missing blocks", false, true);
  return d;
}

void Engine::read_digest(xdsi::Channel& ch, const FrameHeader& h, std::function<void()> then) {
  if (!manifest_ || h.length != manifest::digest_size) {
    if (!manifest_ && h.length == 0) return then();
    return fail(errc::protocol_error,
                fmt::format("EOFR on channel {} carries {} bytes, {}", ch.index(), h.length,
                            manifest_ ? "not a digest" : "where nothing belongs"),
                false, true);
  }
  auto buf = std::make_shared<manifest::Digest>();
  ch.async_read_payload(*buf, [this, &ch, buf, then = std::move(then)](const xdsi::ErrorCode& ec) {
    if (machine_.finished()) return;
    if (ec) return channel_error(ch, ec);
    if (peer_digest_ && *peer_digest_ != *buf)
      return fail(errc::protocol_error, "the EOFRs of the channels carry different digests", false, true);
    peer_digest_ = *buf;
    then();
  });
}

bool Engine::digests_agree() {
  if (!manifest_ || agreed_) return true;
  const auto mine = own_digest();
  if (!mine) return false;
  if (!peer_digest_) {
    fail(errc::internal, "no whole-file digest came from the peer", false, true);
    return false;
  }
  if (*peer_digest_ != *mine) {
    const bool sending = machine_.role() == Role::client_upload || machine_.role() == Role::server_download;
    fail(errc::integrity_error,
         fmt::format("the whole-file digest differs: {} computed here, {} by the {}", manifest::hex(*mine),
                     manifest::hex(*peer_digest_), sending ? "receiver" : "sender"),
         false, true);
    return false;
  }
  agreed_ = mine;
  return true;
}

void Engine::bad_block(const xdsi::Channel& ch, const FrameHeader& h, std::string what) {
  Failure f(errc::protocol_error,
            fmt::format("bad block on channel {}: offset {} length {} in {}: {}", ch.index(), h.offset, h.length,
                        params_.open_ended ? std::string("a stream") : fmt::format("a file of {} bytes", params_.file_size),
                        what));
  f.channel = ChannelIndex(ch.index());
  f.offset = FileOffset(h.offset);
  fail(std::move(f), true);
}

// ---------------------------------------------------------------------------------------------
// Sender

Sender::Sender(asio::io_context& io, Machine& machine, ChannelList& channels, TransferHost& host,
               const TransferParams& p, piod::Source source)
    : Engine(io, machine, channels, host, p), source_(source), keepalive_(io), pace_timer_(io), inflight_(channels.size(), 0),
      confirmed_(channels.size(), false) {
  source_.manifest = manifest_ ? &*manifest_ : nullptr;
  // In clear mode nothing else checks a block on its way: one that fails its digest at the
  // receiver is sent again. A sealed block never is (its nonce serves once).
  resends_ = manifest_ && !source_.sealer && !source_.zero && !p.open_ended;
  source_.resends = resends_;
  source_.stream = p.open_ended && !source_.zero;
  spare_ = pipe_.slots() - 1;
  ready_.reserve(pipe_.slots());
  const std::string refusal = zero_copy_refusal();
  source_.zero_copy = refusal.empty();
  // The slots hold the blocks' digests alone (the data goes from the file).
  if (source_.zero_copy && source_.manifest) pipe_.sparse();
  zero_copy_from_ = channel_total(&xdsi::Channel::zero_copy_bytes);
  zero_page_from_ = channel_total(&xdsi::Channel::zero_page_bytes);
  host_.debug(source_.zero_copy ? "zero copy: file data goes to the sockets by sendfile"
                                : "zero copy off: " + refusal);
  // A resumed transfer: what the receiver has counts as sent and acknowledged.
  queued_ = acked_ = done_bytes_ = params_.start_offset;
}

Sender::~Sender() { stop_disk(); }

std::string Sender::zero_copy_refusal() const {
  if (!params_.zero_copy) return "switched off by a setting";
  if (source_.zero) return "a memory source";
  if (source_.stream) return "a stream (a pipe or FIFO) is read, not sent from a file";
  if (source_.sealer) return "blocks are sealed (integrity or private protection)";
  if (source_.test_corrupt) return "the test hook damages blocks in memory";
  // A digest made from the bytes read must go with those very bytes: a file rewritten in place
  // meanwhile would send other ones. Only digests kept already (a relay's) go with sendfile.
  if (source_.manifest && !source_.digests) return "each block is read to make its digest (the manifest)";
  for (const auto& ch : channels_)
    if (!ch->clear_frames(params_.data_event)) return "data frames are protected";
  // A session's channels all go to one peer: the first one tells.
  if (!params_.loopback_sendfile && !channels_.empty() && channels_.front()->peer_on_this_host())
    return "the peer is on this host, where a copy costs less than sendfile's small packets "
           "(--loopback-sendfile)";
  struct stat sb {};
  if (::fstat(source_.fd, &sb) != 0) return std::string("fstat: ") + std::strerror(errno);
  if (!S_ISREG(sb.st_mode)) return "not a regular file";
  // Whether the file system can splice the file at all: one byte into a pipe.
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) return std::string("pipe: ") + std::strerror(errno);
  off_t off = 0;
  const ssize_t r = ::sendfile(fds[1], source_.fd, &off, 1);
  const int err = errno;
  ::close(fds[0]);
  ::close(fds[1]);
  if (r < 0) return std::string("the file system does not send this file by sendfile: ") + std::strerror(err);
  return {};
}

void Sender::stop_disk() noexcept {
  pace_timer_.cancel();  // a block waiting for its rate does not outlive the transfer
  keepalive_.cancel();
  pipe_.stop();
  reader_.reset();  // joins: the reader checks for the stop before every read
}

namespace {
// Per-block work (crypto, digests or both) spreads over the process's helper threads, beside the
// disk thread; the debug line says where it runs and what it is. Nothing to do: no pool.
piod::BlockWorkers* pick_workers(TransferHost& host, bool crypto, bool digests, const char* both,
                                 const char* crypto_only, const char* digests_only) {
  if (!crypto && !digests) return nullptr;
  auto& pool = piod::BlockWorkers::shared();
  const char* what = crypto && digests ? both : crypto ? crypto_only : digests_only;
  const unsigned lanes = pool.lanes();
  if (lanes <= 1) {
    host.debug(fmt::format("block work on the disk thread alone: {}", what));
  } else {
    host.debug(fmt::format("block work on {} lanes (the disk thread and {} {}): {}", lanes, lanes - 1,
                           lanes == 2 ? "helper" : "helpers", what));
  }
  return &pool;
}
}  // namespace

void Sender::start() {
  for (std::uint32_t s = 0; s < pipe_.slots() - (resends_ ? 1 : 0); ++s) pipe_.to_disk(piod::Block{s});
  if (!source_.workers) {
    source_.workers = pick_workers(host_, source_.sealer != nullptr, source_.manifest != nullptr,
                                   "digests and seals", "seals", "digests");
  }
  reader_.emplace(pipe_, source_, params_.start_offset);
  watch_disk();
  for (auto& ch : channels_) read_loop(*ch);
  if (params_.open_ended) keep_alive();
  pump();
}

void Sender::keep_alive() {
  keepalive_.expires_after(std::chrono::seconds(1));
  keepalive_.async_wait([this](const xdsi::ErrorCode& ec) {
    if (ec || machine_.state() != State::transferring) return;
    if (ready_head_ == ready_.size() && again_.empty() && queued_ == acked_ && !pacing_) {
      FrameHeader h;
      h.event = wire::ChannelEvent::noop;
      auto& ch = *channels_.front();
      ++noops_unsent_;
      ch.send(h, std::vector<std::uint8_t>{}, [this, &ch](const xdsi::ErrorCode& e) {
        --noops_unsent_;
        if (machine_.finished()) return;
        if (e) return channel_error(ch, e);
        maybe_finish();
      });
    }
    keep_alive();
  });
}

void Sender::on_disk() {
  piod::Block b;
  bool any = false;
  while (pipe_.from_disk(b)) {
    (b.retry ? again_ : ready_).push_back(b);
    any = true;
  }
  // A stream's reader met its end (set before its last block was handed over).
  if (end_ == piod::BlockPipe::no_end && pipe_.stream_end() != piod::BlockPipe::no_end) {
    end_ = pipe_.stream_end();
    any = true;
  }
  if (any) on(TransferEvent::block_ready);
}

void Sender::on(TransferEvent e) {
  const auto a = fire(e);
  if (!a) return;
  switch (*a) {
    case TransferAction::send_block:
    case TransferAction::open_window: return pump();
    case TransferAction::send_eofr: return send_eofrs();
    case TransferAction::resend_block: return resend();
    case TransferAction::finish: return finish_ok();
    case TransferAction::none: return;
    default:
      return fail(errc::internal, std::string("the sender has no handler for ") + to_string(*a), false, true);
  }
}

void Sender::pump() {
  // Only while transferring: after all_sent (draining) nothing more is queued.
  if (machine_.state() != State::transferring) return;
  const std::size_t n = channels_.size();
  // The least loaded channel, round robin among equals from where we stopped; n if every one
  // has two blocks queued. Two blocks per channel keep its socket buffer fed while the
  // completion of the first one is handled.
  auto pick_channel = [&]() -> std::size_t {
    std::size_t pick = n;
    for (std::size_t k = 0; k < n; ++k) {
      std::size_t i = (next_channel_ + k) % n;
      if (inflight_[i] < max_per_channel && (pick == n || inflight_[i] < inflight_[pick])) {
        pick = i;
        if (inflight_[i] == 0) break;
      }
    }
    if (pick != n) next_channel_ = (pick + 1) % n;
    return pick;
  };
  if (pacing_) return;  // a block waits for its rate; the timer pumps again
  // Blocks sent again first: the receiver's window already counts them.
  while (!again_.empty()) {
    const std::size_t pick = pick_channel();
    if (pick == n || !may_send(again_.back().length.value())) return;
    const piod::Block b = again_.back();
    again_.pop_back();
    send_on(pick, b);
  }
  while (ready_head_ < ready_.size()) {
    const piod::Block b = ready_[ready_head_];
    if (queued_ - acked_ + b.length.value() > params_.window && queued_ != acked_) break;  // window full
    const std::size_t pick = pick_channel();
    if (pick == n || !may_send(b.length.value())) break;
    ++ready_head_;
    queued_ += b.length.value();
    send_on(pick, b);
  }
  if (ready_head_ == ready_.size()) {
    ready_.clear();
    ready_head_ = 0;
  }
  // EOFR once the receiver has every block: until then it may ask for one again.
  if (queued_ == end_ && acked_ == end_) on(TransferEvent::all_sent);
}

void Sender::send_on(std::size_t pick, const piod::Block& b) {
  ++inflight_[pick];
  FrameHeader h;
  h.event = params_.data_event;
  // The disk thread has hashed and sealed the block: its digest and tag follow the data in
  // the slot.
  const FrameLength frame = framed(b.length, piod::trailer(source_.manifest, source_.sealer));
  h.length = frame.value();
  h.offset = b.offset.value();
  auto& ch = *channels_[pick];
  auto sent = [this, pick, b, &ch](const xdsi::ErrorCode& ec) {
    if (machine_.finished()) return;
    if (ec) return channel_error(ch, ec);
    --inflight_[pick];
    touch();
    if (b.retry) {
      resending_.erase(b.offset.value());
      spare_busy_ = false;  // the spare slot reads the next block asked for, if any
      resend();
    } else {
      // The slot goes back for read-ahead, waking the disk thread once a quarter of the pool
      // is back, or at once when fewer blocks than that are left to send meanwhile.
      const std::uint32_t batch = std::max<std::uint32_t>(1, pipe_.slots() / 4);
      pipe_.to_disk_lazily(piod::Block{b.slot}, batch, ready_.size() - ready_head_ < batch);
    }
    on(TransferEvent::block_sent);
    maybe_finish();
  };
  if (source_.zero_copy && !b.in_slot) {
    // The slot holds the block's trailer (its digest) alone: the data goes from the file. (A
    // block read to make its digest goes as it was read.)
    const auto trailer =
        std::span<std::uint8_t>(pipe_.slot_data(b.slot) + b.length.value(), frame.value() - b.length.value());
    ch.send_file(h, source_.fd, b.offset.value(), b.length.value(), trailer, std::move(sent));
  } else if (source_.zero && frame.value() == b.length.value() && ch.clear_frames(h.event) &&
             xdsi::Channel::zeros_available(frame.value())) {
    // A memory source's block, zeros with nothing after them: from the zero page, not the slot.
    ch.send_zeros(h, std::move(sent));
  } else {
    ch.send(h, std::span<std::uint8_t>(pipe_.slot_data(b.slot), frame.value()), std::move(sent));
  }
}

bool Sender::may_send(std::uint64_t n) {
  if (params_.limits.empty()) return true;
  if (paced_) {  // the reservation this block waited for has come
    paced_ = false;
    return true;
  }
  const auto wait = pace(n);
  if (wait <= std::chrono::steady_clock::duration::zero()) return true;
  paced_ = pacing_ = true;
  pace_timer_.expires_after(wait);
  pace_timer_.async_wait([this](const xdsi::ErrorCode& ec) {
    if (ec || machine_.finished()) return;
    pacing_ = false;
    touch();  // waiting for the rate is not a stall
    pump();
  });
  return false;
}

void Sender::resend() {
  if (spare_busy_ || asked_.empty()) return;
  piod::Block b = asked_.front();
  asked_.pop_front();
  b.slot = spare_;
  spare_busy_ = true;
  pipe_.to_disk(b);
}

void Sender::send_eofrs() { eofr_everywhere(end_); }

void Sender::read_loop(xdsi::Channel& ch) {
  ch.async_read_header([this, &ch](const xdsi::ErrorCode& ec, const FrameHeader& h) {
    if (machine_.finished()) return;
    if (ec) return channel_error(ch, ec);
    on_frame(ch, h);
  });
}

void Sender::on_frame(xdsi::Channel& ch, const FrameHeader& h) {
  if (handle_common(ch, h)) {
    if (h.event != wire::ChannelEvent::exception && !machine_.finished()) read_loop(ch);
    return;
  }
  switch (h.event) {
    case wire::ChannelEvent::ack:
      if (h.length != 0 || h.offset > queued_ || h.offset > source_.size)
        return fail(errc::protocol_error,
                    "ACK of " + std::to_string(h.offset) + " bytes, only " + std::to_string(queued_) + " sent", false,
                    true);
      if (h.offset > acked_) {  // progress; a NOOP or a repeated ACK is not
        acked_ = h.offset;
        done_bytes_ = acked_;
        touch();
      }
      on(TransferEvent::ack_received);
      if (!machine_.finished()) read_loop(ch);
      return;
    case wire::ChannelEvent::nack: {
      // The receiver found a block we sent did not match its digest: it must be one we sent
      // and it has not acknowledged, asked for at most max_refetches times.
      const FileOffset at(h.offset);
      const auto len = block_at(at, source_.size, DataLength(params_.block_size));
      if (!resends_ || h.length != 0 || !len || after(at, *len)->value() > queued_)
        return fail(errc::protocol_error,
                    fmt::format("NACK of offset {} on channel {}: {}", h.offset, ch.index(),
                                resends_ ? "not a block that was sent" : "this transfer sends no block again"),
                    false, true);
      // Asked again before it was sent again, or more blocks outstanding than the window holds:
      // not what a receiver that checks what arrives does.
      const std::uint64_t window_blocks = params_.window / params_.block_size + 1;  // the receiver's
      if (resending_.count(h.offset) || resending_.size() >= window_blocks)
        return fail(errc::protocol_error,
                    fmt::format("NACK of offset {} on channel {}: {}", h.offset, ch.index(),
                                resending_.count(h.offset) ? "asked again before it was sent again"
                                                           : "more blocks asked again than the window holds"),
                    false, true);
      // Each block asked again is remembered (a node each): as many as a manifest lets wait for
      // a missing block, or a receiver asking for block after block would grow it without bound.
      if (nacks_.size() >= max_apart_ && !nacks_.count(h.offset))
        return fail(errc::limit_exceeded,
                    fmt::format("the receiver asked for more than {} blocks again (the last at offset {})", max_apart_,
                                h.offset),
                    false, true);
      if (++nacks_[h.offset] > max_refetches)
        return fail(errc::protocol_error,
                    fmt::format("the receiver asked for the block at offset {} more than {} times", h.offset,
                                max_refetches),
                    false, true);
      resending_.insert(h.offset);
      asked_.push_back(piod::Block{0, *len, at, true});
      on(TransferEvent::nack_received);
      if (!machine_.finished()) read_loop(ch);
      return;
    }
    case wire::ChannelEvent::eofr:
      // The receiver committed the file: its last word on this channel, which is done with
      // this transfer (it is not read again until the next operation).
      // Only a receiver that has everything confirms: the table allows it in draining alone.
      if (!machine_.find(TransferEvent::committed)) return (void)fire(TransferEvent::committed);
      if (h.offset != end_)
        return fail(errc::size_mismatch,
                    "receiver confirmed " + std::to_string(h.offset) + " bytes of " + std::to_string(end_), false, true);
      if (confirmed_[ch.index()]) return fail(errc::protocol_error, unexpected(ch, h) + " twice", false, true);
      confirmed_[ch.index()] = true;
      // With a manifest, the confirmation carries the digest of what the receiver verified.
      return read_digest(ch, h, [this] {
        done_bytes_ = end_;
        touch();
        ++confirmations_;
        maybe_finish();
      });
    default:
      return fail(errc::protocol_error, unexpected(ch, h), false, true);
  }
}

// Done when the receiver confirmed on every channel and everything this side queued has left.
void Sender::maybe_finish() {
  if (machine_.finished() || confirmations_ != channels_.size() || eofr_unsent_ != 0 || noops_unsent_ != 0) return;
  for (auto q : inflight_)
    if (q != 0) return;
  if (!digests_agree()) return;
  if (source_.zero_copy) host_.debug(fmt::format("zero copy: {} bytes by sendfile",
                                                  channel_total(&xdsi::Channel::zero_copy_bytes) - zero_copy_from_));
  if (source_.zero) host_.debug(fmt::format("memory source: {} bytes from the zero page",
                                             channel_total(&xdsi::Channel::zero_page_bytes) - zero_page_from_));
  on(TransferEvent::committed);
}

// ---------------------------------------------------------------------------------------------
// Receiver

Receiver::Receiver(asio::io_context& io, Machine& machine, ChannelList& channels, TransferHost& host,
                   const TransferParams& p, piod::Sink sink)
    : Engine(io, machine, channels, host, p), sink_(sink), eofr_(channels.size(), false) {
  sink_.manifest = manifest_ ? &*manifest_ : nullptr;
  refetch_ = manifest_ && !sink_.opener && !sink_.discard && !p.open_ended;
  sink_.refetch = refetch_;
  // A resumed transfer: the part the receiver has is in the file; the disk thread hashes it first.
  if (p.start_offset > 0) {
    sink_.prefix = p.start_offset;
    seen_.insert(0, p.start_offset);
    received_ = done_bytes_ = acked_sent_ = p.start_offset;
  }
  if (!params_.limits.empty())
    for (std::size_t i = 0; i < channels.size(); ++i) pace_.push_back(std::make_unique<asio::steady_timer>(io));
  free_slots_.reserve(pipe_.slots());
  for (std::uint32_t s = pipe_.slots(); s-- > 0;) free_slots_.push_back(s);
  // Acknowledge every quarter window: the sender always has three quarters in flight.
  ack_every_ = std::max<std::uint64_t>(window() / 4, p.block_size);
  std::string refusal = zero_copy_in_refusal();
  if (refusal.empty() && !sink_.discard) {
    splice_file_ = std::make_shared<xdsi::SpliceFile>(sink_.fd);
    if (!splice_file_->ready()) {
      refusal = splice_file_->refusal();
      splice_file_.reset();
    }
  }
  skip_ = refusal.empty() && sink_.discard;
  zero_copy_in_from_ = channel_total(&xdsi::Channel::zero_copy_in_bytes);
  host_.debug(skip_          ? "zero copy in: payloads go from the sockets into /dev/null by splice"
              : splice_file_ ? "zero copy in: payloads go from the sockets into the file by splice"
                             : "zero copy in off: " + refusal);
}

std::string Receiver::zero_copy_in_refusal() const {
  if (!params_.zero_copy) return "switched off by a setting";
  if (params_.open_ended) return "a stream's blocks are read";
  if (sink_.opener) return "blocks are sealed (integrity or private protection)";
  if (tag().value() != 0) return "blocks carry digests to check";
  for (const auto& ch : channels_)
    if (!ch->clear_frames(params_.data_event)) return "data frames are protected";
  if (sink_.discard) return "";
  if (!sink_.seekable) return "the sink takes its bytes in order (a pipe, a FIFO, a terminal)";
  if (sink_.io) return "the disk's system calls are replaced (a test)";
  return "";
}


Receiver::~Receiver() { stop_disk(); }

void Receiver::stop_disk() noexcept {
  for (auto& t : pace_) t->cancel();  // a read waiting for its rate does not outlive the transfer
  // Nor does a splice into the file: the host closes it next, and its descriptor may then name
  // another session's file.
  if (splice_file_) splice_file_->revoke();
  pipe_.stop();
  writer_.reset();  // joins: the writer checks for the stop before every write
}

void Receiver::start() {
  if (!sink_.workers) {
    sink_.workers = pick_workers(host_, sink_.opener != nullptr, sink_.manifest != nullptr,
                                 "opening and digest checks", "opening", "digest checks");
  }
  writer_.emplace(pipe_, sink_);
  watch_disk();
  for (auto& ch : channels_) read_loop(*ch);
  maybe_complete();  // a 0-byte file completes on EOFRs alone
}

void Receiver::read_loop(xdsi::Channel& ch) {
  ch.async_read_header([this, &ch](const xdsi::ErrorCode& ec, const FrameHeader& h) {
    // Read while transferring; once committing (draining) no channel is read in this transfer.
    if (machine_.state() != State::transferring) return;
    if (ec) return channel_error(ch, ec);
    on_header(ch, h);
  });
}

void Receiver::on(TransferEvent e, const Arrival& arrival) {
  const auto a = fire(e);
  if (!a) return;
  switch (*a) {
    case TransferAction::queue_write: return queue_write(arrival);
    case TransferAction::send_ack: return send_ack();
    case TransferAction::send_nack: return send_nack(arrival);
    case TransferAction::commit: return commit();
    case TransferAction::finish: return finish_ok();
    case TransferAction::none: return;
    default:
      return fail(errc::internal, std::string("the receiver has no handler for ") + to_string(*a), false, true);
  }
}

void Receiver::on_header(xdsi::Channel& ch, const FrameHeader& h) {
  if (handle_common(ch, h)) {
    if (h.event != wire::ChannelEvent::exception && !machine_.finished()) read_loop(ch);
    return;
  }
  const auto idx = ch.index();
  if (h.event == wire::ChannelEvent::eofr) {
    if (eofr_[idx]) return fail(errc::protocol_error, "duplicate EOFR on channel " + std::to_string(idx), false, true);
    // The sender's last word on this channel: it is not read again in this transfer. With a
    // manifest it carries the whole-file digest, compared once every block is verified.
    eofr_[idx] = true;
    if (params_.open_ended && !stream_eofr(ch, h)) return;
    return read_digest(ch, h, [this] {
      ++eofr_count_;
      touch();
      maybe_complete();
    });
  }
  if (h.event != params_.data_event) return fail(errc::protocol_error, unexpected(ch, h), false, true);
  // The header is not authenticated until its frame's tag, after the payload, has been checked:
  // only its length is used before that, as a bound on what to read into a slot. What it says
  // (which block, whether it came before) is judged once the frame is known to be the peer's.
  const auto data = unframed(FrameLength(h.length), tag());
  if (eofr_[idx] || !data || data->value() > params_.block_size)
    return bad_block(ch, h, eofr_[idx] ? "after EOFR" : "no block has that length");
  admit(ch, h);
}

void Receiver::admit(xdsi::Channel& ch, const FrameHeader& h) {
  if (free_slots_.empty()) {
    parked_.push_back({&ch, h});  // resumes when the disk thread frees a slot
    return;
  }
  read_block(ch, h);
}

void Receiver::read_block(xdsi::Channel& ch, const FrameHeader& h) {
  const std::uint32_t slot = free_slots_.back();
  free_slots_.pop_back();
  const std::span<std::uint8_t> into(pipe_.slot_data(slot), h.length);
  if (splice_file_ && splice_file_->ready()) {
    // Into the file by splice: a clear frame has no tag, so its header is all there will ever
    // be to judge it by, and it is judged before a byte of it goes into the file. The slot
    // takes what the file would not, and the block goes through the disk thread, which writes
    // only that, as the table says.
    const auto data = judge(ch, h);
    if (!data) return;
    return ch.async_splice_payload(
        h.length, splice_file_, h.offset, into,
        [this, &ch, slot, h, data = *data](const xdsi::ErrorCode& ec, std::size_t in_file) {
          if (machine_.finished()) return;
          if (ec) return channel_error(ch, ec);
          touch();
          on(TransferEvent::block_received, Arrival{&ch, slot, h, data, static_cast<std::uint32_t>(in_file)});
        });
  }
  // The block still goes through its slot and the disk thread (which writes nothing to a
  // discarding sink): the table's path is the same, only its bytes never reach user space.
  auto arrived = [this, &ch, slot, h](const xdsi::ErrorCode& ec) {
    if (machine_.finished()) return;
    if (ec) return channel_error(ch, ec);
    touch();
    // Authenticated now.
    const auto data = judge(ch, h);
    if (!data) return;
    on(TransferEvent::block_received, Arrival{&ch, slot, h, *data});
  };
  if (skip_) return ch.async_skip_payload(h.length, std::move(arrived));
  ch.async_read_payload(into, std::move(arrived));
}

std::optional<DataLength> Receiver::judge(xdsi::Channel& ch, const FrameHeader& h) {
  const FileOffset at(h.offset);
  std::string why = "not one of the file's blocks";
  const auto expect = params_.open_ended ? stream_block(h, why)
                                         : block_at(at, params_.file_size, DataLength(params_.block_size));
  if (machine_.finished()) return std::nullopt;
  if (!expect || framed(*expect, tag()) != FrameLength(h.length)) {
    bad_block(ch, h, why);
    return std::nullopt;
  }
  if (!seen_.insert(at.value(), after(at, *expect)->value())) {
    bad_block(ch, h, "block at offset " + std::to_string(h.offset) + " received twice");
    return std::nullopt;
  }
  // Each run of received bytes apart from the others costs a node: as many as the manifest lets
  // wait for a missing block, with or without one (a peer spreading blocks over a large file
  // would otherwise grow this without bound, outside the memory budget).
  if (seen_.runs() > max_apart_) {
    bad_block(ch, h, fmt::format("blocks arrive in more than {} runs apart", max_apart_));
    return std::nullopt;
  }
  return expect;
}

void Receiver::queue_write(const Arrival& a) {
  // The disk thread checks the block's own tag before writing it.
  received_ += a.data.value();
  piod::Block b{a.slot, a.data, FileOffset(a.h.offset)};
  b.in_file = a.in_file;
  // A block spliced whole into the file, or discarded, leaves the disk thread nothing to write:
  // it is handed over lazily, waking that thread once a quarter of the pool waits (a futex wake,
  // its wait and an eventfd round trip back per batch, not per block: on a clear upload of 2 GiB
  // at one stream, xdfsd made 517 futex calls instead of 3,753). At once for the file's last
  // block, and while fewer than half the slots are free, so that neither the channels nor the
  // sender's window (this side's pool) wait for a batch to fill. Never a stall: fewer than a
  // quarter of the slots wait unwoken, so a sender whose window is full has been acknowledged
  // (every quarter) or will be once the woken ones are back.
  const std::uint32_t slots = pipe_.slots();
  const bool nothing_to_write = skip_ || (splice_file_ && a.in_file == a.data.value());
  if (nothing_to_write && !params_.open_ended && params_.limits.empty() && slots >= 8)
    pipe_.to_disk_lazily(b, slots / 4, received_ == end_ || free_slots_.size() < slots / 2);
  else
    pipe_.to_disk(b);
  if (!params_.limits.empty()) {
    // The block has arrived: it is paid for now (only bytes that came are charged), and the
    // channel reads its next one once the rate allows; TCP holds the rest back meanwhile.
    const auto wait = pace(a.data.value());
    if (wait > std::chrono::steady_clock::duration::zero()) {
      auto& t = *pace_[a.ch->index()];
      t.expires_after(wait);
      t.async_wait([this, ch = a.ch](const xdsi::ErrorCode& ec) {
        if (ec || machine_.state() != State::transferring) return;
        touch();  // waiting for the rate is not a stall
        read_loop(*ch);
      });
      return;
    }
  }
  read_loop(*a.ch);
}

void Receiver::on_disk() {
  piod::Block b;
  bool any = false, back = false;
  std::vector<piod::Block> again;
  while (pipe_.from_disk(b)) {
    free_slots_.push_back(b.slot);
    back = true;
    if (b.retry) {  // not written: its digest did not match
      again.push_back(b);
      continue;
    }
    done_bytes_ += b.length.value();
    if (!refetched_.empty()) refetched_.erase(b.offset.value());  // asked again and now written
    any = true;
  }
  if (!back) return;
  touch();
  for (const auto& r : again) {
    // It has not arrived after all: it may come again, at most max_refetches times.
    const auto end = after(r.offset, r.length);
    if (!end || !seen_.erase(r.offset.value(), end->value()))
      return fail(errc::internal, fmt::format("a rejected block at offset {} was never received", r.offset.value()), false, true);
    received_ -= r.length.value();
    if (refetched_.size() >= pipe_.slots() && !refetched_.count(r.offset.value()))
      return fail(errc::protocol_error,
                  fmt::format("more blocks failed their digests than the window holds (the last at offset {})",
                              r.offset.value()),
                  false, true);
    if (++refetched_[r.offset.value()] > max_refetches) {
      Failure f(errc::integrity_error,
                fmt::format("the block at offset {} did not match its digest {} times", r.offset.value(), max_refetches + 1));
      f.offset = r.offset;
      return fail(std::move(f), true);
    }
    Arrival a;
    a.h.offset = r.offset.value();
    on(TransferEvent::block_rejected, a);
    if (machine_.finished()) return;
  }
  // Freed slots take the channels that waited for one.
  while (!parked_.empty() && !free_slots_.empty()) {
    Parked p = parked_.back();
    parked_.pop_back();
    read_block(*p.ch, p.h);
    if (machine_.finished()) return;  // its header was judged (to splice it) and failed it
  }
  if (any) on(TransferEvent::block_written);
  maybe_complete();
}

void Receiver::send_nack(const Arrival& a) { tell_sender(wire::ChannelEvent::nack, a.h.offset); }

void Receiver::on_noop() {
  pipe_.flush_to_disk();  // blocks handed over lazily go to the disk thread now: the answer waits for them
  // Alive only while this side owes nothing: every block that came is written (a disk thread
  // stuck on a FIFO nobody reads is a stall, whatever the sender says) and acknowledged.
  if (!parked_.empty() || done_bytes_ != received_ || acked_sent_ != done_bytes_ || told_unsent_ != 0) return;
  touch();
  tell_sender(wire::ChannelEvent::noop, 0);  // the answer: the sender's watchdog sees this side alive
}

void Receiver::send_ack() {
  // A stream's end may be a whole block that says nothing: all that came is acknowledged once
  // written, or the sender (which ends once everything is acknowledged) would wait for ever.
  const bool caught_up = params_.open_ended && done_bytes_ == received_;
  if (done_bytes_ - acked_sent_ < ack_every_ && done_bytes_ != end_ && !caught_up) return;
  if (done_bytes_ == acked_sent_) return;
  acked_sent_ = done_bytes_;
  tell_sender(wire::ChannelEvent::ack, acked_sent_);
}

void Receiver::tell_sender(wire::ChannelEvent event, std::uint64_t offset) {
  FrameHeader h;
  h.event = event;
  h.offset = offset;
  auto& ch = *channels_.front();
  ++told_unsent_;
  ch.send(h, std::vector<std::uint8_t>{}, [this, &ch, event](const xdsi::ErrorCode& ec) {
    --told_unsent_;
    if (machine_.finished()) return;
    if (ec) return channel_error(ch, ec);
    if (event == wire::ChannelEvent::ack) on(TransferEvent::ack_sent);
    maybe_finish();
  });
}

void Receiver::maybe_complete() {
  if (machine_.state() != State::transferring) return;
  if (eofr_count_ != channels_.size()) return;
  if (received_ != end_)
    return fail(errc::size_mismatch,
                "sender ended after " + std::to_string(received_) + " of " + std::to_string(end_) + " bytes", false,
                true);
  if (done_bytes_ != end_) return;  // disk still writing
  // A stream's digest takes its size now: every block is back from the disk thread.
  if (manifest_ && !manifest_->size_known() && !manifest_->set_size(end_))
    return fail(errc::internal, "the stream's digest does not take its size", false, true);
  on(TransferEvent::all_received);
}

void Receiver::commit() {
  // All slots are back, so the disk thread is idle: stop it before the file is made final.
  writer_.reset();
  // Every block matched its digest; the list of them must be the one the sender hashed.
  if (!digests_agree()) return;
  // Every payload is in: nothing goes into the file by splice after it is made final.
  if (splice_file_) splice_file_->revoke();
  if (auto st = host_.commit(); !st) return fail(st.code, st.message, false, true);
  if (skip_ || splice_file_) {
    std::string fallback;
    std::size_t copied = 0;
    for (const auto& ch : channels_)
      if (!ch->skip_fallback().empty() && ++copied == 1) fallback = ch->skip_fallback();
    if (copied) fallback = fmt::format("; read instead on {} of {} channels: {}", copied, channels_.size(), fallback);
    if (splice_file_ && !splice_file_->refusal().empty()) fallback += "; read instead from then on: " + splice_file_->refusal();
    const auto spliced = channel_total(&xdsi::Channel::zero_copy_in_bytes) - zero_copy_in_from_;
    host_.debug(fmt::format("zero copy in: {} bytes by splice{}", spliced, fallback));
  }
  // EOFR back on every channel, with the bytes committed: this side is done with the transfer
  // there, and the channel is ready for the session's next operation.
  eofr_everywhere(end_);
}

// Done when the EOFRs (and any ACK) have left: the file is committed, the channels are clear.
void Receiver::maybe_finish() {
  if (machine_.state() != State::draining || eofr_unsent_ != 0 || told_unsent_ != 0 || writer_) return;
  on(TransferEvent::committed);
}

std::optional<DataLength> Receiver::stream_block(const FrameHeader& h, std::string& why) {
  const auto data = unframed(FrameLength(h.length), tag());  // on_header checked it
  const std::uint64_t at = h.offset, n = data ? data->value() : 0, bs = params_.block_size;
  if (n == 0 || at % bs != 0) {
    why = "not one of the stream's blocks";
    return std::nullopt;
  }
  if (at > params_.file_size || n > params_.file_size - at) {
    too_long();
    return std::nullopt;
  }
  const std::uint64_t e = at + n;
  if (end_ != piod::BlockPipe::no_end) {
    if (e > end_ || (n < bs && e != end_)) {
      why = fmt::format("the stream ends at {}", end_);
      return std::nullopt;
    }
  } else if (n < bs) {  // the short block is the last
    if (seen_.overlaps(e, UINT64_MAX)) {
      why = "a short block before blocks that came already";
      return std::nullopt;
    }
    end_ = e;
  }
  return data;
}

void Receiver::too_long() {
  fail(errc::limit_exceeded, fmt::format("the stream is longer than the {} bytes this server takes for it", params_.file_size),
       false, true);
}

bool Receiver::stream_eofr(const xdsi::Channel& ch, const FrameHeader& h) {
  if (h.offset > params_.file_size) {
    too_long();
    return false;
  }
  if ((end_ != piod::BlockPipe::no_end && h.offset != end_) || seen_.overlaps(h.offset, UINT64_MAX)) {
    fail(errc::protocol_error,
         fmt::format("EOFR on channel {} ends the stream at {}; its blocks say {}", ch.index(), h.offset,
                     end_ != piod::BlockPipe::no_end ? std::to_string(end_) : "it goes on"),
         false, true);
    return false;
  }
  end_ = h.offset;
  return true;
}

}  // namespace xdfs::xftsm
