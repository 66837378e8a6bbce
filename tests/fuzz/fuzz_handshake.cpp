// libFuzzer harness for the xSec parsers: Noise XX messages at each step, join answers,
// protected frames, and the key files a server reads.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "xdfs/xsec.hpp"

namespace xs = xdfs::xsec;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  static const xs::KeyPair client = xs::KeyPair::generate();
  static const xs::KeyPair server = xs::KeyPair::generate();
  const std::uint8_t which = data[0] % 6;
  std::span<const std::uint8_t> rest(data + 1, size - 1);
  const std::uint8_t prologue[] = {'f', 'u', 'z', 'z'};
  switch (which) {
    case 0: {  // responder reading message 1
      xs::NoiseXX r(false, server, prologue);
      if (r.read_message_1(rest)) (void)r.write_message_2();
      break;
    }
    case 1: {  // initiator reading message 2
      xs::NoiseXX i(true, client, prologue);
      (void)i.write_message_1();
      if (i.read_message_2(rest)) (void)i.write_message_3();
      break;
    }
    case 2: {  // responder reading message 3 after a real message 1
      xs::NoiseXX i(true, client, prologue), r(false, server, prologue);
      if (!r.read_message_1(i.write_message_1())) __builtin_trap();
      (void)r.write_message_2();
      if (r.read_message_3(rest) && r.remote_static() == client.public_key) {
        // Only the real client could have produced a verifying message 3.
      }
      break;
    }
    case 3: {  // a protected frame: header, payload, tag
      if (rest.size() < 24 + 16) break;
      xs::Key32 a{}, b{};
      for (auto mode : {xs::Protect::clear, xs::Protect::integrity, xs::Protect::private_}) {
        xs::FrameProtector p(mode, xs::Cipher::aes256gcm, a, b);
        xdfs::wire::HeaderBytes h;
        std::copy(rest.begin(), rest.begin() + 24, h.begin());
        std::vector<std::uint8_t> payload(rest.begin() + 24, rest.end() - 16);
        (void)p.open(h, payload, rest.data() + rest.size() - 16);
      }
      break;
    }
    case 4: {  // authorized keys and public keys as text
      std::string text(rest.begin(), rest.end());
      try {
        (void)xs::AuthorizedKeys::parse(text, "fuzz");
      } catch (const xdfs::Error&) {
      }
      (void)xs::parse_public(text);
      break;
    }
    case 5: {  // join keys over arbitrary nonces and opening bytes
      xs::Key32 secret{};
      auto half = rest.size() / 2;
      auto k = xs::derive_join_keys(secret, rest.subspan(0, half), rest.subspan(half), rest);
      (void)xs::join_proof(k, "client", rest.subspan(0, half), rest.subspan(half));
      break;
    }
  }
  return 0;
}
