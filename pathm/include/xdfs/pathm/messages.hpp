// xPathM messages: requests and replies as Cap'n Proto, built and read without extra copies.
//
// A message that carries file bytes is built straight into the buffer the frame is sent from
// (Writer), and read straight out of the buffer the frame arrived in (decode_*: the entries'
// data spans point into that buffer). Decoding treats the bytes as hostile: sizes, counts and
// traversal are bounded, and every path is checked later by whoever uses it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "xdfs/error.hpp"

namespace xdfs::pathm {

enum class Type : std::uint8_t { file = 0, directory = 1, symlink = 2, other = 3 };
const char* to_string(Type t) noexcept;

enum class Op : std::uint8_t { stat = 0, list = 1, mkdir = 2, remove = 3, rename = 4, checksum = 5, put = 6, get = 7,
                               set_attrs = 8 };
const char* to_string(Op o) noexcept;

/// Most entries one message may carry (a listing chunk, a batch of small files).
inline constexpr std::size_t max_entries = 4096;

struct Entry {
  std::string path;
  Type type = Type::file;
  std::uint64_t size = 0;
  std::uint32_t mode = 0;
  std::int64_t mtime_ns = 0;
  std::string target;
  std::uint64_t offset = 0;
  std::uint64_t file_id = 0;
  /// Decoded: points into the message buffer. Encoded: copied into the message.
  std::span<const std::uint8_t> data;
  /// put, get, set_attrs: this entry failed and the rest of the request went on (in a put
  /// request: the client could not read it, and the server skips it).
  errc code = errc::ok;
  std::string message;
};

struct Request {
  std::uint64_t id = 0;
  Op op = Op::stat;
  std::string path;
  std::string to;
  bool recursive = false;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  std::uint32_t mode = 0;
  std::vector<Entry> entries;
  /// checksum: non-zero asks for the whole file's manifest digest with this block size.
  std::uint32_t block_size = 0;
};

struct Reply {
  std::uint64_t id = 0;
  errc code = errc::ok;
  std::string message;
  bool last = true;
  std::vector<Entry> entries;
  std::string algorithm;
  std::vector<std::uint8_t> digest;
};

/// Bytes of one encoded message, word-aligned.
struct Encoded {
  std::vector<std::uint64_t> words;
  std::size_t size = 0;  ///< bytes used
  /// The builder the bytes were made in, when they were built in place. It must go first:
  /// Cap'n Proto clears a caller-provided segment when its builder is destroyed.
  std::shared_ptr<void> keep;
  std::span<std::uint8_t> bytes() noexcept { return {reinterpret_cast<std::uint8_t*>(words.data()), size}; }
};

Encoded encode(const Request& r);
Encoded encode(const Reply& r);

/// Decodes a message held in `buf` (which must stay alive while the result is used).
std::optional<Request> decode_request(std::span<const std::uint8_t> buf, std::string* why = nullptr);
std::optional<Reply> decode_reply(std::span<const std::uint8_t> buf, std::string* why = nullptr);

/// Builds a request or reply whose entries carry file bytes, reserving each entry's data in the
/// message itself so that a file is read straight into the bytes that go on the wire.
class Writer {
public:
  /// A request (put) or a reply (get) with room for about `data_bytes` of file data.
  static Writer request(std::uint64_t id, Op op, std::size_t entries, std::size_t data_bytes);
  static Writer reply(std::uint64_t id, std::size_t entries, std::size_t data_bytes);
  Writer(Writer&&) noexcept;
  Writer& operator=(Writer&&) noexcept;
  ~Writer();

  /// Sets entry i's fields (not its data) and reserves `data_size` bytes of data; returns them.
  /// Set again with data_size 0 (say, with a failure code) it drops the bytes reserved before.
  std::span<std::uint8_t> set(std::size_t i, const Entry& e, std::size_t data_size);
  /// Reply only: the outcome (default ok, last).
  void set_result(errc code, const std::string& message);
  /// The finished message.
  Encoded finish();

private:
  struct Impl;
  explicit Writer(std::unique_ptr<Impl> p);
  std::unique_ptr<Impl> p_;
};

}  // namespace xdfs::pathm
