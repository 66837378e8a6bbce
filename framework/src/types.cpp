#include "xdfs/types.hpp"

#include <botan/system_rng.h>

namespace xdfs {

std::string SessionId::hex() const {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  out.reserve(32);
  for (auto b : bytes) {
    out.push_back(digits[b >> 4]);
    out.push_back(digits[b & 15]);
  }
  return out;
}

SessionId SessionId::random() {
  SessionId id;
  Botan::system_rng().randomize(id.bytes.data(), id.bytes.size());
  return id;
}

const char* to_string(Mode m) noexcept {
  switch (m) {
    case Mode::upload: return "upload";
    case Mode::download: return "download";
    case Mode::path: return "path";
    case Mode::relay: return "relay";
    case Mode::pull: return "pull";
  }
  return "?";
}

}  // namespace xdfs
