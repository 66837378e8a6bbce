// The content manifest: a SHA-256 digest per block and a whole-file digest built from them.
//
// The sender hashes each block on its disk thread as it reads it; the digest travels with the
// block (after its data, inside the frame's protection) and the receiver's disk thread checks
// it before the block counts as received, in every protection mode. The whole-file digest is
// what `xduc --json` reports and `xduc sum` computes for a file that is already somewhere;
// docs/manifest.md gives the exact definition, which other tools (and a relay) can compute.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "xdfs/error.hpp"
#include "xdfs/types.hpp"
#include "xdfs/wire.hpp"

namespace Botan {
class HashFunction;
}

namespace xdfs::manifest {

/// Bytes of one digest (SHA-256).
inline constexpr std::uint32_t digest_size = 32;
/// The name of the whole-file digest's definition, reported beside its value.
inline constexpr const char* algorithm = "xdfs-manifest-2-sha256";

/// A block travels with its digest and, in the protected modes, a tag after both.
static_assert(digest_size <= wire::max_block_tag, "a block's digest must fit its frame and slot (xsec.hpp checks it with the tag)");

using Digest = std::array<std::uint8_t, digest_size>;

std::string hex(const Digest& d);

/// Hashes blocks: one per thread.
class BlockHasher {
public:
  BlockHasher();
  ~BlockHasher();
  BlockHasher(const BlockHasher&) = delete;
  BlockHasher& operator=(const BlockHasher&) = delete;
  Digest digest(const std::uint8_t* data, std::size_t n);
  /// The same in parts: update with each part of a block, then finish.
  void update(const std::uint8_t* data, std::size_t n);
  Digest finish();
  /// Hashes data[0, n) and writes the digest at data + n.
  void stamp(std::uint8_t* data, std::size_t n) { put(data + n, digest(data, n)); }
  static void put(std::uint8_t* at, const Digest& d) noexcept;

private:
  std::unique_ptr<Botan::HashFunction> hash_;
};

/// The whole-file digest of a file of `file_size` bytes cut into blocks of `block_size`:
///   SHA-256("xDFS-manifest-2\n" || u32le block_size || d_0 || ... || d_{k-1} || u64le file_size)
/// where d_i is the SHA-256 of block i. The size comes last, so that a stream whose size is
/// known only at its end is hashed in one pass like a file (`open_ended`, then set_size).
/// Blocks may be added in any order; each digest waits until those before it are in (a
/// receiver sees blocks roughly in order, so few wait: at most `max_waiting`, so that a peer
/// that never sends one block cannot make the others pile up). Used by one thread at a time.
class FileDigest {
public:
  FileDigest(std::uint64_t file_size, std::uint32_t block_size, std::size_t max_waiting = SIZE_MAX);
  /// A stream's: blocks of any index come until set_size.
  struct OpenEnded {};
  FileDigest(OpenEnded, std::uint32_t block_size, std::size_t max_waiting = SIZE_MAX);
  ~FileDigest();
  FileDigest(const FileDigest&) = delete;
  FileDigest& operator=(const FileDigest&) = delete;

  /// An open-ended one's size, once its end is known: false (and nothing changed) if the size
  /// is known already or a digest came for a block at or after its end.
  bool set_size(std::uint64_t file_size);
  bool size_known() const noexcept { return known_; }

  enum class Added { ok, not_a_block, too_far_ahead };
  /// The digest of the block at `offset`. not_a_block if that is not the start of one of the
  /// file's blocks, or its digest was added already; too_far_ahead if max_waiting digests
  /// already wait for an earlier block.
  Added add(FileOffset offset, const Digest& d);
  /// The first block whose digest has not come (the one the others wait for).
  std::uint64_t next_offset() const noexcept { return next_ * block_size_; }
  /// Every block's digest is in (and the size is known).
  bool complete() const noexcept { return known_ && next_ == blocks_; }
  /// The whole-file digest; none until complete(). The same value on every later call.
  std::optional<Digest> result();
  std::uint64_t file_size() const noexcept { return file_size_; }
  std::uint32_t block_size() const noexcept { return block_size_; }

private:
  std::uint64_t file_size_;
  std::uint32_t block_size_;
  std::uint64_t blocks_;
  bool known_ = true;       // the size is (false: a stream's, until set_size)
  std::uint64_t next_ = 0;  // index of the next block whose digest the running hash takes
  std::size_t max_waiting_;
  std::map<std::uint64_t, Digest> waiting_;
  std::unique_ptr<Botan::HashFunction> hash_;
  std::optional<Digest> result_;
};

/// Adds to `file` (which has no digest yet) the digests of the blocks in the first `upto` bytes
/// of `fd` (whole blocks, or the whole file), read with pread in parts of at most 1 MiB: how a
/// resumed transfer's both ends account for the part that is not sent again. `stop`, when set,
/// is polled between parts. Errors: the read's errno, size_mismatch when the file is shorter,
/// cancelled when stopped.
struct Status {
  errc code = errc::ok;
  std::string message;
};
/// `hashed`, when set, counts the bytes done as they are (a watchdog sees the work go on).
Status add_file(int fd, FileDigest& file, std::uint64_t upto, const std::atomic<bool>* stop = nullptr,
                std::atomic<std::uint64_t>* hashed = nullptr);

/// The whole-file digest of the first `size` bytes of `fd`, read with pread in parts of at most
/// 1 MiB whatever the block size. `stop`, when set, is polled between parts. Errors: the read's errno, or size_mismatch when the file is shorter.
struct Computed {
  errc code = errc::ok;
  std::string message;
  Digest digest{};
};
Computed of_file(int fd, std::uint64_t size, std::uint32_t block_size, const std::atomic<bool>* stop = nullptr);

}  // namespace xdfs::manifest
