// nanogpt/vocab.hpp: the character vocabulary (tiny-shakespeare's 65 characters) and its checks.
//
// Token i is the i-th character of `chars`, which is sorted, as in the seed (`chars =
// sorted(list(set(text)))`). Encoding text with a character outside the vocabulary throws
// `vocab_error` listing every such character once, with its code point, so a user sees at once
// what to remove.
#pragma once

#include "config.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace nanogpt {

/// A prompt or token problem (characters outside the vocabulary, token id out of range).
class vocab_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The 65 characters, token id = index.
inline constexpr std::string_view vocab_chars =
    "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
static_assert(vocab_chars.size() == Config::vocab_size);

namespace detail {
/// Decodes one UTF-8 code point starting at s[i] and advances i; a byte that does not start a valid
/// sequence comes back as itself (so the error message can still show it).
inline std::uint32_t next_code_point(std::string_view s, std::size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  const int extra = b0 >= 0xF0 ? 3 : b0 >= 0xE0 ? 2 : b0 >= 0xC0 ? 1 : 0;
  if (extra == 0) return ++i, b0;
  std::uint32_t cp = b0 & (0x3Fu >> extra);
  for (int k = 1; k <= extra; ++k) {
    const std::size_t j = i + static_cast<std::size_t>(k);
    if (j >= s.size() || (static_cast<unsigned char>(s[j]) & 0xC0) != 0x80) return ++i, b0;
    cp = (cp << 6) | (static_cast<unsigned char>(s[j]) & 0x3Fu);
  }
  i += static_cast<std::size_t>(extra) + 1;
  return cp;
}

inline std::string describe_code_point(std::uint32_t cp) {
  std::string shown;
  switch (cp) {
    case '\t': shown = "\\t"; break;
    case '\r': shown = "\\r"; break;
    default:
      if (cp < 0x20 || cp == 0x7F) {
        shown = "?";
      } else if (cp < 0x80) {
        shown = std::string(1, static_cast<char>(cp));
      } else {  // re-encode as UTF-8
        if (cp < 0x800) {
          shown += static_cast<char>(0xC0 | (cp >> 6));
        } else if (cp < 0x10000) {
          shown += static_cast<char>(0xE0 | (cp >> 12));
          shown += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        } else {
          shown += static_cast<char>(0xF0 | (cp >> 18));
          shown += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
          shown += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        }
        if (cp >= 0x80) shown += static_cast<char>(0x80 | (cp & 0x3F));
      }
  }
  return fmt::format("'{}' (U+{:04X})", shown, cp);
}
}  // namespace detail

/// Token ids of `text`; throws vocab_error listing every character not in the vocabulary.
inline std::vector<std::int32_t> encode(std::string_view text) {
  std::array<int, 256> index{};
  index.fill(-1);
  for (std::size_t i = 0; i < vocab_chars.size(); ++i) index[static_cast<unsigned char>(vocab_chars[i])] = static_cast<int>(i);
  std::vector<std::int32_t> ids;
  std::vector<std::uint32_t> bad;
  for (std::size_t i = 0; i < text.size();) {
    const std::uint32_t cp = detail::next_code_point(text, i);
    const int id = cp < 128 ? index[cp] : -1;
    if (id >= 0) {
      ids.push_back(id);
    } else if (std::find(bad.begin(), bad.end(), cp) == bad.end()) {
      bad.push_back(cp);
    }
  }
  if (!bad.empty()) {
    std::vector<std::string> shown;
    for (auto cp : bad) shown.push_back(detail::describe_code_point(cp));
    throw vocab_error(fmt::format(
        "the prompt has {} character{} outside the model's 65-character vocabulary: {}. "
        "Allowed: newline, space, !$&',-.3:;? and A-Z a-z",
        bad.size(), bad.size() == 1 ? "" : "s", fmt::join(shown, ", ")));
  }
  return ids;
}

/// The text of token ids; throws vocab_error for an id outside [0, vocab_size).
inline std::string decode(const std::vector<std::int32_t>& ids) {
  std::string s;
  s.reserve(ids.size());
  for (auto id : ids) {
    if (id < 0 || id >= Config::vocab_size)
      throw vocab_error(fmt::format("token id {} is outside the vocabulary [0, {})", id, Config::vocab_size));
    s += vocab_chars[static_cast<std::size_t>(id)];
  }
  return s;
}

}  // namespace nanogpt
