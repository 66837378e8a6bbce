// xFTSM on the server: upload and download sessions under the server runtime.
#pragma once

#include "xdfs/server.hpp"

namespace xdfs::xftsm {

/// The factory xdfsd plugs into xdfs::Server: one xFTSM session per session GUID.
runtime::HandlerFactory server_factory();

}  // namespace xdfs::xftsm
