// libFuzzer harness for the xSec parsers: Noise XX messages at each step, join answers,
// protected frames, and the key files a server reads.
#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "xdfs/xsec.hpp"

namespace xs = xdfs::xsec;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  static const xs::KeyPair client = xs::KeyPair::generate();
  static const xs::KeyPair server = xs::KeyPair::generate();
  const std::uint8_t which = data[0] % 7;
  std::span<const std::uint8_t> rest(data + 1, size - 1);
  const std::uint8_t prologue[] = {'f', 'u', 'z', 'z'};
  switch (which) {
    case 0: {  // responder reading message 1: any 32 bytes are a key; its answer is 96 bytes or none
      xs::NoiseXX r(false, server, prologue);
      if (r.read_message_1(rest)) {
        if (rest.size() != 32) __builtin_trap();
        const auto m2 = r.write_message_2();
        if (!m2.empty() && m2.size() != 96) __builtin_trap();
      }
      break;
    }
    case 1: {  // initiator reading message 2: only a responder holding the DH results can make one
      xs::NoiseXX i(true, client, prologue);
      (void)i.write_message_1();
      if (i.read_message_2(rest)) __builtin_trap();
      break;
    }
    case 2: {  // responder reading message 3 after a real message 1: only the real initiator could
      xs::NoiseXX i(true, client, prologue), r(false, server, prologue);
      if (!r.read_message_1(i.write_message_1())) __builtin_trap();
      (void)r.write_message_2();
      std::vector<std::uint8_t> payload;
      if (r.read_message_3(rest, &payload)) __builtin_trap();
      break;
    }
    case 3: {  // a protected frame: a forged one never opens; a sealed one opens to what was sealed
      if (rest.size() < 24 + 16) break;
      xs::Key32 a{}, b{};
      b[0] = 1;
      for (auto mode : {xs::Protect::clear, xs::Protect::integrity, xs::Protect::private_}) {
        xs::FrameProtector p(mode, xs::Cipher::aes256gcm, a, b);
        xdfs::wire::HeaderBytes h;
        std::copy(rest.begin(), rest.begin() + 24, h.begin());
        std::vector<std::uint8_t> payload(rest.begin() + 24, rest.end() - 16);
        const auto ev = static_cast<xdfs::wire::ChannelEvent>(h[0]);
        const bool opened = p.open(h, payload, rest.data() + rest.size() - 16);
        if (opened && p.tag_bytes(ev) != 0) __builtin_trap();  // a tag forged from nothing
        xs::FrameProtector tx(mode, xs::Cipher::aes256gcm, b, a), rx(mode, xs::Cipher::aes256gcm, a, b);
        std::vector<std::uint8_t> body(rest.begin() + 24, rest.end());
        const auto plain = body;
        std::uint8_t tag[16];
        tx.seal(h, body, tag);
        if (!rx.open(h, body, tag) || body != plain) __builtin_trap();
      }
      break;
    }
    case 4: {  // authorized keys and public keys as text
      std::string text(rest.begin(), rest.end());
      try {
        auto keys = xs::AuthorizedKeys::parse(text, "fuzz");
        if (keys.size() > static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n')) + 1) __builtin_trap();
      } catch (const xdfs::Error&) {
      }
      if (auto k = xs::parse_public(text)) {
        if (xs::parse_public(xs::format_public(*k)) != k) __builtin_trap();
      }
      break;
    }
    case 5: {  // join keys over arbitrary nonces and opening bytes: deterministic, one per side
      xs::Key32 secret{};
      auto half = rest.size() / 2;
      auto k = xs::derive_join_keys(secret, rest.subspan(0, half), rest.subspan(half), rest);
      auto again = xs::derive_join_keys(secret, rest.subspan(0, half), rest.subspan(half), rest);
      if (k.client_to_server != again.client_to_server || k.client_to_server == k.server_to_client) __builtin_trap();
      if (xs::join_proof(k, "client", rest.subspan(0, half), rest.subspan(half)) ==
          xs::join_proof(k, "server", rest.subspan(0, half), rest.subspan(half)))
        __builtin_trap();
      break;
    }
    case 6: {  // a block sealed on a disk thread opens only at its own offset and length
      if (rest.size() < 9) break;
      std::uint64_t off = 0;
      for (int i = 0; i < 8; ++i) off |= std::uint64_t(rest[i]) << (8 * i);
      std::vector<std::uint8_t> block(rest.begin() + 8, rest.end());
      const auto len = static_cast<std::uint32_t>(block.size());
      const auto plain = block;
      block.resize(len + 16);
      for (auto mode : {xs::Protect::integrity, xs::Protect::private_}) {
        xs::BlockCrypto c(mode, xs::Cipher::aes256gcm, xs::data_key(xs::Key32{}, true, 0));
        auto b = block;
        std::copy(plain.begin(), plain.end(), b.begin());
        c.seal(b.data(), xdfs::DataLength(len), xdfs::FileOffset(off));
        auto moved = b;
        if (c.open(moved.data(), xdfs::DataLength(len), xdfs::FileOffset(off + 1))) __builtin_trap();
        if (!c.open(b.data(), xdfs::DataLength(len), xdfs::FileOffset(off)) || !std::equal(plain.begin(), plain.end(), b.begin())) __builtin_trap();
      }
      break;
    }
  }
  return 0;
}
