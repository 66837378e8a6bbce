#include "xdfs/xdsi.hpp"

#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>

#include <fmt/core.h>

#include <fcntl.h>
#include <sys/ioctl.h>
#include <ifaddrs.h>
#include <sys/mman.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <limits>
#include <stdexcept>
#include <utility>

namespace xdfs::xdsi {

ErrorCode apply(tcp::socket& s, const SocketOptions& o) {
  ErrorCode ec;
  if (o.nodelay) s.set_option(tcp::no_delay(true), ec);
  if (!ec && o.tcp_window > 0) {
    s.set_option(asio::socket_base::send_buffer_size(static_cast<int>(o.tcp_window)), ec);
    if (!ec) s.set_option(asio::socket_base::receive_buffer_size(static_cast<int>(o.tcp_window)), ec);
  }
  return ec;
}

ErrorCode apply(Channel& ch, const SocketOptions& o) {
  const ErrorCode ec = apply(ch.socket(), o);
  if (!ec && o.tcp_window > 0) {
    // The buffer granted, not the one asked for (net.core.rmem_max caps it); the kernel reports
    // it doubled, and about half of it is window.
    int granted = 0;
    socklen_t len = sizeof granted;
    std::size_t window = o.tcp_window;
    if (::getsockopt(ch.socket().native_handle(), SOL_SOCKET, SO_RCVBUF, &granted, &len) == 0 && granted > 0)
      window = std::min(window, static_cast<std::size_t>(granted) / 2);
    ch.set_payload_wake(std::min(ch.payload_wake(), window / 4));
  }
  return ec;
}

namespace detail {

void LowWater::wait_for(int fd, std::size_t left) noexcept {
  const std::size_t want = std::min(left, wake_);
  set(fd, want >= floor ? static_cast<int>(want) : 1);  // at most wake_: an int
}

void LowWater::set(int fd, int bytes) noexcept {
  if (bytes == mark_ || fd < 0) return;
  // Refused (a filter, a closed socket): mark_ keeps what the socket has, so a refused raise
  // only costs wake-ups, and a refused reset is tried again at the next read's end and when
  // the channel is detached.
  if (::setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &bytes, sizeof bytes) == 0) mark_ = bytes;
}

}  // namespace detail

std::string peer_name(const tcp::socket& s) {
  ErrorCode ec;
  auto ep = s.remote_endpoint(ec);
  if (ec) return "?";
  auto addr = ep.address().to_string();
  if (ep.address().is_v6()) addr = "[" + addr + "]";
  return addr + ":" + std::to_string(ep.port());
}

bool parse_host_port(const std::string& text, std::uint16_t default_port, std::string& host, std::uint16_t& port) {
  std::string h = text;
  std::string p;
  if (!h.empty() && h.front() == '[') {
    auto close = h.find(']');
    if (close == std::string::npos) return false;
    if (close + 1 < h.size()) {
      if (h[close + 1] != ':') return false;
      p = h.substr(close + 2);
    }
    h = h.substr(1, close - 1);
  } else if (auto colon = h.rfind(':'); colon != std::string::npos) {
    if (h.find(':') != colon) return false;  // bare IPv6 needs brackets
    p = h.substr(colon + 1);
    h = h.substr(0, colon);
  }
  if (h.empty()) return false;
  port = default_port;
  if (!p.empty() || text.back() == ':') {
    unsigned v = 0;
    auto [ptr, ec] = std::from_chars(p.data(), p.data() + p.size(), v);
    if (ec != std::errc() || ptr != p.data() + p.size() || v > 65535) return false;
    port = static_cast<std::uint16_t>(v);
  }
  host = h;
  return true;
}

Channel::Channel(tcp::socket socket, std::uint32_t index) : socket_(std::move(socket)), index_(index) {}

Failure Channel::failure(const ErrorCode& ec, std::string_view peer) const {
  namespace e = asio::error;
  Failure f;
  f.channel = ChannelIndex(index_);
  const auto on = fmt::format("channel {}", index_);
  if (ec == boost::system::errc::protocol_error) {
    f.code = errc::protocol_error;
    f.message = fmt::format("{}: {} sent {}", on, peer, error_text_);
  } else if (ec == source_failure) {
    f.code = source_code_;
    f.message = fmt::format("{}: {}", on, source_text_);
  } else if (ec == integrity_failure) {
    f.code = errc::integrity_error;
    f.message = fmt::format("{}: {}", on, error_text_);
  } else if (ec == e::operation_aborted) {
    f.code = errc::cancelled;
    f.message = on + ": cancelled";
  } else if (ec == e::timed_out) {
    f.code = errc::timeout;
    f.message = on + ": timed out";
    f.peer_gone = true;
  } else {
    f.code = errc::peer_aborted;
    f.from_peer = f.peer_gone = true;
    if (ec == e::eof)
      f.message = fmt::format("{} closed by the {}", on, peer);
    else if (ec == e::connection_reset || ec == e::broken_pipe)
      f.message = fmt::format("{} reset by the {}", on, peer);
    else
      f.message = fmt::format("{}: {}", on, ec.message());
  }
  return f;
}

