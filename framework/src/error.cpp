#include "xdfs/error.hpp"

#include <cerrno>

namespace xdfs {
namespace {

class Category final : public std::error_category {
public:
  const char* name() const noexcept override { return "xdfs"; }
  std::string message(int v) const override { return to_string(static_cast<errc>(v)); }
};

}  // namespace

const std::error_category& category() noexcept {
  static const Category cat;
  return cat;
}

const char* to_string(errc e) noexcept {
  switch (e) {
    case errc::ok: return "ok";
    case errc::bad_argument: return "bad argument";
    case errc::connection_refused: return "connection refused";
    case errc::connection_failed: return "connection failed";
    case errc::protocol_error: return "protocol error";
    case errc::bad_version: return "unsupported protocol version";
    case errc::no_such_file: return "no such file";
    case errc::permission_denied: return "permission denied";
    case errc::path_escape: return "path escapes the server root";
    case errc::disk_full: return "disk full";
    case errc::io_error: return "I/O error";
    case errc::peer_aborted: return "peer aborted";
    case errc::timeout: return "timed out";
    case errc::limit_exceeded: return "limit exceeded";
    case errc::bad_channel: return "bad channel";
    case errc::not_regular_file: return "not a regular file";
    case errc::size_mismatch: return "size mismatch";
    case errc::shutting_down: return "server shutting down";
    case errc::is_directory: return "is a directory";
    case errc::internal: return "internal error";
    case errc::state_violation: return "state machine violation";
    case errc::cancelled: return "cancelled";
    case errc::auth_failed: return "authentication failed";
    case errc::integrity_error: return "integrity check failed";
    case errc::insecure_key_file: return "insecure key file";
    case errc::not_supported: return "not supported";
    case errc::session_ended: return "session ended";
  }
  return "unknown error";
}

errc errc_from_wire(std::uint32_t v) noexcept {
  // An exception header always reports a failure: "ok" there is as invalid as an unknown code,
  // and must never let a peer turn a failed transfer into a success.
  if (v == 0 || v > static_cast<std::uint32_t>(last_errc)) return errc::protocol_error;
  return static_cast<errc>(v);
}

errc errc_from_errno(int err) noexcept {
  switch (err) {
    case ENOENT: case ENOTDIR: return errc::no_such_file;
    case EACCES: case EPERM: case EROFS: return errc::permission_denied;
    case ENOSPC: case EDQUOT: case EFBIG: return errc::disk_full;
    case EXDEV: case ELOOP: return errc::path_escape;
    case EISDIR: return errc::is_directory;
    case ECONNREFUSED: return errc::connection_refused;
    case ECONNRESET: case EPIPE: return errc::peer_aborted;
    case ETIMEDOUT: return errc::timeout;
    default: return errc::io_error;
  }
}

Recovery recovery(errc e) noexcept {
  switch (e) {
    // The connection went, or carried something that was not the peer's: a new one may work.
    case errc::connection_refused:  // a server restarting
    case errc::connection_failed:
    case errc::peer_aborted:
    case errc::timeout:
    case errc::shutting_down:
    case errc::integrity_error:     // a frame changed on the way (the keys are not in doubt)
    case errc::session_ended:
      return Recovery::reconnect;
    // The server is busy or the file moved under the sender: the same request later may work.
    case errc::limit_exceeded:
    case errc::size_mismatch:
      return Recovery::retry;
    // Nothing changes by trying again.
    case errc::ok:
    case errc::bad_argument:
    case errc::protocol_error:      // the peer's software is wrong; it will be wrong again
    case errc::bad_version:
    case errc::no_such_file:
    case errc::permission_denied:
    case errc::path_escape:
    case errc::disk_full:
    case errc::io_error:
    case errc::bad_channel:
    case errc::not_regular_file:
    case errc::is_directory:
    case errc::internal:
    case errc::state_violation:
    case errc::cancelled:
    case errc::auth_failed:
    case errc::insecure_key_file:
    case errc::not_supported:
      return Recovery::give_up;
  }
  return Recovery::give_up;
}

const char* to_string(Recovery r) noexcept {
  switch (r) {
    case Recovery::retry: return "retry";
    case Recovery::reconnect: return "reconnect";
    case Recovery::give_up: return "give-up";
  }
  return "?";
}

Error::Error(const Failure& f) : Error(f.code, f.message) {
  operation_ = f.operation;
  channel_ = f.channel;
  offset_ = f.offset;
  once_ = f.once;
}

Error::Error(errc code, const std::string& context)
    : std::runtime_error(context.empty() ? std::string(to_string(code))
                                         : std::string(to_string(code)) + ": " + context),
      code_(code),
      context_(context) {}

}  // namespace xdfs
