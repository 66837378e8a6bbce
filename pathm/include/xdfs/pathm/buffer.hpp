// xPathM messages as they arrive: word-aligned buffers that decoded entries point into, and the
// largest message a session takes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace xdfs::pathm {

/// Largest xPathM message a session with this block size accepts: one block of file bytes plus
/// room for the entries' names.
inline std::size_t max_message(std::uint32_t block_size) { return std::size_t(block_size) + (4u << 20); }

/// A received message: word-aligned bytes that decoded entries point into.
struct Buffer {
  std::unique_ptr<std::uint64_t[]> words;
  std::size_t size = 0;
  /// Room for `size` bytes, not cleared (a frame's payload is read into all of it).
  static std::shared_ptr<Buffer> make(std::size_t size) {
    auto b = std::make_shared<Buffer>();
    b->words.reset(new std::uint64_t[(size + 7) / 8]);
    b->size = size;
    return b;
  }
  std::span<std::uint8_t> writable() noexcept { return {reinterpret_cast<std::uint8_t*>(words.get()), size}; }
  std::span<const std::uint8_t> bytes() const noexcept {
    return {reinterpret_cast<const std::uint8_t*>(words.get()), size};
  }
};

}  // namespace xdfs::pathm
