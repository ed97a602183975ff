// replay/detail/pool_json.hpp: the few JSON helpers the pool statistics need (no JSON library:
// the library target depends only on CUDA and fmt).
#pragma once

#include <fmt/format.h>

#include <cmath>
#include <string>
#include <string_view>

namespace replay::detail {

/// `s` as a JSON string literal, quotes included (escapes quotes, backslashes and control
/// characters; other bytes pass through, so UTF-8 stays UTF-8).
inline std::string json_string(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  out += '"';
  for (const char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20)
          out += fmt::format("\\u{:04x}", static_cast<unsigned>(static_cast<unsigned char>(c)));
        else
          out += c;
    }
  }
  out += '"';
  return out;
}

/// A finite double as a JSON number (shortest round-trip form); NaN and infinities become null.
inline std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  return fmt::format("{}", v);
}

}  // namespace replay::detail
