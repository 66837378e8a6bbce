// XDSI: the socket interface, the one place that knows the transport is TCP over Boost.Asio.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "xdfs/error.hpp"
#include "xdfs/wire.hpp"

namespace xdfs::xdsi {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using ErrorCode = boost::system::error_code;

/// Socket options applied to every channel.
struct SocketOptions {
  std::uint32_t tcp_window = 0;  ///< SO_SNDBUF and SO_RCVBUF in bytes; 0 keeps kernel autotuning
  bool nodelay = true;           ///< control frames must not wait for Nagle
};

/// Applies options; returns the first failure.
ErrorCode apply(tcp::socket& s, const SocketOptions& o);

/// An IPv4 address arriving mapped into IPv6 (::ffff:a.b.c.d) as the IPv4 one; others as they are.
asio::ip::address unmapped(const asio::ip::address& a);

/// The capacity in bytes of the pipe this thread splices received payloads through (made now if
/// it has none; 0 if none can be made): 1 MiB while this process's splice pipes together stay
/// within a quarter of fs.pipe-user-pages-soft, else 256 KiB, or the kernel's default where it
/// refuses more.
std::size_t splice_pipe_bytes();
/// The bytes of every thread's splice pipe in this process now.
std::size_t splice_pipe_bytes_held() noexcept;

namespace detail {
/// A channel's receive low-water mark (SO_RCVLOWAT). While a payload read waits it is raised to
/// what that read still needs, up to wake() bytes, so that the event loop wakes the read once
/// that much is there instead of at every segment that arrives (fewer wake-ups and system calls
/// a byte; Linux wakes it earlier anyway when the receive window runs low or memory is short,
/// and at once on FIN or an error). It is back at 1 byte once the read is done, fails or is
/// cancelled, for every other read and for a parked channel's wait. Below 16 KiB a wake-up
/// costs about what a raise would save: not raised.
class LowWater {
public:
  static constexpr std::size_t default_wake = 256 * 1024;  // what a splice pipe holds here
  static constexpr std::size_t floor = 16 * 1024;
  static constexpr std::size_t max_wake = 64u << 20;
  std::size_t wake() const noexcept { return wake_; }
  void set_wake(std::size_t bytes) noexcept { wake_ = std::min(bytes, max_wake); }
  /// Before a payload read of fd waits for `left` more bytes.
  void wait_for(int fd, std::size_t left) noexcept;
  /// Once that read has ended.
  void reset(int fd) noexcept { set(fd, 1); }

private:
  void set(int fd, int bytes) noexcept;
  std::size_t wake_ = default_wake;
  int mark_ = 1;
};
}  // namespace detail

/// "host:port" of the socket's peer, or "?" when it has none.
std::string peer_name(const tcp::socket& s);

/// Parses "HOST:PORT", "[v6]:PORT" or "HOST" (with default_port).
bool parse_host_port(const std::string& text, std::uint16_t default_port, std::string& host, std::uint16_t& port);

/// What the security layer plugs into a channel: every frame passes through it once the
/// channel is authenticated. Sealing happens when a frame is queued, so frames are sealed in
/// the order they go on the wire.
class FrameGuard {
public:
  virtual ~FrameGuard() = default;
  /// Tag bytes that follow the payload of a frame of this event (0 when it is not protected).
  virtual std::size_t tag_bytes(wire::ChannelEvent e) const noexcept = 0;
  /// Protects an outgoing frame: may encrypt the payload in place; writes tag_bytes() bytes.
  /// A frame with no tag (tag_bytes() == 0) may have a read-only payload: it is not written.
  virtual void seal(const wire::HeaderBytes& header, std::span<std::uint8_t> payload, std::uint8_t* tag) = 0;
  /// Checks (and decrypts in place) an incoming frame; false if it fails.
  virtual bool open(const wire::HeaderBytes& header, std::span<std::uint8_t> payload, const std::uint8_t* tag) = 0;
};

/// Error a read reports when a frame fails the guard's check.
inline const ErrorCode integrity_failure = make_error_code(boost::system::errc::bad_message);
/// Error a write reports when the file a frame's data comes from failed (send_file): it shrank,
/// or reading it failed. Channel::failure() tells which.
inline const ErrorCode source_failure = make_error_code(boost::system::errc::io_error);

/// Where Channel::async_splice_payload puts payloads: a file, shared by a transfer's channels.
/// It holds its own descriptor (a dup of the one it is made from), so that what it names can
/// never change under it, and the transfer revokes it when it ends: a splice that wakes up
/// after that (its wait already done when the channel was cancelled) puts nothing anywhere.
class SpliceFile {
public:
  /// Empty (ready() false, refusal() says why) where the descriptor cannot be duplicated.
  explicit SpliceFile(int fd) noexcept;
  ~SpliceFile();
  SpliceFile(const SpliceFile&) = delete;
  SpliceFile& operator=(const SpliceFile&) = delete;
  bool ready() const noexcept { return fd_ >= 0 && refusal_.empty(); }
  int fd() const noexcept { return fd_; }
  /// Closes the descriptor; nothing more goes into the file.
  void revoke() noexcept;
  /// Why payloads are no longer spliced into it ("" while they are); the first reason stays.
  const std::string& refusal() const noexcept { return refusal_; }
  void refuse(std::string why) {
    if (refusal_.empty()) refusal_ = std::move(why);
  }

private:
  int fd_ = -1;
  std::string refusal_;
};

/// One framed, full-duplex xDFS channel. All calls happen on the owning session's thread.
/// Writes are queued, so control frames may be sent while a data block is in flight.
class Channel {
public:
  using Handler = std::function<void(const ErrorCode&)>;
  using HeaderHandler = std::function<void(const ErrorCode&, const wire::FrameHeader&)>;

