#include "xdfs/pathm/pathm.hpp"

namespace xdfs::pathm {

bool available() noexcept { return false; }

}  // namespace xdfs::pathm