namespace {

// What a non-blocking read's result r means, as asio's reads would say it: bytes came; try again
// (interrupted); none for now; or the read has ended (the peer closed, or an error, in ec).
enum class ReadResult { bytes, again, empty, ended };

ReadResult read_result(ssize_t r, ErrorCode& ec) {
  if (r > 0) return ReadResult::bytes;
  if (r == 0) {
    ec = asio::error::eof;
    return ReadResult::ended;
  }
  if (errno == EINTR) return ReadResult::again;
  if (errno == EAGAIN || errno == EWOULDBLOCK) return ReadResult::empty;
  ec = ErrorCode(errno, asio::error::get_system_category());
  return ReadResult::ended;
}

// A read that takes what the socket holds in one turn of the loop: step(ec, woke) reads what is
// there and says true once the read has ended (done, or ec set); it runs at once, then again
// each time the socket is readable, and `done` gets the outcome. asio::async_read takes every
// partial read through the event loop (a scheduler turn and an epoll_wait each: about 16 per
// 1 MiB block on loopback). A channel's loop runs on one thread (the class's rule), so no
// readiness is lost between the read that found nothing and the wait. A close while it waits
// ends it with operation_aborted. `done` never runs inside the starting call.
// A payload's read (`lw` given) raises the socket's low-water mark while it waits, and puts it
// back once it ends: done, failed or cancelled (detail::LowWater). As every handler here, this
// one runs only while its channel lives (a channel's owner runs the loop out before freeing it).
template <typename Step>
struct WhileReadable {
  tcp::socket* s;
  Step step;
  Channel::Handler done;
  detail::LowWater* lw;

  void operator()(const ErrorCode& waited) {
    ErrorCode ec = waited;
    if (ec || step(ec, true)) {
      if (lw && s->is_open()) lw->reset(s->native_handle());
      return done(ec);
    }
    s->async_wait(tcp::socket::wait_read, std::move(*this));
  }
};

template <typename Step>
void while_readable(tcp::socket& s, Step step, Channel::Handler done, detail::LowWater* lw = nullptr) {
  ErrorCode ec;
  if (step(ec, false)) return asio::post(s.get_executor(), [done = std::move(done), ec] { done(ec); });
  s.async_wait(tcp::socket::wait_read, WhileReadable<Step>{&s, std::move(step), std::move(done), lw});
}

// Reads exactly n bytes into p. A socket found closed ends it with bad_descriptor, as asio's
// reads do. A payload's read passes its channel's low-water mark.
void read_exactly(tcp::socket& s, std::uint8_t* p, std::size_t n, Channel::Handler h,
                  detail::LowWater* lw = nullptr) {
  while_readable(
      s,
      [&s, p, n, lw, got = std::size_t(0)](ErrorCode& ec, bool) mutable {
        while (got < n) {
          if (!s.is_open()) {
            ec = asio::error::bad_descriptor;
            return true;
          }
          const ssize_t r = ::recv(s.native_handle(), p + got, n - got, MSG_DONTWAIT);
          switch (read_result(r, ec)) {
            case ReadResult::bytes: got += static_cast<std::size_t>(r); break;
            case ReadResult::again: break;
            case ReadResult::empty:
              if (lw) lw->wait_for(s.native_handle(), n - got);
              return false;
            case ReadResult::ended: return true;
          }
        }
        return true;
      },
      std::move(h), lw);
}

// Bytes of splice pipes this process holds now, over all threads, and how many 1 MiB ones it
// may hold: a quarter of the per-user soft limit on pipe pages (fs.pipe-user-pages-soft; 64 MiB
// by default, 0 for none). Past that limit an unprivileged user's new pipes get two pages each,
// its other processes' too, so a server with many sessions at once must not spend it alone.
std::atomic<std::size_t> pipe_bytes_held{0};

std::size_t large_pipe_budget() {
  static const std::size_t budget = [] {
    constexpr std::size_t none = std::numeric_limits<std::size_t>::max();
    unsigned long long pages = 0;
    if (std::FILE* f = std::fopen("/proc/sys/fs/pipe-user-pages-soft", "re")) {
      if (std::fscanf(f, "%llu", &pages) != 1) pages = 0;
      std::fclose(f);
    }
    const long pg = ::sysconf(_SC_PAGESIZE);
    const std::size_t page = pg > 0 ? static_cast<std::size_t>(pg) : 4096;
    if (pages == 0 || pages > none / page) return none;
    return static_cast<std::size_t>(pages) * page / 4;
  }();
  return budget;
}

// The pipe through which a network thread splices the payloads it skips (async_skip_payload):
// one a thread, shared by the channels of its loop, since each empties it before it returns.
// A failure to make one is tried again at the next payload: out of descriptors is not forever.
struct SkipPipe {
  int r = -1;
  int w = -1;
  std::size_t bytes = 0;  // counted in pipe_bytes_held
  std::string error;      // why there is none

