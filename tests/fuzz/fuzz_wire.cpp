// libFuzzer harness for the frame and control-message parsers: everything a peer can send
// before and after the handshake goes through these functions.
#include <cstddef>
#include <cstdint>
#include <span>

#include "xdfs/text.hpp"
#include "xdfs/wire.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  namespace w = xdfs::wire;
  const std::uint8_t which = data[0] % 8;
  std::span<const std::uint8_t> rest(data + 1, size - 1);
  std::string why;
  switch (which) {
    case 0:
      if (rest.size() >= w::frame_header_size) {
        auto h = w::decode(std::span<const std::uint8_t, w::frame_header_size>(rest.data(), w::frame_header_size), &why);
        if (h) {
          auto again = w::encode(*h);
          auto h2 = w::decode(std::span<const std::uint8_t, w::frame_header_size>(again), &why);
          if (!h2 || h2->length != h->length || h2->offset != h->offset) __builtin_trap();
        }
      }
      break;
    case 1:
      if (auto n = w::decode_negotiation(rest, &why)) {
        if (n->file_size > w::max_file_size || n->window > w::max_file_size || n->remote_path.size() > w::max_path_bytes)
          __builtin_trap();
        // Whatever decodes must encode and decode to the same thing.
        auto again = w::decode_negotiation(w::encode(*n), &why);
        if (!again || !(*again == *n)) __builtin_trap();
      }
      break;
    case 2:
      if (auto r = w::decode_reply(rest, &why)) {
        if (r->file_size > w::max_file_size || r->window > w::max_file_size) __builtin_trap();
        auto again = w::decode_reply(w::encode(*r), &why);
        if (!again || !(*again == *r)) __builtin_trap();
      }
      break;
    case 3:
      if (auto e = w::decode_exception(rest, &why)) {
        // A failure, shown as one printable line of bounded length.
        if (e->code == xdfs::errc::ok || e->message.size() > 4 * 512 || !xdfs::text::is_clean(e->message))
          __builtin_trap();
      }
      break;
    case 5:
      if (auto o = w::decode_opening(rest, &why)) {
        // What decodes keeps the decoder's promises and survives a round trip.
        if (o->protect > 2 || o->cipher > 1 || o->join != (o->channel_index != 0) ||
            o->join_nonce.size() != (o->join ? 32u : 0u))
          __builtin_trap();
        auto again = w::decode_opening(w::encode(*o), &why);
        if (!again || !(*again == *o)) __builtin_trap();
      }
      break;
    case 6:
      if (auto r = w::decode_report(rest, &why)) {
        // A relay host's report: bounded lists, keys and digests of their size, printable lines.
        if (r->skipped.size() > w::max_relay_hops || (r->digest.size() != 0 && r->digest.size() != 32) ||
            (r->upstream.size() != 0 && r->upstream.size() != 32) || !xdfs::text::is_clean(r->message) ||
            !xdfs::text::is_clean(r->upstream_message))
          __builtin_trap();
        for (const auto& s : r->skipped)
          if (!xdfs::text::is_clean(s.message) || s.code == xdfs::errc::ok) __builtin_trap();
      }
      break;
    case 7:
      if (auto hops = w::decode_relink(rest, &why)) {
        if (hops->size() > w::max_relay_hops) __builtin_trap();
        auto again = w::decode_relink(w::encode_relink(*hops), &why);
        if (!again || !(*again == *hops)) __builtin_trap();
      }
      break;
    case 4:
      if (rest.size() >= w::preamble_size)
        (void)w::decode_preamble(std::span<const std::uint8_t, w::preamble_size>(rest.data(), w::preamble_size));
      break;
  }
  return 0;
}
