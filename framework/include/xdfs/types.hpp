// Strong types for the units the protocol speaks in.
#pragma once

#include <array>
#include <compare>
#include <cstdint>
#include <optional>
#include <string>

namespace xdfs {

/// Protocol version spoken by this build (2: the negotiation travels inside the handshake; 4:
/// manifest format 2, open-ended uploads; 5: relay chains). A peer of another version is
/// refused at its preamble.
inline constexpr std::uint16_t protocol_version = 5;

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

/// An integer that carries its unit: quantities of different units neither convert nor mix,
/// and a raw integer becomes one only by naming it (FileOffset(x)). The operations that make
/// sense between units are the free functions below, each saying what it does.
template <class Unit, class Rep>
class Quantity {
public:
  using rep = Rep;
  constexpr Quantity() noexcept = default;
  constexpr explicit Quantity(Rep v) noexcept : v_(v) {}
  constexpr Rep value() const noexcept { return v_; }
  friend constexpr auto operator<=>(Quantity, Quantity) noexcept = default;

private:
  Rep v_{};
};

/// A byte position in a file (a block's first byte, the bytes acknowledged so far).
using FileOffset = Quantity<struct FileOffsetUnit, std::uint64_t>;
/// A block's bytes of file data, its tag not counted: what is read from or written to a file.
using DataLength = Quantity<struct DataLengthUnit, std::uint32_t>;
/// A block's authentication tag (0 in clear mode); it follows the data on the wire.
using TagLength = Quantity<struct TagLengthUnit, std::uint32_t>;
/// A data frame's payload on the wire: the block's data and then its tag.
using FrameLength = Quantity<struct FrameLengthUnit, std::uint32_t>;
/// Index of a channel within its session, 0 .. n-1.
using ChannelIndex = Quantity<struct ChannelIndexUnit, std::uint32_t>;

/// The frame that carries `data` bytes sealed with a `tag`. Both are bounded by the block size
/// (at most wire::max_block_size) and a tag of 16 bytes, so the sum fits.
constexpr FrameLength framed(DataLength data, TagLength tag) noexcept {
  return FrameLength(data.value() + tag.value());
}
/// The data a frame of `frame` bytes carries after its tag is taken off; none if the frame is not
/// longer than the tag (no block is empty).
constexpr std::optional<DataLength> unframed(FrameLength frame, TagLength tag) noexcept {
  if (frame.value() <= tag.value()) return std::nullopt;
  return DataLength(frame.value() - tag.value());
}
/// The offset just after `data` bytes that start at `at`; none if it would pass 2^64 - 1.
constexpr std::optional<FileOffset> after(FileOffset at, DataLength data) noexcept {
  if (data.value() > UINT64_MAX - at.value()) return std::nullopt;
  return FileOffset(at.value() + data.value());
}
/// The data bytes of a block that starts at `at` in a file of `size` bytes with blocks of
/// `block` bytes: a whole block, or the file's tail. None if `at` is not the start of a block
/// of that file.
constexpr std::optional<DataLength> block_at(FileOffset at, std::uint64_t size, DataLength block) noexcept {
  if (block.value() == 0 || at.value() >= size || at.value() % block.value() != 0) return std::nullopt;
  const std::uint64_t left = size - at.value();
  return DataLength(left < block.value() ? static_cast<std::uint32_t>(left) : block.value());
}

/// Which way the file moves, seen from the client.
enum class Mode : std::uint8_t { upload = 0, download = 1, path = 2, relay = 3, pull = 4 };

const char* to_string(Mode m) noexcept;

}  // namespace xdfs
