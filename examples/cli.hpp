// Small command-line helpers shared by xdfsd and xduc.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace xdfs::cli {

/// "65536", "64K", "64KiB", "1M", "2G", "1T", "1P" (powers of 1024) -> bytes; nullopt if malformed.
std::optional<std::uint64_t> parse_size(const std::string& text);

/// A rate in bytes per second, as parse_size takes it, from 1K to 1P; nullopt otherwise.
std::optional<std::uint64_t> parse_rate(const std::string& text);
/// The rate limits' lower bound: one block of `block` bytes at `rate` must take at most 15 s,
/// well inside the idle timeouts. "" if it does; else the one-line reason, naming `option` and
/// telling to lower `block_option`.
std::string too_slow(const std::string& option, std::uint64_t rate, std::uint64_t block, const std::string& block_option);

/// Unsigned decimal within [lo, hi].
std::optional<std::uint64_t> parse_uint(const std::string& text, std::uint64_t lo, std::uint64_t hi);

/// An xdfs://HOST[:PORT]/PATH URL. PATH is relative to the server root (leading '/' dropped).
struct Url {
  std::string host;  ///< a name or an address; an IPv6 one without its brackets
  std::uint16_t port = 7721;
  std::string path;  ///< decoded: the bytes of the name
};
bool is_url(const std::string& text);
/// Parses a URL; on failure returns nullopt and sets why (one line, naming the URL). An IPv6
/// HOST goes in brackets (xdfs://[::1]:7721/f; a zone as %25, xdfs://[fe80::1%25eth0]/f).
/// %XX in PATH is the byte XX (%20 a space, %25 a '%', %2F a '/', which separates names as '/'
/// does); a '%' not followed by two hex digits, or %00, is refused. A user name (USER@HOST) is
/// refused: a client is its key (--identity), not a name.
std::optional<Url> parse_url(const std::string& text, std::string& why);
/// The URL parse_url reads back as host, port and path: an IPv6 host in brackets, and in the
/// path '%', space and control bytes as %XX (so that a list of URLs is one a line).
std::string format_url(const std::string& host, std::uint16_t port, const std::string& path);

/// What --version prints: "PROGRAM VERSION (xDFS protocol N)" (XDFS_VERSION is set by the build).
std::string version_line(const std::string& program);

/// s as the inside of a JSON string: '"' and '\\' escaped, control bytes as \\u00XX.
std::string json_escape(const std::string& s);

/// "1.5 GiB" style.
std::string human_bytes(double bytes);

}  // namespace xdfs::cli
