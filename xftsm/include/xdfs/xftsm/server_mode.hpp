// xFTSM on the server: file uploads and downloads as operations of the framework's sessions.
#pragma once

#include "xdfs/server.hpp"

namespace xdfs::xftsm {

/// The two modes (upload, download) a server adds to its runtime::Modes.
runtime::Modes server_modes();

}  // namespace xdfs::xftsm
