// examples/qwen/tokenizer.hpp: text in and text out for Qwen2/2.5/3 checkpoints. Host only (no CUDA);
// depends on nlohmann-json, PCRE2 (8-bit) and utf8proc, so the header and tokenizer.cpp can be copied
// into another project as they are.
//
//   auto tok = qwen::Tokenizer::from_file("dir/tokenizer.json");
//   std::vector<int> ids = tok.encode(qwen::chatml_prompt("Hi!", "You are terse."));
//   qwen::StreamDecoder out(tok);
//   for (int id : generated) std::fputs(out.feed(id).c_str(), stdout);  // never half a character
//   std::fputs(out.flush().c_str(), stdout);
//   std::vector<int> stop = qwen::eos_token_ids("dir", tok);
//
// What is read from tokenizer.json (Hugging Face `tokenizers` format):
//   model          BPE with byte-level symbols: `vocab` (token -> id) and `merges` ("a b" or ["a", "b"]);
//   added_tokens   matched first, leftmost then longest, on the raw text; the text between them goes on;
//   normalizer     null, NFC, or a Sequence of those;
//   pre_tokenizer  ByteLevel, Split (a Regex with behavior Isolated), or a Sequence of one Split and one
//                  ByteLevel (use_regex false), as Qwen2 and Qwen3 ship it;
//   decoder        null or ByteLevel.
// Anything else (another model, normalizer, pre-tokenizer or decoder type; lstrip/rstrip/single_word
// added tokens; BPE dropout, byte fallback, ignore_merges) is refused with a tokenizer_error naming it.
//
// The Split regex runs through PCRE2 (UTF, UCP, JIT where available). `\s` and `\S` in the pattern
// are rewritten to Unicode White_Space (the set Oniguruma and Rust's regex use): PCRE2's own `\s`
// also matches U+180E.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace qwen {

/// Every problem of a tokenizer file or of the text given to it: the message names the file, the
/// field or type, or the byte offset of invalid UTF-8.
struct tokenizer_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// A token matched on the raw text before the regex and BPE (tokenizer.json `added_tokens`).
struct AddedToken {
  int id = 0;
  std::string content;
  bool special = false;  ///< control token (decode can skip it)
};

/// Byte offset of the first invalid UTF-8 sequence in `s` (overlong forms, surrogates and code
/// points above U+10FFFF are invalid), or npos when `s` is valid.
std::size_t find_invalid_utf8(std::string_view s);

/// A byte-level BPE tokenizer loaded from tokenizer.json. encode() keeps a cache of pre-token ->
/// ids and scratch for the regex, so one object must not encode from two threads at once; decode()
/// and the accessors are read-only.
class Tokenizer {
 public:
  /// Reads and checks `path` (a tokenizer.json, or a directory holding one).
  static Tokenizer from_file(const std::filesystem::path& path);
  /// Parses the text of a tokenizer.json; `origin` names it in errors.
  static Tokenizer from_json(std::string_view json_text, const std::string& origin = "tokenizer.json");

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  /// Token ids of `text` (UTF-8; throws tokenizer_error naming the byte offset otherwise). Added
  /// tokens in the text become their ids.
  std::vector<int> encode(std::string_view text);
  /// The text of `ids`, bytes that are not valid UTF-8 replaced by U+FFFD; throws tokenizer_error
  /// for an id outside the vocabulary. skip_special drops special added tokens.
  [[nodiscard]] std::string decode(const std::vector<int>& ids, bool skip_special = false) const;
  /// The raw bytes of one token (may be part of a UTF-8 sequence); throws for an unknown id.
  [[nodiscard]] const std::string& token_bytes(int id) const;

  /// One more than the largest id (the BPE vocabulary and the added tokens).
  [[nodiscard]] int vocab_size() const { return static_cast<int>(bytes_.size()); }
  /// The id of a vocabulary or added token given by its text, or -1.
  [[nodiscard]] int token_id(std::string_view token) const;
  [[nodiscard]] bool is_special(int id) const;
  [[nodiscard]] const std::vector<AddedToken>& added_tokens() const { return added_; }

 private:
  struct Impl;
  Tokenizer();
  void encode_segment(std::string_view text, std::vector<int>& out);
  void bpe(std::string_view piece, std::vector<int>& out);

  std::vector<std::string> bytes_;            // id -> raw bytes (added tokens: their content)
  std::vector<std::uint8_t> special_;         // id -> 1 for special added tokens
  std::unordered_map<std::string, int> ids_;  // raw bytes -> id (BPE vocabulary)
  std::vector<AddedToken> added_;
  std::unique_ptr<Impl> impl_;                // merges, regex, cache
};

/// Turns token ids into text as they are generated, holding back the bytes of a UTF-8 sequence
/// that a later token completes, so that printed output never shows half a character. Bytes that
/// cannot start or continue a valid sequence come out as U+FFFD.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool skip_special = false) : tok_(&tok), skip_special_(skip_special) {}
  /// The complete characters that `id` finishes (possibly empty).
  std::string feed(int id);
  /// What is still held back (an unfinished sequence, as U+FFFD); the decoder is then empty.
  std::string flush();

 private:
  const Tokenizer* tok_;
  bool skip_special_;
  std::string pending_;
};

/// Completes the UTF-8 prefix of `pending` into `out`, leaving an unfinished trailing sequence in
/// `pending`; invalid bytes become U+FFFD. StreamDecoder and Tokenizer::decode share it.
void drain_utf8(std::string& pending, std::string& out);

/// A one-turn chat prompt in ChatML as Qwen3's chat template renders it with
/// add_generation_prompt=True and enable_thinking=False, without tools:
///   <|im_start|>system\n{system}<|im_end|>\n           (only when `system` is not empty)
///   <|im_start|>user\n{user}<|im_end|>\n
///   <|im_start|>assistant\n<think>\n\n</think>\n\n
/// The empty think block is what the template appends when thinking is off; the model then answers
/// directly.
std::string chatml_prompt(std::string_view user, std::string_view system = {});

/// The ids that end generation for a checkpoint directory: `eos_token_id` (an int or a list) from
/// generation_config.json and config.json in `dir` (both, when both exist), else the ids of
/// <|im_end|> and <|endoftext|> in `tok`. Throws tokenizer_error for a malformed file or an id
/// outside the vocabulary.
std::vector<int> eos_token_ids(const std::filesystem::path& dir, const Tokenizer& tok);

}  // namespace qwen
