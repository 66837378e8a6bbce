#include "xdfs/manifest.hpp"

#include <botan/hash.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

namespace xdfs::manifest {
namespace {

constexpr char domain[] = "xDFS-manifest-1\n";
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

bool BlockHasher::check(const std::uint8_t* data, std::size_t n) {
  const Digest d = digest(data, n);
  return std::memcmp(d.data(), data + n, d.size()) == 0;
}

void BlockHasher::put(std::uint8_t* at, const Digest& d) noexcept { std::memcpy(at, d.data(), d.size()); }

FileDigest::FileDigest(std::uint64_t file_size, std::uint32_t block_size)
    : file_size_(file_size),
      block_size_(block_size ? block_size : 1),
      blocks_(file_size / block_size_ + (file_size % block_size_ != 0)),
      hash_(sha256()) {
  std::uint8_t head[16 + 8 + 4];
  std::memcpy(head, domain, 16);
  for (int i = 0; i < 8; ++i) head[16 + i] = static_cast<std::uint8_t>(file_size >> (8 * i));
  for (int i = 0; i < 4; ++i) head[24 + i] = static_cast<std::uint8_t>(block_size_ >> (8 * i));
  hash_->update(head, sizeof head);
}

FileDigest::~FileDigest() = default;

bool FileDigest::add(FileOffset offset, const Digest& d) {
  const std::uint64_t at = offset.value();
  if (at % block_size_ != 0) return false;
  const std::uint64_t index = at / block_size_;
  if (index >= blocks_ || index < next_) return false;
  if (index != next_) return waiting_.emplace(index, d).second;
  hash_->update(d.data(), d.size());
  ++next_;
  // The ones that waited for this one.
  for (auto it = waiting_.begin(); it != waiting_.end() && it->first == next_; it = waiting_.erase(it)) {
    hash_->update(it->second.data(), it->second.size());
    ++next_;
  }
  return true;
}

std::optional<Digest> FileDigest::result() {
  if (!result_ && complete()) result_ = take(*hash_);
  return result_;
}

Computed of_file(int fd, std::uint64_t size, std::uint32_t block_size, const std::atomic<bool>* stop) {
  Computed out;
  FileDigest file(size, block_size);
  BlockHasher blocks;
  std::vector<std::uint8_t> buf(static_cast<std::size_t>(std::min<std::uint64_t>(file.block_size(), std::max<std::uint64_t>(size, 1))));
  for (std::uint64_t at = 0; at < size;) {
    if (stop && stop->load(std::memory_order_relaxed)) {
      out.code = errc::cancelled;
      out.message = "stopped";
      return out;
    }
    const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(file.block_size(), size - at));
    std::size_t have = 0;
    while (have < want) {
      const ssize_t r = ::pread(fd, buf.data() + have, want - have, static_cast<off_t>(at + have));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) {
        out.code = errc_from_errno(errno);
        out.message = "read at offset " + std::to_string(at + have) + ": " + std::strerror(errno);
        return out;
      }
      if (r == 0) {
        out.code = errc::size_mismatch;
        out.message = "file shrank to " + std::to_string(at + have) + " bytes while being hashed";
        return out;
      }
      have += static_cast<std::size_t>(r);
    }
    file.add(FileOffset(at), blocks.digest(buf.data(), want));
    at += want;
  }
  out.digest = *file.result();
  return out;
}

}  // namespace xdfs::manifest