  Channel(tcp::socket socket, std::uint32_t index);
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  std::uint32_t index() const noexcept { return index_; }
  tcp::socket& socket() noexcept { return socket_; }
  bool open() const noexcept { return socket_.is_open(); }
  /// True while a write is queued or in flight.
  bool sending() const noexcept { return !out_.empty(); }
  std::size_t queued() const noexcept { return out_.size(); }

  /// Payload reads wake once this many bytes are there, or the payload's rest (see
  /// detail::LowWater); 0 or under 16 KiB: at every arrival, as all other reads do.
  void set_payload_wake(std::size_t bytes) noexcept { low_water_.set_wake(bytes); }
  std::size_t payload_wake() const noexcept { return low_water_.wake(); }

  /// From now on every frame is sealed and checked by g.
  void protect(std::unique_ptr<FrameGuard> g) noexcept { guard_ = std::move(g); }
  bool protected_() const noexcept { return static_cast<bool>(guard_); }

  /// Reads one frame header. A header that does not decode is reported as protocol_error with
  /// the reason in last_error_text(). On a protected channel a frame without payload is checked
  /// before the handler runs (integrity_failure if it fails).
  void async_read_header(HeaderHandler h);
  /// Reads exactly dst.size() payload bytes of the frame whose header was just read; on a
  /// protected channel also its tag, then checks and decrypts it in place.
  void async_read_payload(std::span<std::uint8_t> dst, Handler h);
  /// The same in parts, for a payload whose buffer grows as its bytes arrive: reads exactly
  /// dst.size() more payload bytes, unchecked...
  void async_read_payload_part(std::span<std::uint8_t> dst, Handler h);
  /// ...and, once all have arrived, reads the tag and checks (and decrypts) the whole payload.
  void async_check_payload(std::span<std::uint8_t> whole, Handler h);
  /// Zero copy in, for a receiver that discards what it receives (memory mode, /dev/null):
  /// consumes the n payload bytes of the frame whose header was just read without copying them
  /// to user space, by splice(2) from the socket through a pipe into /dev/null. Only for a frame
  /// that goes without a tag (clear_frames()); its guard still counts it. Where the kernel will
  /// not splice the socket it reads them into a scratch buffer instead (skip_fallback() says
  /// why).
  void async_skip_payload(std::size_t n, Handler h);
  /// Zero copy into a file: the n payload bytes of the frame whose header was just read go
  /// from the socket through the thread's pipe into `file` at `offset` on, by splice(2), never
  /// through user space. Only for a frame without a tag (clear_frames()); its guard counts it.
  /// Where the socket will not splice, or the file stops taking splices (its refusal() says
  /// why from then on), the rest of the payload is read into `rest` at its place in the
  /// payload (rest.size() == n) instead. The handler gets how many leading payload bytes are
  /// in the file; the others are in `rest`. Nothing is written once the file is revoked.
  using SpliceHandler = std::function<void(const ErrorCode&, std::size_t in_file)>;
  void async_splice_payload(std::size_t n, std::shared_ptr<SpliceFile> file, std::uint64_t offset,
                            std::span<std::uint8_t> rest, SpliceHandler h);
  /// Payload bytes this channel has moved by splice(2) so far (skipped or into a file).
  std::uint64_t zero_copy_in_bytes() const noexcept { return zero_copy_in_bytes_; }
  /// Why async_skip_payload or async_splice_payload read from the socket instead ("" while
  /// neither has had to).
  const std::string& skip_fallback() const noexcept { return skip_fallback_; }

