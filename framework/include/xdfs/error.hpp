// Error codes shared by every layer, and the exception the public API throws.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>

#include "xdfs/types.hpp"

namespace xdfs {

/// Every failure xDFS reports, on the wire (as an exception header's code) and locally.
/// The numeric values travel in exception headers: never renumber, only append.
enum class errc : std::uint32_t {
  ok = 0,
  bad_argument = 1,          ///< a caller or command-line argument is invalid
  connection_refused = 2,    ///< nothing listens at the server address
  connection_failed = 3,     ///< the server could not be reached (DNS, routing, timeout)
  protocol_error = 4,        ///< the peer sent bytes that are not valid xDFS
  bad_version = 5,           ///< the peer speaks another protocol version
  no_such_file = 6,          ///< the named file or directory does not exist
  permission_denied = 7,     ///< the file system refused access
  path_escape = 8,           ///< a path would leave the server root (.., absolute path, symlink)
  disk_full = 9,             ///< no space left on the device
  io_error = 10,             ///< a read or write on a file failed
  peer_aborted = 11,         ///< the peer closed or reset a channel mid-transfer
  timeout = 12,              ///< a bounded wait ran out (channels that never arrived, idle session)
  limit_exceeded = 13,       ///< a server limit was hit (sessions, channels)
  bad_channel = 14,          ///< a channel does not fit its session (duplicate, extra, mismatched)
  not_regular_file = 15,     ///< the file is a directory, device or other non-regular file
  size_mismatch = 16,        ///< the received bytes do not add up to the announced size
  shutting_down = 17,        ///< the server is stopping
  is_directory = 18,         ///< the path names a directory where a file is needed
  internal = 19,             ///< a bug: an invariant did not hold
  state_violation = 20,      ///< a state machine was fed an event its table does not allow
  cancelled = 21,            ///< the local user stopped the transfer
  auth_failed = 22,          ///< a key was not accepted (unknown client, unknown or changed server, bad join proof)
  integrity_error = 23,      ///< a frame failed its check: modified, replayed, reordered or dropped
  insecure_key_file = 24,    ///< a private key file others can read
  not_supported = 25,        ///< the server does not offer what was asked (a mode it disabled)
  session_ended = 26,        ///< the session's channels are gone (an earlier failure ended it); a new one is needed
};

/// The highest code defined; wire codes above it are unknown.
inline constexpr errc last_errc = errc::session_ended;

const std::error_category& category() noexcept;

inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), category()};
}

/// Maps an errno value to the closest xDFS code (ENOSPC -> disk_full, ...).
errc errc_from_errno(int err) noexcept;

/// Short stable name of a code ("disk full"), used as the head of one-line messages.
const char* to_string(errc e) noexcept;

/// What a caller does next about a failure: its class, decided by the code alone, so that a
/// retry loop (xduc's, a storage service's) never has to parse a message.
enum class Recovery : std::uint8_t {
  retry,      ///< transient: the same request again, after a pause, may succeed
  reconnect,  ///< the connection ended or cannot be trusted: a new session, after a pause, may succeed
  give_up,    ///< nothing changes until someone fixes the cause (a missing file, a refused key, a full disk)
};

/// The class of a code. Every code has one; ok is give_up (there is nothing to retry).
Recovery recovery(errc e) noexcept;
/// "retry", "reconnect", "give-up".
const char* to_string(Recovery r) noexcept;

/// A failure as it travels between the layers (socket, security, mode, session, caller): the
/// code, what failed in words, and where. XDSI makes one from a socket or frame error
/// (xdsi::Channel::failure), the engines from what they check, an exception header from what
/// the peer reported; the public API throws it as an Error.
struct Failure {
  errc code = errc::ok;
  std::string message;                   ///< what failed, without the code's name
  std::string operation;                 ///< the operation it ended ("upload 'a.iso'", "session"), where known
  std::optional<ChannelIndex> channel;   ///< the channel it happened on, where one did
  std::optional<FileOffset> offset;      ///< the file offset it concerns, where one does
  bool from_peer = false;                ///< the peer reported it, or ended the channel
  bool peer_gone = false;                ///< the peer closed or reset the channel: nothing can be told to it
  /// What the transfer moved cannot be moved again without repeating or losing some of it: its
  /// source was a stream (read once), or its destination was written as the data came (standard
  /// output, a device, a FIFO at either end). A new attempt would start over there: not retried.
  bool once = false;

  Failure() = default;
  Failure(errc c, std::string m, bool peer = false) : code(c), message(std::move(m)), from_peer(peer) {}
  Recovery recovery() const noexcept { return xdfs::recovery(code); }
  explicit operator bool() const noexcept { return code != errc::ok; }
};

/// The exception the public API throws: a code plus context that says what failed
/// (which operation, channel, file or offset), and the class of what to do next.
class Error : public std::runtime_error {
public:
  Error(errc code, const std::string& context);
  explicit Error(const Failure& f);
  errc code() const noexcept { return code_; }
  /// The context without the code's name.
  const std::string& context() const noexcept { return context_; }
  /// The operation it ended ("upload 'a.iso'", "download 'b'", "session"), where known.
  const std::string& operation() const noexcept { return operation_; }
  /// The channel and the file offset the failure happened at, where known.
  std::optional<ChannelIndex> channel() const noexcept { return channel_; }
  std::optional<FileOffset> offset() const noexcept { return offset_; }
  Recovery recovery() const noexcept { return xdfs::recovery(code_); }
  /// Failure::once: no new attempt, whatever the class.
  bool once() const noexcept { return once_; }

private:
  errc code_;
  bool once_ = false;
  std::string context_;
  std::string operation_;
  std::optional<ChannelIndex> channel_;
  std::optional<FileOffset> offset_;
};

/// A failed operation or session; remote() tells whether the server reported the error.
class TransferError : public Error {
public:
  TransferError(errc code, const std::string& context, bool remote) : Error(code, context), remote_(remote) {}
  explicit TransferError(const Failure& f) : Error(f), remote_(f.from_peer) {}
  bool remote() const noexcept { return remote_; }

private:
  bool remote_;
};

/// Maps an exception header's code; ok and unknown codes become protocol_error, so a hostile
/// peer can neither make us print garbage nor report its failure as success.
errc errc_from_wire(std::uint32_t v) noexcept;

}  // namespace xdfs

template <>
struct std::is_error_code_enum<xdfs::errc> : std::true_type {};
