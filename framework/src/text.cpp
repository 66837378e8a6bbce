#include "xdfs/text.hpp"

#include <cstdint>

namespace xdfs::text {
namespace {

// Length of the valid UTF-8 sequence at s[i] (1..4), or 0 if the bytes there are not one.
// Overlong forms, surrogates and code points above U+10FFFF are invalid.
std::size_t utf8_length(std::string_view s, std::size_t i, char32_t& cp) noexcept {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    cp = b0;
    return 1;
  }
  std::size_t n;
  char32_t min;
  if ((b0 & 0xE0) == 0xC0) {
    n = 2;
    cp = b0 & 0x1F;
    min = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    n = 3;
    cp = b0 & 0x0F;
    min = 0x800;
  } else if ((b0 & 0xF8) == 0xF0) {
    n = 4;
    cp = b0 & 0x07;
    min = 0x10000;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (std::size_t k = 1; k < n; ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return n;
}

// Code points a terminal or a log reader would not show as themselves: C0 and C1 controls, DEL,
// line and paragraph separators (one event is one line), and the bidirectional overrides and
// isolates that reorder what follows them.
bool hidden(char32_t cp) noexcept {
  return cp < 0x20 || (cp >= 0x7F && cp <= 0x9F) || cp == 0x2028 || cp == 0x2029 || (cp >= 0x202A && cp <= 0x202E) ||
         (cp >= 0x2066 && cp <= 0x2069);
}

void hex_byte(std::string& out, unsigned char b) {
  static constexpr char digits[] = "0123456789abcdef";
  out += "\\x";
  out += digits[b >> 4];
  out += digits[b & 15];
}

}  // namespace

std::string escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    char32_t cp = 0;
    const std::size_t n = utf8_length(s, i, cp);
    if (n == 0) {
      hex_byte(out, static_cast<unsigned char>(s[i]));
      ++i;
      continue;
    }
    if (hidden(cp)) {
      if (cp == '\n') out += "\\n";
      else if (cp == '\t') out += "\\t";
      else if (cp == '\r') out += "\\r";
      else
        for (std::size_t k = 0; k < n; ++k) hex_byte(out, static_cast<unsigned char>(s[i + k]));
    } else {
      out.append(s.substr(i, n));
    }
    i += n;
  }
  return out;
}

bool is_clean(std::string_view s) noexcept {
  for (std::size_t i = 0; i < s.size();) {
    char32_t cp = 0;
    const std::size_t n = utf8_length(s, i, cp);
    if (n == 0 || hidden(cp)) return false;
    i += n;
  }
  return true;
}

}  // namespace xdfs::text
