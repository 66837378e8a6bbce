// xPathM on the server: a path session's requests as an operation of the framework's sessions.
#pragma once

#include "xdfs/server.hpp"

namespace xdfs::pathm {

/// The path mode a server adds to its runtime::Modes.
runtime::ModeEntry server_mode();

}  // namespace xdfs::pathm
