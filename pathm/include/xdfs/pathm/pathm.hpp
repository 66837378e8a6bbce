// xPathM: remote path operations and directory trees. Not built yet: the server refuses
// Mode::path in the handshake with a clear error until this layer lands.
#pragma once

namespace xdfs::pathm {

/// True once the path mode is implemented and servers accept Mode::path.
bool available() noexcept;

}  // namespace xdfs::pathm
