// XDSI: the socket interface, the one place that knows the transport is TCP over Boost.Asio.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <system_error>
#include <vector>

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

/// "host:port" of the socket's peer, or "?" when it has none.
std::string peer_name(const tcp::socket& s);

/// Parses "HOST:PORT", "[v6]:PORT" or "HOST" (with default_port).
bool parse_host_port(const std::string& text, std::uint16_t default_port, std::string& host, std::uint16_t& port);

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

  /// Reads one frame header. A header that does not decode is reported as protocol_error with
  /// the reason in last_error_text().
  void async_read_header(HeaderHandler h);
  /// Reads exactly dst.size() payload bytes.
  void async_read_payload(std::span<std::uint8_t> dst, Handler h);

  /// Queues a frame whose payload the caller keeps alive until h runs.
  void send(const wire::FrameHeader& hdr, std::span<const std::uint8_t> payload, Handler h);
  /// Queues a frame that owns its payload.
  void send(const wire::FrameHeader& hdr, std::vector<std::uint8_t> payload, Handler h = {});
  /// Queues bytes that are not a frame (the channel preamble).
  void send_raw(std::vector<std::uint8_t> bytes, Handler h = {});
  /// Queues a control frame of the given event with a Cap'n Proto payload.
  void send_control(wire::Event ev, std::vector<std::uint8_t> payload, Handler h = {});

  /// Sends FIN after what is queued has left; reading goes on until close().
  void shutdown_send() noexcept;
  /// After a final frame: cancels pending reads, sends FIN, then reads and discards until the
  /// peer closes too, closes and calls done. Closing outright with unread input would reset
  /// the connection and could destroy that last frame before the peer reads it.
  void linger_close(std::function<void()> done);
  /// Closes the socket; pending handlers complete with operation_aborted.
  void close() noexcept;

  const std::string& last_error_text() const noexcept { return error_text_; }

private:
  struct Out {
    wire::HeaderBytes header;
    bool raw = false;  // no header: payload only
    std::vector<std::uint8_t> owned;
    std::span<const std::uint8_t> payload;
    Handler done;
  };
  void pump();

  tcp::socket socket_;
  std::uint32_t index_;
  wire::HeaderBytes in_header_{};
  std::deque<Out> out_;
  std::string error_text_;
  std::array<std::uint8_t, 4096> drain_{};
};

}  // namespace xdfs::xdsi
