// Text from a peer, made safe to show: for log lines and terminals.
#pragma once

#include <string>
#include <string_view>

namespace xdfs::text {

/// `s` as one printable line: control characters (C0, DEL, C1), line and paragraph separators,
/// bidirectional overrides and bytes that are not valid UTF-8 are written as escapes
/// (\n, \t, \r, \xNN for each byte), everything else as it is. Idempotent: escaping an escaped
/// text changes nothing, so a message escaped where it was received can be escaped again where
/// it is shown.
std::string escape(std::string_view s);

/// True when escape(s) == s.
bool is_clean(std::string_view s) noexcept;

}  // namespace xdfs::text
