#include "xdfs/manifest.hpp"

#include <botan/hash.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

namespace xdfs::manifest {
namespace {

constexpr char domain[] = "xDFS-manifest-2\n";
static_assert(sizeof domain - 1 == 16);

std::unique_ptr<Botan::HashFunction> sha256() { return Botan::HashFunction::create_or_throw("SHA-256"); }

Digest take(Botan::HashFunction& h) {
  Digest d{};
  h.final(d.data());
  return d;
}

}  // namespace

std::string hex(const Digest& d) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s;
  s.reserve(d.size() * 2);
  for (auto b : d) {
    s.push_back(digits[b >> 4]);
    s.push_back(digits[b & 15]);
  }
  return s;
}

BlockHasher::BlockHasher() : hash_(sha256()) {}
BlockHasher::~BlockHasher() = default;

Digest BlockHasher::digest(const std::uint8_t* data, std::size_t n) {
  hash_->update(data, n);
  return take(*hash_);
}

void BlockHasher::update(const std::uint8_t* data, std::size_t n) { hash_->update(data, n); }
Digest BlockHasher::finish() { return take(*hash_); }

void BlockHasher::put(std::uint8_t* at, const Digest& d) noexcept { std::memcpy(at, d.data(), d.size()); }

FileDigest::FileDigest(std::uint64_t file_size, std::uint32_t block_size, std::size_t max_waiting)
    : file_size_(file_size),
      block_size_(block_size ? block_size : 1),
      blocks_(file_size / block_size_ + (file_size % block_size_ != 0)),
      max_waiting_(max_waiting),
      hash_(sha256()) {
  std::uint8_t head[16 + 4];
  std::memcpy(head, domain, 16);
  for (int i = 0; i < 4; ++i) head[16 + i] = static_cast<std::uint8_t>(block_size_ >> (8 * i));
  hash_->update(head, sizeof head);
}

FileDigest::FileDigest(OpenEnded, std::uint32_t block_size, std::size_t max_waiting)
    : FileDigest(0, block_size, max_waiting) {
  known_ = false;
  blocks_ = UINT64_MAX;
}

bool FileDigest::set_size(std::uint64_t file_size) {
  const std::uint64_t blocks = file_size / block_size_ + (file_size % block_size_ != 0);
  if (known_ || next_ > blocks || (!waiting_.empty() && waiting_.rbegin()->first >= blocks)) return false;
  known_ = true;
  file_size_ = file_size;
  blocks_ = blocks;
  return true;
}

FileDigest::~FileDigest() = default;

FileDigest::Added FileDigest::add(FileOffset offset, const Digest& d) {
  const std::uint64_t at = offset.value();
  if (at % block_size_ != 0) return Added::not_a_block;
  const std::uint64_t index = at / block_size_;
  if (index >= blocks_ || index < next_) return Added::not_a_block;
  if (index != next_) {
    if (waiting_.count(index)) return Added::not_a_block;
    if (waiting_.size() >= max_waiting_) return Added::too_far_ahead;
    waiting_.emplace(index, d);
    return Added::ok;
  }
  hash_->update(d.data(), d.size());
  ++next_;
  // The ones that waited for this one.
  for (auto it = waiting_.begin(); it != waiting_.end() && it->first == next_; it = waiting_.erase(it)) {
    hash_->update(it->second.data(), it->second.size());
    ++next_;
  }
  return Added::ok;
}

std::optional<Digest> FileDigest::result() {
  if (!result_ && complete()) {
    std::uint8_t tail[8];
    for (int i = 0; i < 8; ++i) tail[i] = static_cast<std::uint8_t>(file_size_ >> (8 * i));
    hash_->update(tail, sizeof tail);
    result_ = take(*hash_);
  }
  return result_;
}

Status add_file(int fd, FileDigest& file, std::uint64_t upto, const std::atomic<bool>* stop,
                std::atomic<std::uint64_t>* hashed) {
  Status out;
  if (!file.size_known() || upto > file.file_size() || (upto % file.block_size() != 0 && upto != file.file_size()) || file.next_offset() != 0) {
    out.code = errc::internal;
    out.message = "a prefix of " + std::to_string(upto) + " bytes is not whole blocks of the file";
    return out;
  }
  BlockHasher blocks;
  // Read in parts of at most 1 MiB whatever the block size (a peer names it).
  constexpr std::size_t part = 1 << 20;
  std::vector<std::uint8_t> buf(static_cast<std::size_t>(std::min<std::uint64_t>(part, std::max<std::uint64_t>(upto, 1))));
  for (std::uint64_t at = 0; at < upto;) {
    const std::uint64_t block_end = std::min<std::uint64_t>(upto, at + file.block_size());
    const std::uint64_t block_start = at;
    while (at < block_end) {
      if (stop && stop->load(std::memory_order_relaxed)) {
        out.code = errc::cancelled;
        out.message = "stopped";
        return out;
      }
      const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), block_end - at));
      const ssize_t r = ::pread(fd, buf.data(), want, static_cast<off_t>(at));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) {
        out.code = errc_from_errno(errno);
        out.message = "read at offset " + std::to_string(at) + ": " + std::strerror(errno);
        return out;
      }
      if (r == 0) {
        out.code = errc::size_mismatch;
        out.message = "file shrank to " + std::to_string(at) + " bytes while being hashed";
        return out;
      }
      blocks.update(buf.data(), static_cast<std::size_t>(r));
      at += static_cast<std::uint64_t>(r);
      if (hashed) hashed->store(at, std::memory_order_relaxed);
    }
    (void)file.add(FileOffset(block_start), blocks.finish());
  }
  return out;
}

Computed of_file(int fd, std::uint64_t size, std::uint32_t block_size, const std::atomic<bool>* stop) {
  Computed out;
  FileDigest file(size, block_size);
  const auto st = add_file(fd, file, size, stop);
  out.code = st.code;
  out.message = st.message;
  if (st.code == errc::ok) out.digest = *file.result();
  return out;
}

}  // namespace xdfs::manifest
