// Everything a program that moves files with xDFS needs, in one include: the client API for
// files (xFTSM) and remote paths (xPathM) over sessions, and the server with its standard modes.
#pragma once

#include "xdfs/client.hpp"
#include "xdfs/pathm/server_mode.hpp"
#include "xdfs/remote_fs.hpp"
#include "xdfs/server.hpp"
#include "xdfs/session.hpp"
#include "xdfs/xftsm/server_mode.hpp"

namespace xdfs {

/// The modes xdfsd offers: file upload and download (xFTSM) and path operations (xPathM).
inline runtime::Modes standard_modes() {
  auto modes = xftsm::server_modes();
  modes.push_back(pathm::server_mode());
  return modes;
}

}  // namespace xdfs
