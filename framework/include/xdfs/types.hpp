// Strong types for the units the protocol speaks in.
#pragma once

#include <array>
#include <compare>
#include <cstdint>
#include <string>

namespace xdfs {

/// Protocol version spoken by this build (2: the negotiation travels inside the handshake).
inline constexpr std::uint16_t protocol_version = 3;

/// A session's 16-byte random identifier, the same on all of its channels.
struct SessionId {
  std::array<std::uint8_t, 16> bytes{};
  auto operator<=>(const SessionId&) const = default;
  /// Lower-case hex of all 16 bytes.
  std::string hex() const;
  /// First 8 hex digits, for log lines.
  std::string short_hex() const { return hex().substr(0, 8); }
  /// A fresh identifier from the system's cryptographic RNG: a guessable id would let a
  /// stranger join someone else's session.
  static SessionId random();
};

struct SessionIdHash {
  std::size_t operator()(const SessionId& s) const noexcept {
    std::size_t h = 0;
    for (auto b : s.bytes) h = h * 131 + b;
    return h;
  }
};

/// Index of a channel within its session, 0 .. n-1.
struct ChannelIndex {
  std::uint32_t value = 0;
  auto operator<=>(const ChannelIndex&) const = default;
};

/// Which way the file moves, seen from the client.
enum class Mode : std::uint8_t { upload = 0, download = 1, path = 2 };

const char* to_string(Mode m) noexcept;

}  // namespace xdfs
