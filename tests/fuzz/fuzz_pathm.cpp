// libFuzzer harness for the xPathM message parsers: every path request a client sends and every
// reply a server sends goes through these functions before anything else looks at it.
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "xdfs/pathm/messages.hpp"
#include "xdfs/text.hpp"
#include "xdfs/wire.hpp"

namespace {

namespace pm = xdfs::pathm;

bool same_entries(const std::vector<pm::Entry>& a, const std::vector<pm::Entry>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto &x = a[i], &y = b[i];
    if (x.path != y.path || x.type != y.type || x.size != y.size || x.mode != y.mode || x.mtime_ns != y.mtime_ns ||
        x.target != y.target || x.offset != y.offset || x.file_id != y.file_id || x.code != y.code ||
        x.message != y.message || !std::equal(x.data.begin(), x.data.end(), y.data.begin(), y.data.end()))
      return false;
  }
  return true;
}

// What the decoder promises of every entry it returns.
void check_entries(const std::vector<pm::Entry>& v, std::span<const std::uint8_t> bytes) {
  if (v.size() > pm::max_entries) __builtin_trap();
  for (const auto& e : v) {
    if (e.path.size() > 4096 || e.target.size() > 4096 || e.path.find('\0') != std::string::npos) __builtin_trap();
    if (e.size > xdfs::wire::max_file_size || e.offset > xdfs::wire::max_file_size || e.mode > 07777) __builtin_trap();
    if (!xdfs::text::is_clean(e.message)) __builtin_trap();  // shown to a user: one printable line
    if (e.data.data() && (e.data.data() < bytes.data() || e.data.data() + e.data.size() > bytes.data() + bytes.size()))
      __builtin_trap();  // data must point into the message
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  // Frames arrive in word-aligned buffers; so do these.
  std::vector<std::uint64_t> words((size - 1 + 7) / 8);
  std::memcpy(words.data(), data + 1, size - 1);
  std::span<const std::uint8_t> bytes(reinterpret_cast<const std::uint8_t*>(words.data()), size - 1);
  std::string why;
  // Whatever decodes, encodes and decodes again to the same thing.
  if (data[0] % 2 == 0) {
    if (auto r = pm::decode_request(bytes, &why)) {
      check_entries(r->entries, bytes);
      if (r->path.size() > 4096 || r->to.size() > 4096 || r->mode > 07777) __builtin_trap();
      auto again = pm::encode(*r);
      auto r2 = pm::decode_request(again.bytes(), &why);
      if (!r2 || r2->id != r->id || r2->op != r->op || r2->path != r->path || r2->to != r->to ||
          r2->recursive != r->recursive || r2->offset != r->offset || r2->length != r->length || r2->mode != r->mode ||
          !same_entries(r2->entries, r->entries))
        __builtin_trap();
    }
  } else {
    if (auto r = pm::decode_reply(bytes, &why)) {
      check_entries(r->entries, bytes);
      if (!xdfs::text::is_clean(r->message) || static_cast<std::uint32_t>(r->code) > static_cast<std::uint32_t>(xdfs::last_errc))
        __builtin_trap();
      auto again = pm::encode(*r);
      auto r2 = pm::decode_reply(again.bytes(), &why);
      if (!r2 || r2->id != r->id || r2->code != r->code || r2->message != r->message || r2->last != r->last ||
          r2->algorithm != r->algorithm || r2->digest != r->digest || !same_entries(r2->entries, r->entries))
        __builtin_trap();
    }
  }
  return 0;
}