  SkipPipe() = default;
  SkipPipe(const SkipPipe&) = delete;
  SkipPipe& operator=(const SkipPipe&) = delete;
  ~SkipPipe() { drop(); }
  bool ready() {
    if (r >= 0) return true;
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
      error = std::string("no pipe to splice through: ") + std::strerror(errno);
      return false;
    }
    r = fds[0];
    w = fds[1];
    // A whole block of the default size in one splice each way, within the budget above: a
    // third of the splices of a 256 KiB pipe on a clear upload (perf stat of xdfsd, 2 GiB at
    // one stream: 5,481 against 16,991), fewer of the ACKs each splice from the socket may
    // send, and 5% less time for a 2 GiB file either way at one stream here. Else 256 KiB, or
    // the default 64 KiB where the kernel refuses more (fs.pipe-max-size for an unprivileged
    // user). The pipe holds page references between two splices, not copies.
    // The room for a large one is taken before it is made, so that threads making theirs at
    // once cannot all take the last of it; what the pipe holds in the end replaces it.
    constexpr std::size_t mib = std::size_t{1} << 20;
    const std::size_t budget = large_pipe_budget();
    std::size_t held = pipe_bytes_held.load(std::memory_order_relaxed);
    bool large = false;
    while (held <= budget && budget - held >= mib &&
           !(large = pipe_bytes_held.compare_exchange_weak(held, held + mib, std::memory_order_relaxed))) {
    }
    if (!large || ::fcntl(w, F_SETPIPE_SZ, static_cast<int>(mib)) < 0) (void)::fcntl(w, F_SETPIPE_SZ, 256 << 10);
    const int got = ::fcntl(w, F_GETPIPE_SZ);
    bytes = got > 0 ? static_cast<std::size_t>(got) : 0;
    pipe_bytes_held.fetch_add(bytes, std::memory_order_relaxed);
    if (large) pipe_bytes_held.fetch_sub(mib, std::memory_order_relaxed);
    return true;
  }
  void drop() noexcept {
    if (r >= 0) ::close(r);
    if (w >= 0) ::close(w);
    r = w = -1;
    pipe_bytes_held.fetch_sub(bytes, std::memory_order_relaxed);
    bytes = 0;
  }
};

SkipPipe& skip_pipe() {
  thread_local SkipPipe p;
  return p;
}

}  // namespace

std::size_t splice_pipe_bytes() {
  auto& pipe = skip_pipe();
  return pipe.ready() ? pipe.bytes : 0;
}

std::size_t splice_pipe_bytes_held() noexcept { return pipe_bytes_held.load(std::memory_order_relaxed); }

namespace {

// Errors of splice(2) that say it cannot be used here (this socket or file system takes none,
// no memory for it, a system call filter refuses it): reading instead serves. Any other error
// is the payload's own failure.
bool splice_refused(int e) noexcept {
  return e == EINVAL || e == ENOSYS || e == EOPNOTSUPP || e == EPERM || e == EACCES || e == ENOMEM;
}

// /dev/null, opened once it can be (-1 until then).
int dev_null() {
  static std::atomic<int> fd{-1};
  if (const int f = fd.load(std::memory_order_acquire); f >= 0) return f;
  const int f = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
  if (f < 0) return -1;
  int none = -1;
  if (fd.compare_exchange_strong(none, f, std::memory_order_acq_rel)) return f;
  ::close(f);  // another thread's is there
  return none;
}

}  // namespace

void Channel::async_read_header(HeaderHandler h) {
  read_exactly(socket_, in_header_.data(), in_header_.size(),
               [this, h = std::move(h)](const ErrorCode& ec) {
                 if (ec) return h(ec, {});
                 auto hdr = wire::decode(std::span<const std::uint8_t, wire::frame_header_size>(in_header_), &error_text_);
                 if (!hdr) return h(make_error_code(boost::system::errc::protocol_error), {});
                 in_checked_ = false;
                 if (guard_ && hdr->length == 0) {
                   // Nothing else will be read for this frame: check it now.
                   return read_tag_then({}, [this, h, hv = *hdr](const ErrorCode& ec2) {
                     in_checked_ = !ec2;
                     h(ec2, hv);
                   });
                 }
                 h({}, *hdr);
               });
}

void Channel::async_read_payload(std::span<std::uint8_t> dst, Handler h) {
  if (in_checked_ && dst.empty()) {
    // An empty frame already checked with its header: there is nothing more to read.
    in_checked_ = false;
    return asio::post(socket_.get_executor(), [h = std::move(h)] { h({}); });
  }
  read_exactly(
      socket_, dst.data(), dst.size(),
      [this, dst, h = std::move(h)](const ErrorCode& ec) mutable { check_payload(ec, dst, std::move(h)); },
      &low_water_);
}

void Channel::async_read_payload_part(std::span<std::uint8_t> dst, Handler h) {
  read_exactly(socket_, dst.data(), dst.size(), std::move(h), &low_water_);
}

