// libFuzzer harness for the xPathM message parsers: every path request a client sends and every
// reply a server sends goes through these functions before anything else looks at it.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xdfs/pathm/messages.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  namespace pm = xdfs::pathm;
  // Frames arrive in word-aligned buffers; so do these.
  std::vector<std::uint64_t> words((size - 1 + 7) / 8);
  std::memcpy(words.data(), data + 1, size - 1);
  std::span<const std::uint8_t> bytes(reinterpret_cast<const std::uint8_t*>(words.data()), size - 1);
  std::string why;
  if (data[0] % 2 == 0) {
    if (auto r = pm::decode_request(bytes, &why)) {
      if (r->entries.size() > pm::max_entries || r->path.size() > 4096) __builtin_trap();
      for (const auto& e : r->entries)
        if (e.data.data() && (e.data.data() < bytes.data() || e.data.data() + e.data.size() > bytes.data() + bytes.size()))
          __builtin_trap();  // data must point into the message
      auto again = pm::encode(*r);
      auto r2 = pm::decode_request(again.bytes(), &why);
      if (!r2 || r2->id != r->id || r2->path != r->path || r2->entries.size() != r->entries.size()) __builtin_trap();
    }
  } else {
    if (auto r = pm::decode_reply(bytes, &why)) {
      if (r->code == xdfs::errc::ok && !r->message.empty() && r->message.size() > pm::max_entries) __builtin_trap();
      auto again = pm::encode(*r);
      auto r2 = pm::decode_reply(again.bytes(), &why);
      if (!r2 || r2->id != r->id || r2->entries.size() != r->entries.size()) __builtin_trap();
    }
  }
  return 0;
}
