// examples/qwen/tokenizer.cpp: tokenizer.json loading, byte-level BPE encode, UTF-8-safe decode,
// ChatML and end-of-sequence ids. See tokenizer.hpp for what is supported.
#include "tokenizer.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <nlohmann/json.hpp>
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <fstream>
#include <queue>
#include <sstream>

namespace qwen {

namespace {

using json = nlohmann::json;

// GPT-2's byte-level alphabet: bytes that are printable Latin-1 stand for themselves, the others
// (controls, space, 0x7f-0xa0, 0xad) map to U+0100 onwards in byte order.
struct ByteLevel {
  std::array<char32_t, 256> to_char{};
  std::unordered_map<char32_t, std::uint8_t> to_byte;
  ByteLevel() {
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      to_char[b] = keep ? char32_t(b) : next++;
      to_byte[to_char[b]] = std::uint8_t(b);
    }
  }
};

const ByteLevel& byte_level() {
  static const ByteLevel table;
  return table;
}

// Decodes one code point of valid UTF-8 at s[i], advancing i.
char32_t next_code_point(std::string_view s, std::size_t& i) {
  const auto c = static_cast<unsigned char>(s[i]);
  const int n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
  char32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
  for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += n;
  return cp;
}

// The length of the valid UTF-8 sequence at s[i], 0 if the bytes there are invalid, or -1 if
// they are a valid but unfinished prefix that runs off the end.
int utf8_sequence(std::string_view s, std::size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return 1;
  int n = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) n = 2;
  else if (c >= 0xE0 && c <= 0xEF) n = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
  else if (c >= 0xF0 && c <= 0xF4) n = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
  else return 0;
  for (int k = 1; k < n; ++k) {
    if (i + k >= s.size()) return -1;
    const auto d = static_cast<unsigned char>(s[i + k]);
    if (d < (k == 1 ? lo : 0x80) || d > (k == 1 ? hi : 0xBF)) return 0;
  }
  return n;
}

// Raw bytes of a byte-level token string ("Ġthe" -> " the"); false if a character is not in the
// byte-level alphabet.
bool byte_level_decode(std::string_view token, std::string& out) {
  out.clear();
  const auto& bl = byte_level();
  for (std::size_t i = 0; i < token.size();) {
    if (utf8_sequence(token, i) <= 0) return false;
    const auto it = bl.to_byte.find(next_code_point(token, i));
    if (it == bl.to_byte.end()) return false;
    out.push_back(static_cast<char>(it->second));
  }
  return true;
}

// Unicode White_Space as a list of class items (for use inside [...]).
constexpr std::string_view kWhiteSpace = "\\t\\n\\x0b\\f\\r\\x20\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}"
                                         "\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}";

// The pattern with \s and \S spelled as Unicode White_Space. Refuses \S inside a class.
std::string rewrite_white_space(std::string_view p) {
  std::string out;
  bool in_class = false;
  for (std::size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[++i];
      if (e == 's') out += in_class ? std::string(kWhiteSpace) : "[" + std::string(kWhiteSpace) + "]";
      else if (e == 'S' && !in_class) out += "[^" + std::string(kWhiteSpace) + "]";
      else if (e == 'S') throw tokenizer_error("Split regex: \\S inside a character class is not supported");
      else out += c, out += e;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];  // a leading ']' is literal
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

std::string type_of(const json& j, const std::string& what) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string())
    throw tokenizer_error(what + ": an object with a string \"type\" is expected");
  return j["type"].get<std::string>();
}

}  // namespace