  /// Queues a frame whose payload the caller keeps alive until h runs. On a protected channel
  /// the payload may be encrypted in place.
  void send(const wire::FrameHeader& hdr, std::span<std::uint8_t> payload, Handler h);
  /// Queues a frame that owns its payload.
  void send(const wire::FrameHeader& hdr, std::vector<std::uint8_t> payload, Handler h = {});
  /// Zero copy: queues a frame whose payload is `length` bytes of the file `fd` at `offset`,
  /// moved from the page cache to the socket by sendfile(2) without passing through user
  /// space, then `trailer` (which the caller keeps alive until h runs). Only for an event whose
  /// frames go without a tag (clear_frames()): nothing here reads the data. A file that ends
  /// before offset + length fails the write with source_failure (size_mismatch).
  void send_file(const wire::FrameHeader& hdr, int fd, std::uint64_t offset, std::uint32_t length,
                 std::span<std::uint8_t> trailer, Handler h);
  /// Queues a frame of hdr.length zero bytes (a memory source's block), sent from one read-only
  /// mapping whose pages are all the kernel's zero page: what the socket copies stays in cache,
  /// as a benchmark sender's one buffer does, and the block's slot is never touched. Only for
  /// an event whose frames go without a tag (clear_frames()), and hdr.length at most what
  /// zeros_available() says.
  void send_zeros(const wire::FrameHeader& hdr, Handler h);
  /// Whether send_zeros() can send `length` bytes (false if the mapping could not be made).
  static bool zeros_available(std::uint32_t length) noexcept;
  /// Payload bytes this channel has queued by send_zeros() so far.
  std::uint64_t zero_page_bytes() const noexcept { return zero_page_bytes_; }
  /// Whether frames of event e leave as they are, with no tag (no guard, or one that passes
  /// them, as xSec's clear mode does data frames).
  bool clear_frames(wire::ChannelEvent e) const noexcept { return !guard_ || guard_->tag_bytes(e) == 0; }
  /// Payload bytes this channel has moved by sendfile(2) so far.
  std::uint64_t zero_copy_bytes() const noexcept { return zero_copy_bytes_; }
  /// Whether the peer is on this host: its address is a loopback one, this end's own, or one
  /// of this host's interfaces' (getifaddrs; a v4-mapped one counts as the IPv4 one). False
  /// when either address is unknown. A few system calls: ask once per peer, not per block.
  bool peer_on_this_host() const noexcept;
  /// Queues bytes that are not a frame (the channel preamble).
  void send_raw(std::vector<std::uint8_t> bytes, Handler h = {});
  /// Queues a control frame of the given event with a Cap'n Proto payload.
  void send_control(wire::ChannelEvent ev, std::vector<std::uint8_t> payload, Handler h = {});

  /// Sends FIN after what is queued has left; reading goes on until close().
  void shutdown_send() noexcept;
  /// After a final frame: cancels pending reads, sends FIN, then reads and discards until the
  /// peer closes too, closes and calls done. Closing outright with unread input would reset
  /// the connection and could destroy that last frame before the peer reads it.
  void linger_close(std::function<void()> done);
  /// Closes the socket; pending handlers complete with operation_aborted.
  void close() noexcept;

  const std::string& last_error_text() const noexcept { return error_text_; }

  /// The one place where what ended a read or a write on this channel (a socket error, a header
  /// that does not decode, a frame that fails its check) becomes an xDFS failure, with this
  /// channel's index: peer_aborted when the peer closed or reset it (peer_gone), protocol_error
  /// or integrity_error (with the reason) when it sent something wrong, timeout, cancelled.
  /// `peer` names the other end in the message ("server", "client").
  Failure failure(const ErrorCode& ec, std::string_view peer = "peer") const;

