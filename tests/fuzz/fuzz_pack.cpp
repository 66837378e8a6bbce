// libFuzzer harness for relay packs (relay/src/pack.hpp): a host writes out a pack that any
// master, or a host upstream, made. Whatever the bytes, unpack writes only below the pack's
// directory, fails with one clean line, and never reads or allocates beyond the pack.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "../../relay/src/pack.hpp"
#include "xdfs/text.hpp"

namespace fs = std::filesystem;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const fs::path top = [] {
    char templ[] = "/tmp/xdfs-fuzz-pack-XXXXXX";
    if (!::mkdtemp(templ)) std::abort();
    return fs::path(templ);
  }();
  fs::remove_all(top / "root");
  fs::create_directories(top / "root/in");
  const int mem = ::memfd_create("pack", MFD_CLOEXEC);
  if (mem < 0 || (size && ::write(mem, data, size) != static_cast<ssize_t>(size))) std::abort();
  xdfs::files::Fd pack(mem);
  xdfs::files::Fd root(::open((top / "root").c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  {
    xdfs::pathm::TreeWriter writer(root.get(), "fuzz", false, 65536, 1, 022, 1 << 20);
    const auto u = xdfs::relay_detail::unpack(pack.get(), size, writer, "in", 1 << 20);
    if (u.code == xdfs::errc::ok ? !u.message.empty() : !xdfs::text::is_clean(u.message)) __builtin_trap();
    if (u.bytes > size) __builtin_trap();
  }
  for (const auto& e : fs::recursive_directory_iterator(top))
    if (e.path() != top / "root" && e.path().string().rfind((top / "root/in").string(), 0) != 0) __builtin_trap();
  return 0;
}