SpliceFile::SpliceFile(int fd) noexcept : fd_(fd >= 0 ? ::fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1) {
  if (fd_ < 0) {
    refusal_ = std::string("no descriptor to splice into: ") + std::strerror(fd >= 0 ? errno : EBADF);
  } else if (const int flags = ::fcntl(fd_, F_GETFL); flags < 0) {
    refusal_ = std::string("the file's flags cannot be read: ") + std::strerror(errno);
    revoke();
  } else if (flags & O_APPEND) {
    refusal_ = "the file is open to append";  // splice(2) refuses it; writes at offsets would not land there
    revoke();
  }
}

SpliceFile::~SpliceFile() { revoke(); }

void SpliceFile::revoke() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void Channel::async_skip_payload(std::size_t n, Handler h) {
  async_splice_payload(n, nullptr, 0, {}, [h = std::move(h)](const ErrorCode& ec, std::size_t) { h(ec); });
}

void Channel::async_splice_payload(std::size_t n, std::shared_ptr<SpliceFile> file, std::uint64_t offset,
                                   std::span<std::uint8_t> rest, SpliceHandler h) {
  auto fail_now = [this, &h](ErrorCode ec) {
    asio::post(socket_.get_executor(), [h = std::move(h), ec] { h(ec, 0); });
  };
  // A file's offsets are signed 64-bit: the payload must end below that. A caller's mistake
  // either way, never the peer's.
  if (!clear_frames(static_cast<wire::ChannelEvent>(in_header_[0])) ||
      (file && (rest.size() != n || offset > std::uint64_t(INT64_MAX) - n))) {
    source_code_ = errc::internal;
    source_text_ = fmt::format("a payload of {} bytes at offset {} cannot go by splice", n, offset);
    return fail_now(source_failure);
  }
  // splice(2) from a socket blocks unless the socket itself is non-blocking.
  ErrorCode ec;
  if (!socket_.native_non_blocking()) socket_.native_non_blocking(true, ec);
  if (ec) return fail_now(ec);
  auto to = std::make_shared<SpliceTo>();
  to->file = std::move(file);
  to->offset = offset;
  to->rest = rest;
  to->n = n;
  while_readable(
      socket_, [this, to, left = n](ErrorCode& e, bool woke) mutable { return splice_some(*to, left, e, woke); },
      // Nothing to check, but the guard counts the frame.
      [this, to, h = std::move(h)](const ErrorCode& e) mutable {
        check_payload(e, {}, [to, h = std::move(h)](const ErrorCode& e2) { h(e2, to->in_file); });
      },
      &low_water_);
}

bool Channel::splice_some(SpliceTo& to, std::size_t& left, ErrorCode& ec, bool woke) {
  if (to.file && to.file->fd() < 0) {
    // Revoked: the transfer has ended, and nothing more goes into its file (an ended transfer
    // ignores the error; a live one would fail on it, not wait).
    source_code_ = errc::internal;
    source_text_ = "the file was closed under a splice";
    ec = source_failure;
    return true;
  }
  auto& pipe = skip_pipe();
  const int null = to.file ? -1 : dev_null();
  // Read instead for the rest of this payload (a channel that once could not splice its
  // socket stays so; so does a file that once refused a splice).
  auto read_instead = [&](std::string why) {
    to.copying = true;
    if (skip_fallback_.empty()) skip_fallback_ = std::move(why);
  };
  if (!skip_fallback_.empty() || (to.file && !to.file->ready())) to.copying = true;
  if (!to.copying && !pipe.ready()) read_instead(pipe.error);
  if (!to.copying && !to.file && null < 0) read_instead(std::string("cannot open /dev/null: ") + std::strerror(errno));
  bool moved = false;  // since the wake-up
  while (left > 0) {
    if (!socket_.is_open()) {
      ec = asio::error::bad_descriptor;
      return true;
    }
    const int fd = socket_.native_handle();
    const std::size_t done = to.n - left;
    ssize_t got;
    if (!to.copying) {
      got = ::splice(fd, nullptr, pipe.w, nullptr, left, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
      if (got < 0 && splice_refused(errno)) {
        // Not this socket, no memory for it, or a system call filter refuses it: read it.
        read_instead(std::string("the socket does not splice: ") + std::strerror(errno));
        continue;
      }
      if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && woke && !moved) {
        // Readable, yet nothing to splice: splicing stops at urgent data, so waiting would
        // never end. recv reads past it (the frames after it will not make sense, and say so).
        const int again = errno;
        int at_mark = 0;
        if (::ioctl(fd, SIOCATMARK, &at_mark) == 0 && at_mark) {
          to.copying = true;
          continue;
        }
        errno = again;
      }
      // Out of the pipe at once: it is empty again whenever this returns.
      if (got > 0) {
        if (!drain_pipe(to, done, static_cast<std::size_t>(got), ec)) return true;
        moved = true;
      }
    } else if (to.file) {
      got = ::recv(fd, to.rest.data() + done, left, MSG_DONTWAIT);
    } else {
      thread_local std::vector<std::uint8_t> scratch(64 * 1024);
      got = ::recv(fd, scratch.data(), std::min(left, scratch.size()), MSG_DONTWAIT);
    }
    switch (read_result(got, ec)) {
      case ReadResult::bytes: left -= static_cast<std::size_t>(got); break;
      case ReadResult::again: break;
      case ReadResult::empty:
        low_water_.wait_for(fd, left);
        return false;
      case ReadResult::ended: return true;
    }
  }
  return true;
}

