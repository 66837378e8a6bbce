// Small command-line helpers shared by xdfsd and xduc.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace xdfs::cli {

/// "65536", "64K", "64KiB", "1M", "2G", "1T", "1P" (powers of 1024) -> bytes; nullopt if malformed.
std::optional<std::uint64_t> parse_size(const std::string& text);

/// Unsigned decimal within [lo, hi].
std::optional<std::uint64_t> parse_uint(const std::string& text, std::uint64_t lo, std::uint64_t hi);

/// An xdfs://HOST[:PORT]/PATH URL. PATH is relative to the server root (leading '/' dropped).
struct Url {
  std::string host;
  std::uint16_t port = 7721;
  std::string path;
};
bool is_url(const std::string& text);
/// Parses a URL; on failure returns nullopt and sets why.
std::optional<Url> parse_url(const std::string& text, std::string& why);

/// "1.5 GiB" style.
std::string human_bytes(double bytes);

}  // namespace xdfs::cli
