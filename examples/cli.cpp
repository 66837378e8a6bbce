#include "cli.hpp"

#include <fmt/core.h>

#include <cctype>
#include <charconv>

#include "xdfs/text.hpp"
#include "xdfs/wire.hpp"
#include "xdfs/xdsi.hpp"

namespace xdfs::cli {

std::optional<std::uint64_t> parse_uint(const std::string& text, std::uint64_t lo, std::uint64_t hi) {
  std::uint64_t v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || p != text.data() + text.size() || v < lo || v > hi) return std::nullopt;
  return v;
}

std::optional<std::uint64_t> parse_size(const std::string& text) {
  std::size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  if (i == 0) return std::nullopt;
  auto num = parse_uint(text.substr(0, i), 0, UINT64_MAX);
  if (!num) return std::nullopt;
  std::string unit = text.substr(i);
  std::uint64_t mult = 1;
  if (unit.empty() || unit == "B") mult = 1;
  else if (unit == "K" || unit == "k" || unit == "KiB") mult = 1ull << 10;
  else if (unit == "M" || unit == "m" || unit == "MiB") mult = 1ull << 20;
  else if (unit == "G" || unit == "g" || unit == "GiB") mult = 1ull << 30;
  else if (unit == "T" || unit == "t" || unit == "TiB") mult = 1ull << 40;
  else if (unit == "P" || unit == "p" || unit == "PiB") mult = 1ull << 50;
  else return std::nullopt;
  if (*num > UINT64_MAX / mult) return std::nullopt;
  return *num * mult;
}

std::optional<std::uint64_t> parse_rate(const std::string& text) {
  auto v = parse_size(text);
  if (!v || *v < 1024 || *v > (1ull << 50)) return std::nullopt;
  return v;
}

std::string too_slow(const std::string& option, std::uint64_t rate, std::uint64_t block, const std::string& block_option) {
  if (!rate || block <= rate * 15) return {};
  return option + " of " + std::to_string(rate) + " bytes per second takes more than 15 s per block of " +
         std::to_string(block) + ": raise it or lower " + block_option;
}

bool is_url(const std::string& text) { return text.rfind("xdfs://", 0) == 0; }

namespace {

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// PATH's %XX escapes as bytes; "" with the reason if one is malformed or makes a NUL (which no
// file name holds, and which would cut the name short in the system calls).
std::string decode_path(const std::string& in, std::string& out) {
  out.clear();
  for (std::size_t i = 0; i < in.size(); ++i) {
    if (in[i] != '%') {
      out += in[i];
      continue;
    }
    const int hi = i + 1 < in.size() ? hex_digit(in[i + 1]) : -1;
    const int lo = i + 2 < in.size() ? hex_digit(in[i + 2]) : -1;
    if (hi < 0 || lo < 0)
      return "has '" + in.substr(i, 3) + "', not a %XX escape (a '%' in a name is written %25)";
    if (hi == 0 && lo == 0) return "has %00 in its path: a file name cannot hold a NUL byte";
    out += static_cast<char>(hi * 16 + lo);
    i += 2;
  }
  return {};
}

}  // namespace

std::optional<Url> parse_url(const std::string& text, std::string& why) {
  const std::string shown = text::escape(text);
  if (!is_url(text)) {
    why = "'" + shown + "' is not an xdfs:// URL";
    return std::nullopt;
  }
  std::string rest = text.substr(7);
  auto slash = rest.find('/');
  std::string authority = rest.substr(0, slash);
  // A user name picks nothing here: the client's key (--identity) is who it is at the server.
  if (const auto at = authority.rfind('@'); at != std::string::npos) {
    why = "'" + shown + "' names a user ('" + text::escape(authority.substr(0, at)) +
          "@'): xDFS knows clients by their keys, not user names; give --identity FILE to use another key";
    return std::nullopt;
  }
  Url u;
  if (slash != std::string::npos) {
    if (auto bad = decode_path(rest.substr(slash + 1), u.path); !bad.empty()) {
      why = "'" + shown + "' " + text::escape(bad);
      return std::nullopt;
    }
  }
  while (!u.path.empty() && u.path.front() == '/') u.path.erase(0, 1);
  if (!xdsi::parse_host_port(authority, 7721, u.host, u.port)) {
    why = "'" + shown + "' has no valid HOST[:PORT] (an IPv6 address goes in brackets: [::1]:7721)";
    return std::nullopt;
  }
  // An IPv6 zone is written %25 (RFC 6874): fe80::1%25eth0 is fe80::1%eth0.
  if (const auto zone = u.host.find("%25"); zone != std::string::npos && authority.front() == '[')
    u.host.erase(zone + 1, 2);
  return u;
}

std::string format_url(const std::string& host, std::uint16_t port, const std::string& path) {
  std::string h = host;
  if (const auto zone = h.find('%'); zone != std::string::npos) h.insert(zone + 1, "25");
  std::string url = fmt::format("xdfs://{}:{}/", h.find(':') != std::string::npos ? "[" + h + "]" : h, port);
  for (unsigned char c : path) {
    if (c == '%' || c <= 0x20 || c == 0x7f) url += fmt::format("%{:02X}", c);
    else url += static_cast<char>(c);
  }
  return url;
}

#ifndef XDFS_VERSION
#define XDFS_VERSION "unknown"
#endif

std::string version_line(const std::string& program) {
  return fmt::format("{} {} (xDFS protocol {})", program, XDFS_VERSION, protocol_version);
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') o += '\\', o += static_cast<char>(c);
    else if (c < 0x20) o += fmt::format("\\u{:04x}", c);
    else o += static_cast<char>(c);
  }
  return o;
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} {}", b, units[u]) : fmt::format("{:.1f} {}", b, units[u]);
}

}  // namespace xdfs::cli