std::size_t find_invalid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const int n = utf8_sequence(s, i);
    if (n <= 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

void drain_utf8(std::string& pending, std::string& out) {
  std::size_t i = 0;
  while (i < pending.size()) {
    const int n = utf8_sequence(pending, i);
    if (n < 0) break;  // unfinished: wait for more bytes
    if (n == 0) {
      out += "\xEF\xBF\xBD";
      ++i;
      continue;
    }
    out.append(pending, i, n);
    i += n;
  }
  pending.erase(0, i);
}

struct Tokenizer::Impl {
  // (left id << 32 | right id) -> (merge rank, merged id)
  std::unordered_map<std::uint64_t, std::pair<int, int>> merges;
  std::array<int, 256> byte_id{};  // id of each single-byte token
  bool nfc = false;
  bool split = false;  // false: the whole segment is one pre-token
  pcre2_code* re = nullptr;
  bool jit = false;
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mctx = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  std::unordered_map<std::string, std::vector<int>> cache;  // pre-token -> ids
  std::unordered_map<std::string_view, int> added_by_text;
  std::string added_first_bytes;  // first bytes of added tokens, for a quick scan

  ~Impl() {
    if (md) pcre2_match_data_free(md);
    if (mctx) pcre2_match_context_free(mctx);
    if (jit_stack) pcre2_jit_stack_free(jit_stack);
    if (re) pcre2_code_free(re);
  }

  void compile(const std::string& pattern, const std::string& origin) {
    const std::string p = rewrite_white_space(pattern);
    int err = 0;
    PCRE2_SIZE off = 0;
    re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(p.data()), p.size(), PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
    if (!re) {
      std::array<PCRE2_UCHAR, 256> msg{};
      pcre2_get_error_message(err, msg.data(), msg.size());
      throw tokenizer_error(origin + ": Split regex does not compile at offset " + std::to_string(off) + ": " +
                            reinterpret_cast<const char*>(msg.data()));
    }
    jit = pcre2_jit_compile(re, PCRE2_JIT_COMPLETE) == 0;
    md = pcre2_match_data_create_from_pattern(re, nullptr);
    if (jit) {
      mctx = pcre2_match_context_create(nullptr);
      jit_stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
      pcre2_jit_stack_assign(mctx, nullptr, jit_stack);
    }
    split = true;
  }
};

Tokenizer::Tokenizer() : impl_(std::make_unique<Impl>()) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_file(const std::filesystem::path& path) {
  std::filesystem::path p = path;
  std::error_code ec;
  if (std::filesystem::is_directory(p, ec)) p /= "tokenizer.json";
  if (!std::filesystem::is_regular_file(p, ec)) throw tokenizer_error(p.string() + ": no such file");
  std::ifstream f(p, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  if (!f) throw tokenizer_error(p.string() + ": cannot read");
  return from_json(ss.str(), p.string());
}

Tokenizer Tokenizer::from_json(std::string_view text, const std::string& origin) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw tokenizer_error(origin + ": not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object()) throw tokenizer_error(origin + ": the top level is not a JSON object");
  Tokenizer t;
  Impl& im = *t.impl_;
  try {
    // model
    if (!j.contains("model")) throw tokenizer_error(origin + ": no \"model\"");
    const json& m = j["model"];
    const std::string mtype = m.contains("type") ? type_of(m, "model") : "BPE";
    if (mtype != "BPE")
      throw tokenizer_error(origin + ": model type \"" + mtype + "\" is not supported (only byte-level BPE)");
    if (m.contains("dropout") && !m["dropout"].is_null()) throw tokenizer_error(origin + ": BPE dropout is not supported");
    for (const char* flag : {"byte_fallback", "ignore_merges", "fuse_unk"})
      if (m.value(flag, false)) throw tokenizer_error(origin + ": BPE \"" + flag + "\" is not supported");
    for (const char* affix : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (m.contains(affix) && m[affix].is_string() && !m[affix].get<std::string>().empty())
        throw tokenizer_error(origin + ": BPE \"" + affix + "\" is not supported");
    if (!m.contains("vocab") || !m["vocab"].is_object()) throw tokenizer_error(origin + ": model.vocab is not an object");
    if (!m.contains("merges") || !m["merges"].is_array()) throw tokenizer_error(origin + ": model.merges is not an array");

    const json& vocab = m["vocab"];
    int max_id = -1;
    for (const auto& [tok, id] : vocab.items())
      if (!id.is_number_integer() || id.get<long long>() < 0 || id.get<long long>() >= (1 << 30))
        throw tokenizer_error(origin + ": model.vocab[\"" + tok + "\"] is not an id in 0..2^30");
      else max_id = std::max(max_id, id.get<int>());
    std::vector<int> added_ids;
    if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
      if (!j["added_tokens"].is_array()) throw tokenizer_error(origin + ": added_tokens is not an array");
      for (const json& a : j["added_tokens"]) {
        if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() || !a.contains("content") ||
            !a["content"].is_string())
          throw tokenizer_error(origin + ": an added token needs an integer \"id\" and a string \"content\"");
        AddedToken at{a["id"].get<int>(), a["content"].get<std::string>(), a.value("special", false)};
        if (at.id < 0 || at.id >= (1 << 30)) throw tokenizer_error(origin + ": added token id out of range");
        if (at.content.empty() || find_invalid_utf8(at.content) != std::string::npos)
          throw tokenizer_error(origin + ": added token " + std::to_string(at.id) + " is empty or not UTF-8");
        for (const char* flag : {"lstrip", "rstrip", "single_word"})
          if (a.value(flag, false))
            throw tokenizer_error(origin + ": added token \"" + at.content + "\": \"" + flag + "\" is not supported");
        max_id = std::max(max_id, at.id);
        t.added_.push_back(std::move(at));
      }
    }
    t.bytes_.assign(static_cast<std::size_t>(max_id + 1), std::string());
    t.special_.assign(t.bytes_.size(), 0);
    std::vector<std::uint8_t> used(t.bytes_.size(), 0);
    std::string raw;
    t.ids_.reserve(vocab.size());
    std::unordered_map<std::string, int> by_text;  // byte-level text -> id, for the merges
    by_text.reserve(vocab.size());
    for (const auto& [tok, idj] : vocab.items()) {
      const int id = idj.get<int>();
      if (tok.empty() || !byte_level_decode(tok, raw))
        throw tokenizer_error(origin + ": vocabulary token \"" + tok + "\" is not in the byte-level alphabet");
      if (used[id]) throw tokenizer_error(origin + ": id " + std::to_string(id) + " appears twice in model.vocab");
      used[id] = 1;
      t.bytes_[id] = raw;
      t.ids_.emplace(raw, id);
      by_text.emplace(tok, id);
    }
    for (int b = 0; b < 256; ++b) {
      const auto it = t.ids_.find(std::string(1, char(b)));
      if (it == t.ids_.end())
        throw tokenizer_error(origin + ": byte " + std::to_string(b) + " has no token: not a byte-level vocabulary");
      im.byte_id[b] = it->second;
    }
    for (const AddedToken& at : t.added_) {
      if (used[at.id] && t.bytes_[at.id] != at.content)
        throw tokenizer_error(origin + ": added token " + std::to_string(at.id) + " reuses a vocabulary id");
      used[at.id] = 1;
      t.bytes_[at.id] = at.content;
      t.special_[at.id] = at.special;
    }
    for (const AddedToken& at : t.added_) {
      im.added_by_text.emplace(at.content, at.id);
      if (im.added_first_bytes.find(at.content[0]) == std::string::npos) im.added_first_bytes += at.content[0];
    }

    const json& merges = m["merges"];
    im.merges.reserve(merges.size());
    std::string a, b;
    for (std::size_t r = 0; r < merges.size(); ++r) {
      const json& mj = merges[r];
      if (mj.is_string()) {
        const std::string& s = mj.get_ref<const std::string&>();
        const std::size_t sp = s.find(' ', 1);
        if (sp == std::string::npos) throw tokenizer_error(origin + ": merge " + std::to_string(r) + " \"" + s + "\" has no space");
        a = s.substr(0, sp), b = s.substr(sp + 1);
      } else if (mj.is_array() && mj.size() == 2 && mj[0].is_string() && mj[1].is_string()) {
        a = mj[0].get<std::string>(), b = mj[1].get<std::string>();
      } else {
        throw tokenizer_error(origin + ": merge " + std::to_string(r) + " is neither \"a b\" nor [\"a\", \"b\"]");
      }
      const auto ia = by_text.find(a), ib = by_text.find(b), iab = by_text.find(a + b);
      if (ia == by_text.end() || ib == by_text.end() || iab == by_text.end())
        throw tokenizer_error(origin + ": merge " + std::to_string(r) + " (\"" + a + "\", \"" + b +
                              "\") names a token not in the vocabulary");
      const std::uint64_t key = (std::uint64_t(std::uint32_t(ia->second)) << 32) | std::uint32_t(ib->second);
      im.merges.emplace(key, std::pair<int, int>{static_cast<int>(r), iab->second});  // the first rank wins
    }

    // normalizer
    auto normalizer = [&](const json& n, auto&& self) -> void {
      if (n.is_null()) return;
      const std::string type = type_of(n, origin + ": normalizer");
      if (type == "NFC") im.nfc = true;
      else if (type == "Sequence" && n.contains("normalizers") && n["normalizers"].is_array())
        for (const json& x : n["normalizers"]) self(x, self);
      else throw tokenizer_error(origin + ": normalizer type \"" + type + "\" is not supported (only NFC)");
    };
    if (j.contains("normalizer")) normalizer(j["normalizer"], normalizer);

    // pre-tokenizer: ByteLevel (the bytes of each piece are the BPE symbols) after an optional Split
    const json pt = j.value("pre_tokenizer", json());
    if (pt.is_null()) throw tokenizer_error(origin + ": no pre_tokenizer (a byte-level one is needed)");
    std::vector<json> steps;
    const std::string ptype = type_of(pt, origin + ": pre_tokenizer");
    if (ptype == "Sequence") {
      if (!pt.contains("pretokenizers") || !pt["pretokenizers"].is_array())
        throw tokenizer_error(origin + ": pre_tokenizer Sequence without a \"pretokenizers\" array");
      for (const json& x : pt["pretokenizers"]) steps.push_back(x);
    } else {
      steps.push_back(pt);
    }
    bool have_byte_level = false;
    for (const json& s : steps) {
      const std::string type = type_of(s, origin + ": pre_tokenizer");
      if (type == "Split") {
        if (im.split || have_byte_level)
          throw tokenizer_error(origin + ": only one Split, before the ByteLevel pre-tokenizer, is supported");
        if (!s.contains("pattern") || !s["pattern"].is_object() || !s["pattern"].contains("Regex") ||
            !s["pattern"]["Regex"].is_string())
          throw tokenizer_error(origin + ": Split needs a pattern {\"Regex\": ...} (a String pattern is not supported)");
        const std::string behavior = s.value("behavior", std::string());
        if (behavior != "Isolated" || s.value("invert", false))
          throw tokenizer_error(origin + ": Split behavior \"" + behavior + "\" is not supported (only Isolated)");
        im.compile(s["pattern"]["Regex"].get<std::string>(), origin);
      } else if (type == "ByteLevel") {
        if (s.value("add_prefix_space", false))
          throw tokenizer_error(origin + ": ByteLevel add_prefix_space is not supported");
        if (s.value("use_regex", true)) {
          if (im.split) throw tokenizer_error(origin + ": ByteLevel use_regex after a Split is not supported");
          im.compile(R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)", origin);
        }
        have_byte_level = true;
      } else {
        throw tokenizer_error(origin + ": pre_tokenizer type \"" + type +
                              "\" is not supported (only Split and ByteLevel)");
      }
    }
    if (!have_byte_level) throw tokenizer_error(origin + ": the pre_tokenizer has no ByteLevel step");

    // decoder
    const json dec = j.value("decoder", json());
    if (!dec.is_null()) {
      const std::string type = type_of(dec, origin + ": decoder");
      if (type != "ByteLevel") throw tokenizer_error(origin + ": decoder type \"" + type + "\" is not supported (only ByteLevel)");
    }
  } catch (const json::exception& e) {
    throw tokenizer_error(origin + ": unexpected structure (" + e.what() + ")");
  }
  return t;
}

int Tokenizer::token_id(std::string_view token) const {
  if (const auto it = impl_->added_by_text.find(token); it != impl_->added_by_text.end()) return it->second;
  if (const auto it = ids_.find(std::string(token)); it != ids_.end()) return it->second;
  return -1;
}

bool Tokenizer::is_special(int id) const {
  return id >= 0 && id < vocab_size() && special_[id];
}

const std::string& Tokenizer::token_bytes(int id) const {
  if (id < 0 || id >= vocab_size() || bytes_[id].empty())
    throw tokenizer_error("token id " + std::to_string(id) + " is outside the vocabulary (0.." +
                          std::to_string(vocab_size() - 1) + (id >= 0 && id < vocab_size() ? ", a gap" : "") + ")");
  return bytes_[id];
}

// Byte-level BPE of one pre-token: start from its bytes, merge the adjacent pair of lowest rank
// (the leftmost among equals) until no pair has a merge, as `tokenizers` does.
void Tokenizer::bpe(std::string_view piece, std::vector<int>& out) {
  Impl& im = *impl_;
  if (const auto it = im.cache.find(std::string(piece)); it != im.cache.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  const std::size_t n = piece.size();
  std::vector<int> sym(n);
  for (std::size_t i = 0; i < n; ++i) sym[i] = im.byte_id[static_cast<unsigned char>(piece[i])];
  auto lookup = [&](int l, int r) -> const std::pair<int, int>* {
    const auto it = im.merges.find((std::uint64_t(std::uint32_t(l)) << 32) | std::uint32_t(r));
    return it == im.merges.end() ? nullptr : &it->second;
  };
  constexpr int kNone = 0x7fffffff;
  if (n <= 128) {
    // Short pieces: the rank of each adjacent pair, rescanned for the minimum after each merge.
    std::vector<int> rank(n > 0 ? n - 1 : 0), merged(rank.size());
    auto fill = [&](std::size_t i) {
      const auto* m = lookup(sym[i], sym[i + 1]);
      rank[i] = m ? m->first : kNone;
      merged[i] = m ? m->second : -1;
    };
    for (std::size_t i = 0; i + 1 < sym.size(); ++i) fill(i);
    while (!rank.empty()) {
      const auto best = std::min_element(rank.begin(), rank.end()) - rank.begin();
      if (rank[best] == kNone) break;
      sym[best] = merged[best];
      sym.erase(sym.begin() + best + 1);
      rank.erase(rank.begin() + best);
      merged.erase(merged.begin() + best);
      if (best > 0) fill(best - 1);
      if (static_cast<std::size_t>(best) < rank.size()) fill(best);
    }
  } else {
    // Long pieces: a heap of candidate merges over a linked list of symbols.
    std::vector<int> prev(n), next(n);
    for (std::size_t i = 0; i < n; ++i) prev[i] = int(i) - 1, next[i] = i + 1 < n ? int(i + 1) : -1;
    struct Cand {
      int rank, pos, left, right, merged;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Cand, std::vector<Cand>, std::greater<>> heap;
    auto push = [&](int i) {
      if (i < 0 || next[i] < 0) return;
      if (const auto* m = lookup(sym[i], sym[next[i]])) heap.push({m->first, i, sym[i], sym[next[i]], m->second});
    };
    for (std::size_t i = 0; i + 1 < n; ++i) push(int(i));
    while (!heap.empty()) {
      const Cand c = heap.top();
      heap.pop();
      const int r = next[c.pos];
      if (sym[c.pos] != c.left || r < 0 || sym[r] != c.right) continue;  // stale
      sym[c.pos] = c.merged;
      sym[r] = -1;
      next[c.pos] = next[r];
      if (next[r] >= 0) prev[next[r]] = c.pos;
      push(prev[c.pos]);
      push(c.pos);
    }
    std::vector<int> kept;
    for (int i = 0; i >= 0; i = next[i]) kept.push_back(sym[i]);
    sym.swap(kept);
  }
  out.insert(out.end(), sym.begin(), sym.end());
  if (n > 256) return;  // long runs (whitespace, punctuation) are rare: not worth keeping
  if (im.cache.size() >= 200000) im.cache.clear();
  im.cache.emplace(std::string(piece), std::move(sym));
}

void Tokenizer::encode_segment(std::string_view text, std::vector<int>& out) {
  Impl& im = *impl_;
  std::string normalized;
  if (im.nfc && std::any_of(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) >= 0x80; })) {
    utf8proc_uint8_t* dst = nullptr;
    const utf8proc_ssize_t len = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                              static_cast<utf8proc_ssize_t>(text.size()), &dst,
                                              static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
    if (len < 0) throw tokenizer_error(std::string("NFC normalization failed: ") + utf8proc_errmsg(len));
    normalized.assign(reinterpret_cast<const char*>(dst), static_cast<std::size_t>(len));
    std::free(dst);
    text = normalized;
  }
  if (!im.split) {
    if (!text.empty()) bpe(text, out);
    return;
  }
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  PCRE2_SIZE start = 0;
  while (start < text.size()) {
    const int rc = im.jit ? pcre2_jit_match(im.re, subject, text.size(), start, PCRE2_NO_UTF_CHECK, im.md, im.mctx)
                          : pcre2_match(im.re, subject, text.size(), start, PCRE2_NO_UTF_CHECK, im.md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) {
      bpe(text.substr(start), out);  // the gap after the last match is a piece of its own
      break;
    }
    if (rc < 0) {
      std::array<PCRE2_UCHAR, 256> msg{};
      pcre2_get_error_message(rc, msg.data(), msg.size());
      throw tokenizer_error(std::string("Split regex failed: ") + reinterpret_cast<const char*>(msg.data()));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(im.md);
    if (ov[0] > start) bpe(text.substr(start, ov[0] - start), out);  // unmatched gap
    if (ov[1] > ov[0]) {
      bpe(text.substr(ov[0], ov[1] - ov[0]), out);
      start = ov[1];
    } else {
      // An empty match: step one character (the Qwen pattern never matches empty).
      std::size_t i = ov[0];
      next_code_point(text, i);
      if (i > ov[0]) bpe(text.substr(ov[0], i - ov[0]), out);
      start = i;
    }
  }
}

std::vector<int> Tokenizer::encode(std::string_view text) {
  if (const std::size_t bad = find_invalid_utf8(text); bad != std::string_view::npos)
    throw tokenizer_error("text is not valid UTF-8 at byte " + std::to_string(bad));
  Impl& im = *impl_;
  std::vector<int> out;
  out.reserve(text.size() / 3 + 1);
  std::size_t seg = 0, i = 0;
  while (!im.added_by_text.empty() && i < text.size()) {
    i = text.find_first_of(im.added_first_bytes, i);
    if (i == std::string_view::npos) break;
    // The longest added token starting here.
    std::size_t best_len = 0;
    int best_id = -1;
    for (const AddedToken& at : added_)
      if (at.content.size() > best_len && text.compare(i, at.content.size(), at.content) == 0)
        best_len = at.content.size(), best_id = at.id;
    if (best_id < 0) {
      ++i;
      continue;
    }
    encode_segment(text.substr(seg, i - seg), out);
    out.push_back(best_id);
    i += best_len;
    seg = i;
  }
  encode_segment(text.substr(seg), out);
  return out;
}

std::string Tokenizer::decode(const std::vector<int>& ids, bool skip_special) const {
  std::string raw, out;
  for (int id : ids) {
    const std::string& b = token_bytes(id);
    if (!(skip_special && special_[id])) raw += b;
  }
  drain_utf8(raw, out);
  for (std::size_t k = 0; k < raw.size(); ++k) out += "\xEF\xBF\xBD";  // an unfinished tail
  return out;
}

std::string StreamDecoder::feed(int id) {
  const std::string& b = tok_->token_bytes(id);
  std::string out;
  if (skip_special_ && tok_->is_special(id)) return out;
  pending_ += b;
  drain_utf8(pending_, out);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  drain_utf8(pending_, out);
  for (std::size_t k = 0; k < pending_.size(); ++k) out += "\xEF\xBF\xBD";
  pending_.clear();
  return out;
}

std::string chatml_prompt(std::string_view user, std::string_view system) {
  std::string s;
  if (!system.empty()) s.append("<|im_start|>system\n").append(system).append("<|im_end|>\n");
  s.append("<|im_start|>user\n").append(user).append("<|im_end|>\n");
  s.append("<|im_start|>assistant\n<think>\n\n</think>\n\n");
  return s;
}

std::vector<int> eos_token_ids(const std::filesystem::path& dir, const Tokenizer& tok) {
  std::vector<int> ids;
  auto add = [&](int id, const std::string& origin) {
    if (id < 0 || id >= tok.vocab_size())
      throw tokenizer_error(origin + ": eos_token_id " + std::to_string(id) + " is outside the vocabulary");
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  };
  for (const char* name : {"generation_config.json", "config.json"}) {
    const std::filesystem::path p = dir / name;
    std::error_code ec;
    if (!std::filesystem::is_regular_file(p, ec)) continue;
    std::ifstream f(p);
    json j;
    try {
      j = json::parse(f);
    } catch (const json::exception& e) {
      throw tokenizer_error(p.string() + ": not valid JSON (" + e.what() + ")");
    }
    if (!j.is_object() || !j.contains("eos_token_id") || j["eos_token_id"].is_null()) continue;
    const json& e = j["eos_token_id"];
    if (e.is_number_integer()) add(e.get<int>(), p.string());
    else if (e.is_array())
      for (const json& x : e)
        if (x.is_number_integer()) add(x.get<int>(), p.string());
        else throw tokenizer_error(p.string() + ": eos_token_id holds a non-integer");
    else throw tokenizer_error(p.string() + ": eos_token_id is neither an integer nor a list");
  }
  if (ids.empty())
    for (const char* t : {"<|im_end|>", "<|endoftext|>"})
      if (const int id = tok.token_id(t); id >= 0) ids.push_back(id);
  return ids;
}

}  // namespace qwen
