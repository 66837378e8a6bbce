// How both ends of a path session name what ended a read on a channel.
#pragma once

#include <fmt/core.h>

#include <string>

#include "xdfs/error.hpp"
#include "xdfs/xdsi.hpp"

namespace xdfs::pathm {

struct ReadFailure {
  errc code;
  std::string message;
  bool peer_gone;  ///< the peer closed or reset the channel (nothing can be told to it)
};

/// `peer` is "client" or "server".
inline ReadFailure read_failure(const xdsi::Channel& ch, const xdsi::ErrorCode& ec, const char* peer) {
  if (ec == boost::system::errc::protocol_error)
    return {errc::protocol_error, std::string(peer) + " sent " + ch.last_error_text(), false};
  if (ec == xdsi::integrity_failure)
    return {errc::integrity_error, fmt::format("a frame on channel {} failed its check", ch.index()), false};
  return {errc::peer_aborted, fmt::format("{} closed channel {} ({})", peer, ch.index(), ec.message()), true};
}

}  // namespace xdfs::pathm