bool Channel::drain_pipe(SpliceTo& to, std::size_t done, std::size_t in, ErrorCode& ec) {
  auto& pipe = skip_pipe();
  // The file's refusal is told once the pipe is empty: nothing that may throw runs while it
  // holds bytes, which would otherwise start the thread's next payload.
  int refused = 0;
  for (std::size_t out_done = 0; out_done < in;) {
    const std::size_t at_payload = done + out_done, want = in - out_done;
    ssize_t out;
    const char* what;  // where stranded bytes were going
    if (to.file && !to.copying) {
      auto at = static_cast<loff_t>(to.offset + at_payload);  // below INT64_MAX: checked at the start
      out = ::splice(pipe.r, nullptr, to.file->fd(), &at, want, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
      if (out < 0 && errno == EINTR) continue;
      if (out < 0 && splice_refused(errno)) {
        // The file system (or a filter) takes no splice: what the pipe holds, and the rest of
        // the payload, are read into their place in the block instead, and so are the
        // transfer's next payloads.
        refused = errno;
        to.copying = true;
        continue;
      }
      if (out > 0) {
        to.in_file += static_cast<std::size_t>(out);
        zero_copy_in_bytes_ += static_cast<std::uint64_t>(out);
        out_done += static_cast<std::size_t>(out);
        continue;
      }
      // Out of space, an I/O error, past the largest file: the file's failure, not the peer's.
      const int err = out < 0 ? errno : EIO;
      pipe.drop();
      source_code_ = errc_from_errno(err);
      source_text_ = fmt::format("write at offset {}: {}", to.offset + at_payload, std::strerror(err));
      ec = source_failure;
      return false;
    } else if (to.file) {
      out = ::read(pipe.r, to.rest.data() + at_payload, want);
      if (out < 0 && errno == EINTR) continue;
      if (out > 0) {
        out_done += static_cast<std::size_t>(out);
        continue;
      }
      what = "would not come back out of its pipe";
    } else {
      out = ::splice(pipe.r, nullptr, dev_null(), nullptr, want, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
      if (out < 0 && errno == EINTR) continue;
      if (out > 0) {
        zero_copy_in_bytes_ += static_cast<std::uint64_t>(out);
        out_done += static_cast<std::size_t>(out);
        continue;
      }
      what = "skipped by splice would not go into /dev/null";
    }
    // Bytes are stranded in the pipe: it goes (the next payload makes another), and so does
    // this frame. A failure of this side's, not the peer's.
    const int err = out < 0 ? errno : EIO;
    pipe.drop();
    source_code_ = errc::io_error;
    source_text_ = fmt::format("a payload {}: {}", what, std::strerror(err));
    ec = source_failure;
    return false;
  }
  if (refused) to.file->refuse(std::string("the file does not take splice: ") + std::strerror(refused));
  return true;
}

void Channel::check_payload(const ErrorCode& ec, std::span<std::uint8_t> payload, Handler h) {
  if (ec || !guard_) return h(ec);
  read_tag_then(payload, std::move(h));
}

void Channel::async_check_payload(std::span<std::uint8_t> whole, Handler h) {
  if (!guard_) return asio::post(socket_.get_executor(), [h = std::move(h)] { h({}); });
  read_tag_then(whole, std::move(h));
}

void Channel::read_tag_then(std::span<std::uint8_t> payload, Handler h) {
  const std::size_t n = guard_->tag_bytes(static_cast<wire::ChannelEvent>(in_header_[0]));
  auto check = [this, payload, h = std::move(h)](const ErrorCode& ec) {
    if (ec) return h(ec);
    if (!guard_->open(in_header_, payload, in_tag_.data())) {
      error_text_ = "frame failed its integrity check (modified, replayed, reordered or a frame was dropped)";
      return h(integrity_failure);
    }
    h({});
  };
  if (n == 0) return check({});
  read_exactly(socket_, in_tag_.data(), n, std::move(check));
}

void Channel::enqueue(Out o) {
  if (guard_ && !o.raw) {
    o.tag_len = guard_->tag_bytes(static_cast<wire::ChannelEvent>(o.header[0]));
    guard_->seal(o.header, o.payload, o.tag.data());
  }
  out_.push_back(std::move(o));
  if (out_.size() == 1) pump();
}

void Channel::send(const wire::FrameHeader& hdr, std::span<std::uint8_t> payload, Handler h) {
  enqueue(Out{wire::encode(hdr), false, {}, payload, std::move(h)});
}

void Channel::send(const wire::FrameHeader& hdr, std::vector<std::uint8_t> payload, Handler h) {
  Out o{wire::encode(hdr), false, std::move(payload), {}, std::move(h)};
  o.payload = o.owned;
  enqueue(std::move(o));
}

void Channel::send_raw(std::vector<std::uint8_t> bytes, Handler h) {
  Out o{{}, true, std::move(bytes), {}, std::move(h)};
  o.payload = o.owned;
  enqueue(std::move(o));
}

void Channel::send_control(wire::ChannelEvent ev, std::vector<std::uint8_t> payload, Handler h) {
  wire::FrameHeader hdr;
  hdr.event = ev;
  hdr.length = static_cast<std::uint32_t>(payload.size());
  send(hdr, std::move(payload), std::move(h));
}

namespace {
// wire::max_block_size of address space, read-only and never written: each page read maps the
// kernel's one shared zero page, so a block of any size sent from here reads the same 4 KiB.
// Empty if it cannot be mapped.
std::span<std::uint8_t> zero_pages() noexcept {
  static const std::span<std::uint8_t> region = []() -> std::span<std::uint8_t> {
    void* p = ::mmap(nullptr, wire::max_block_size, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return {};
    (void)::madvise(p, wire::max_block_size, MADV_NOHUGEPAGE);  // 4 KiB, not a 2 MiB zero page
    return {static_cast<std::uint8_t*>(p), wire::max_block_size};
  }();
  return region;
}
}  // namespace

asio::ip::address unmapped(const asio::ip::address& a) {
  if (a.is_v6() && a.to_v6().is_v4_mapped()) return asio::ip::make_address_v4(asio::ip::v4_mapped, a.to_v6());
  return a;
}

bool Channel::peer_on_this_host() const noexcept {
  ErrorCode ec;
  const auto remote = socket_.remote_endpoint(ec);
  if (ec) return false;
  const auto local = socket_.local_endpoint(ec);
  if (ec) return false;
  const auto peer = unmapped(remote.address());
  if (peer.is_loopback() || peer == unmapped(local.address())) return true;
  // Another address of this host's (a second one on lo, an interface's own). Its interfaces'
  // addresses, not whether a socket could bind it: with ip_nonlocal_bind any address can be.
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return false;
  bool here = false;
  for (const ifaddrs* i = list; i && !here; i = i->ifa_next) {
    if (!i->ifa_addr) continue;
    if (i->ifa_addr->sa_family == AF_INET && peer.is_v4()) {
      const auto& a = *reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
      here = ntohl(a.sin_addr.s_addr) == peer.to_v4().to_uint();
    } else if (i->ifa_addr->sa_family == AF_INET6 && peer.is_v6()) {
      const auto& a = *reinterpret_cast<const sockaddr_in6*>(i->ifa_addr);
      const auto bytes = peer.to_v6().to_bytes();
      here = std::memcmp(a.sin6_addr.s6_addr, bytes.data(), bytes.size()) == 0 &&
             (peer.to_v6().scope_id() == 0 || a.sin6_scope_id == 0 || a.sin6_scope_id == peer.to_v6().scope_id());
    }
  }
  ::freeifaddrs(list);
  return here;
}

bool Channel::zeros_available(std::uint32_t length) noexcept { return length <= zero_pages().size(); }

void Channel::send_zeros(const wire::FrameHeader& hdr, Handler h) {
  if (!clear_frames(hdr.event)) throw std::logic_error("send_zeros: frames of this event are sealed");
  const auto zeros = zero_pages();
  if (hdr.length > zeros.size()) throw std::logic_error("send_zeros: more bytes than the zero mapping holds");
  zero_page_bytes_ += hdr.length;
  enqueue(Out{wire::encode(hdr), false, {}, zeros.first(hdr.length), std::move(h)});
}

void Channel::send_file(const wire::FrameHeader& hdr, int fd, std::uint64_t offset, std::uint32_t length,
                        std::span<std::uint8_t> trailer, Handler h) {
  if (!clear_frames(hdr.event)) throw std::logic_error("send_file: frames of this event are sealed");
  // A file that shrank below this block fails before the frame is queued (and counted by the
  // guard, whose counter the peer follows): the channel stays whole, and the failure reaches
  // the peer on it. (One that shrinks later is met by sendfile, with half the frame out.)
  struct stat sb {};
  const bool stat_ok = ::fstat(fd, &sb) == 0;
  if (!stat_ok || static_cast<std::uint64_t>(sb.st_size) < offset + length) {
    source_code_ = stat_ok ? errc::size_mismatch : errc_from_errno(errno);
    source_text_ = stat_ok ? fmt::format("source file shrank to {} bytes while being sent", sb.st_size)
                           : fmt::format("the file being sent: {}", std::strerror(errno));
    asio::post(socket_.get_executor(), [h = std::move(h)] { h(source_failure); });
    return;
  }
  Out o{wire::encode(hdr), false, {}, trailer, std::move(h)};
  o.file_fd = fd;
  o.file_offset = offset;
  o.file_length = length;
  enqueue(std::move(o));
}

void Channel::pump() {
  // std::deque keeps element addresses stable on push_back, so the front's buffers stay valid.
  Out& o = out_.front();
  if (o.file_fd >= 0) return pump_file();
  std::array<asio::const_buffer, 3> bufs{asio::buffer(o.header, o.raw ? 0 : o.header.size()),
                                         asio::buffer(o.payload.data(), o.payload.size()),
                                         asio::buffer(o.tag.data(), o.tag_len)};
  // As much as the socket takes in each system call: asio's own completion conditions
  // (transfer_all, transfer_exactly) hand it 64 KiB at a time, which is 16 sendmsg calls and as
  // many turns of the loop (each with its epoll_wait) per 1 MiB block.
  const auto whole = [](const ErrorCode& ec, std::size_t) -> std::size_t {
    return ec ? 0 : std::numeric_limits<std::size_t>::max();
  };
  asio::async_write(socket_, bufs, whole, [this](const ErrorCode& ec, std::size_t) { complete_front(ec); });
}

namespace {

// Errors of sendfile(2) that come from the file rather than from the connection (which, for
// anything else, is what failed).
bool file_errno(int e) noexcept {
  switch (e) {
    case EIO: case EINVAL: case EOVERFLOW: case EBADF: case ESPIPE: case ENOSYS: case EOPNOTSUPP: case ENXIO:
      return true;
    default:
      return false;
  }
}

// SIGPIPE held back on this thread while it is alive: sendfile(2) has no MSG_NOSIGNAL, and a
// peer that reset its connection must fail one channel, not end the process. One that became
// pending meanwhile is taken back before the old mask returns (none if SIGPIPE was blocked
// already: then it is the thread's own business).
class NoSigpipe {
public:
  NoSigpipe() noexcept {
    ::sigemptyset(&pipe_);
    ::sigaddset(&pipe_, SIGPIPE);
    ::pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
    was_blocked_ = ::sigismember(&old_, SIGPIPE) == 1;
  }
  ~NoSigpipe() {
    if (!was_blocked_) {
      sigset_t pending;
      const timespec zero{};
      while (::sigpending(&pending) == 0 && ::sigismember(&pending, SIGPIPE) == 1) {
        if (::sigtimedwait(&pipe_, nullptr, &zero) < 0 && errno != EINTR) break;
      }
    }
    ::pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }

private:
  sigset_t pipe_{};
  sigset_t old_{};
  bool was_blocked_ = false;
};

void set_cork(int s, bool on) noexcept {
  const int v = on ? 1 : 0;
  (void)::setsockopt(s, IPPROTO_TCP, TCP_CORK, &v, sizeof v);
}

}  // namespace

void Channel::pump_file() {
  Out& o = out_.front();
  const int s = socket_.native_handle();
  // Completions never run inside the call that queued the frame (as with asio's own writes).
  auto finish = [this](const ErrorCode& e) { asio::post(socket_.get_executor(), [this, e] { complete_front(e); }); };
  auto source_failed = [&](errc code, std::string why) {
    source_code_ = code;
    source_text_ = std::move(why);
    finish(source_failure);
  };
  if (!socket_.native_non_blocking()) {  // asio's own record of it: no system call
    ErrorCode ec;
    socket_.native_non_blocking(true, ec);
    if (ec) return finish(ec);
  }
  // Header, data and trailer leave as full segments: corked until the frame (and any file
  // frame queued behind it) is out.
  if (!corked_) {
    set_cork(s, true);
    corked_ = true;
  }
  const std::size_t head = o.header.size();
  const std::size_t body = head + o.file_length;
  const std::size_t total = body + o.payload.size();
  NoSigpipe quiet;
  while (o.written < total) {
    ssize_t r;
    if (o.written < head) {
      r = ::send(s, o.header.data() + o.written, head - o.written, MSG_NOSIGNAL);
    } else if (o.written < body) {
      const std::uint64_t at = o.file_offset + (o.written - head);
      auto off = static_cast<off_t>(at);
      r = ::sendfile(s, o.file_fd, &off, body - o.written);
      if (r == 0 || (r < 0 && file_errno(errno))) {
        const int err = errno;
        // Part of the frame is out: nothing more can follow it on this channel (an exception
        // would read as the rest of the block). It closes; the others carry the failure.
        close();
        return source_failed(r == 0 ? errc::size_mismatch : errc_from_errno(err),
                             r == 0 ? fmt::format("source file shrank to {} bytes while being sent", at)
                                    : fmt::format("sending the file from offset {}: {}", at, std::strerror(err)));
      }
      if (r > 0) zero_copy_bytes_ += static_cast<std::uint64_t>(r);
    } else {
      r = ::send(s, o.payload.data() + (o.written - body), total - o.written, MSG_NOSIGNAL);
    }
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        socket_.async_wait(tcp::socket::wait_write, [this](const ErrorCode& e) {
          if (e) return complete_front(e);
          pump_file();
        });
        return;
      }
      const ErrorCode ec(errno, boost::system::system_category());
      if (o.written > 0) close();  // half a frame out: nothing may follow it on this channel
      return finish(ec);
    }
    o.written += static_cast<std::size_t>(r);
  }
  finish({});
}

void Channel::complete_front(const ErrorCode& ec) {
  Handler done = std::move(out_.front().done);
  out_.pop_front();
  // Uncorked once no file frame follows: what is held leaves now.
  if (corked_ && (ec || out_.empty() || out_.front().file_fd < 0)) {
    set_cork(socket_.native_handle(), false);
    corked_ = false;
  }
  if (ec) {
    // Fail everything queued behind it too: the stream is broken.
    std::deque<Out> rest;
    rest.swap(out_);
    if (done) done(ec);
    for (auto& r : rest)
      if (r.done) r.done(ec);
    return;
  }
  if (!out_.empty()) pump();
  if (done) done(ec);
}

void Channel::shutdown_send() noexcept {
  ErrorCode ignored;
  socket_.shutdown(tcp::socket::shutdown_send, ignored);
}

void Channel::linger_close(std::function<void()> done) {
  ErrorCode ignored;
  socket_.cancel(ignored);
  socket_.shutdown(tcp::socket::shutdown_send, ignored);
  struct Drain {
    Channel* self;
    std::function<void()> done;
    void operator()(const ErrorCode& ec, std::size_t) {
      if (!ec && self->socket_.is_open()) {
        self->socket_.async_read_some(asio::buffer(*self->drain_), std::move(*this));
        return;
      }
      self->close();
      if (done) done();
    }
  };
  if (!socket_.is_open()) {
    if (done) done();
    return;
  }
  if (!drain_) drain_ = std::make_unique<std::array<std::uint8_t, 4096>>();
  socket_.async_read_some(asio::buffer(*drain_), Drain{this, std::move(done)});
}

void Channel::close() noexcept {
  ErrorCode ignored;
  socket_.shutdown(tcp::socket::shutdown_both, ignored);
  socket_.close(ignored);
}

Channel::Detached::Detached(Detached&& o) noexcept
    : fd(std::exchange(o.fd, -1)), protocol(o.protocol), index(o.index), guard(std::move(o.guard)) {}

Channel::Detached& Channel::Detached::operator=(Detached&& o) noexcept {
  if (this != &o) {
    if (fd >= 0) ::close(fd);
    fd = std::exchange(o.fd, -1);
    protocol = o.protocol;
    index = o.index;
    guard = std::move(o.guard);
  }
  return *this;
}

Channel::Detached::~Detached() {
  if (fd >= 0) ::close(fd);
}

Channel::Detached Channel::detach() {
  Detached d;
  ErrorCode ec;
  auto ep = socket_.local_endpoint(ec);
  d.protocol = ec ? tcp::v4() : ep.protocol();
  d.index = index_;
  d.guard = std::move(guard_);
  // The adopting channel takes the socket as waking at one byte.
  if (socket_.is_open()) low_water_.reset(socket_.native_handle());
  d.fd = socket_.is_open() ? socket_.release(ec) : -1;
  if (ec) d.fd = -1;
  return d;
}

std::unique_ptr<Channel> Channel::adopt(asio::io_context& io, Detached d) {
  tcp::socket s(io);
  ErrorCode ec;
  s.assign(d.protocol, d.fd, ec);
  if (ec) return nullptr;  // d still owns (and closes) the descriptor
  d.fd = -1;
  auto ch = std::make_unique<Channel>(std::move(s), d.index);
  ch->guard_ = std::move(d.guard);
  return ch;
}

void tell_and_close(ChannelList& channels, const wire::ExceptionHeader& ex, asio::steady_timer& linger,
                    std::chrono::milliseconds wait, std::function<void()> closed) {
  auto payload = wire::encode(ex);
  // Counts the channels still open; `closed` runs once, when the last closes or the linger ends.
  // Once it has run, nothing here touches `linger` again: its owner may be going.
  struct Left {
    std::size_t open = 0;
    std::function<void()> closed;
    bool over = false;
    void end() {
      if (over) return;
      over = true;
      if (closed) std::exchange(closed, nullptr)();
    }
  };
  auto left = std::make_shared<Left>();
  left->closed = std::move(closed);
  for (auto& ch : channels)
    if (ch && ch->open()) ++left->open;
  if (left->open == 0) return left->end();
  linger.expires_after(wait);
  linger.async_wait([&channels, left](const ErrorCode& ec) {
    if (ec || left->over) return;  // every peer closed in time
    for (auto& ch : channels)
      if (ch) ch->close();
    left->end();
  });
  for (auto& ch : channels) {
    if (!ch || !ch->open()) continue;
    ch->send_control(wire::ChannelEvent::exception, payload, [c = ch.get(), left, &linger](const ErrorCode&) {
      c->linger_close([left, &linger] {
        if (--left->open != 0 || left->over) return;
        linger.cancel();
        left->end();
      });
    });
  }
}

}  // namespace xdfs::xdsi