  /// The channel's socket and protection without its event loop, for another thread's loop to
  /// adopt (the listener authenticates a channel, then hands it to its session's thread). No
  /// operation may be pending. The channel is closed afterwards.
  struct Detached {
    Detached() = default;
    Detached(Detached&& o) noexcept;
    Detached& operator=(Detached&& o) noexcept;
    ~Detached();
    int fd = -1;
    tcp protocol = tcp::v4();
    std::uint32_t index = 0;
    std::unique_ptr<FrameGuard> guard;
  };
  Detached detach();
  /// A channel on `io` from a detached one; call it on the thread that runs `io`.
  static std::unique_ptr<Channel> adopt(asio::io_context& io, Detached d);

private:
  struct Out {
    wire::HeaderBytes header;
    bool raw = false;  // no header: payload only
    std::vector<std::uint8_t> owned;
    std::span<std::uint8_t> payload;
    Handler done;
    std::array<std::uint8_t, 16> tag{};
    std::size_t tag_len = 0;
    // send_file: the data between header and payload (the trailer) comes from this file.
    int file_fd = -1;
    std::uint64_t file_offset = 0;
    std::uint32_t file_length = 0;
    std::size_t written = 0;  // of header, file data and trailer
  };
  void enqueue(Out o);
  void pump();
  /// Writes the front frame of send_file() with non-blocking calls, waiting for the socket
  /// between them; then completes it as pump() does.
  void pump_file();
  void complete_front(const ErrorCode& ec);
  void read_tag_then(std::span<std::uint8_t> payload, Handler h);
  /// The end of a payload's read: h(ec) on an error or without a guard, else its tag is read
  /// and checked.
  void check_payload(const ErrorCode& ec, std::span<std::uint8_t> payload, Handler h);
  /// Where splice_some puts a payload: /dev/null (no file; what is read instead goes into a
  /// scratch buffer), or a file at `offset` with `rest` for what is read instead.
  struct SpliceTo {
    std::shared_ptr<SpliceFile> file;
    std::uint64_t offset = 0;
    std::span<std::uint8_t> rest;
    std::size_t n = 0;        // the payload's bytes
    std::size_t in_file = 0;  // leading payload bytes in the file so far
    bool copying = false;     // read from here to the payload's end
  };
  /// Takes what the socket holds of `left` more payload bytes: true once it has ended (all
  /// taken, or ec set), false when the socket has nothing more for now. `woke`: the socket
  /// was just reported readable.
  bool splice_some(SpliceTo& to, std::size_t& left, ErrorCode& ec, bool woke);
  /// Empties the thread's pipe (`in` bytes, at `done` in the payload) into the target; false
  /// (ec set) if it cannot.
  bool drain_pipe(SpliceTo& to, std::size_t done, std::size_t in, ErrorCode& ec);

  tcp::socket socket_;
  std::uint32_t index_;
  detail::LowWater low_water_;
  wire::HeaderBytes in_header_{};
  bool in_checked_ = false;  // the frame just read was empty and its tag checked with the header
  std::deque<Out> out_;
  std::string error_text_;
  std::unique_ptr<std::array<std::uint8_t, 4096>> drain_;  // only while lingering
  std::array<std::uint8_t, 16> in_tag_{};
  std::unique_ptr<FrameGuard> guard_;
  std::uint64_t zero_copy_bytes_ = 0;
  std::uint64_t zero_copy_in_bytes_ = 0;
  std::uint64_t zero_page_bytes_ = 0;
  std::string skip_fallback_;
  bool corked_ = false;
  errc source_code_ = errc::ok;  // what source_failure stands for, and why
  std::string source_text_;
};

/// Applies options to a channel's socket; a set TCP window also bounds its payload wake to a
/// quarter of the window the kernel granted, so that a sender is not held waiting for the
/// whole window to be read.
ErrorCode apply(Channel& ch, const SocketOptions& o);

/// A session's channels by index (a slot may be empty while its channel has not joined).
using ChannelList = std::vector<std::unique_ptr<Channel>>;

/// Sends an exception header on every open channel and closes each once it has left; `linger`
/// closes the rest after `wait` if the peer does not read. `closed`, if given, runs once every
/// channel is closed (on the loop, or at once if none was open).
void tell_and_close(ChannelList& channels, const wire::ExceptionHeader& ex, asio::steady_timer& linger,
                    std::chrono::milliseconds wait, std::function<void()> closed = {});

}  // namespace xdfs::xdsi
