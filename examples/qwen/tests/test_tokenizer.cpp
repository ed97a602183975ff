// Host tests of the Qwen tokenizer on a tiny byte-level vocabulary (tests/data/tiny_tokenizer.json:
// the 256 byte tokens as ids 0-255, 14 merges as ids 256-269, added tokens 270-274), with the
// expected ids from Hugging Face `tokenizers` on the same file. The real vocabulary is checked
// against `tokenizers` and `tiktoken` by tools/tokenizer_parity.py.
#include <doctest/doctest.h>

#include "qwen/tokenizer.hpp"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

using namespace qwen;
namespace fs = std::filesystem;

namespace {

const fs::path kTiny = QWEN_TINY_TOKENIZER;

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const tokenizer_error& e) {
    return e.what();
  }
  return "(no tokenizer_error)";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

nlohmann::json tiny_json() {
  std::ifstream f(kTiny);
  return nlohmann::json::parse(f);
}

std::string load_error(const nlohmann::json& j) {
  return error_of([&] { (void)Tokenizer::from_json(j.dump(), "t.json"); });
}

fs::path temp_dir(const char* name) {
  const fs::path d = fs::temp_directory_path() / (std::string("qwen_tokenizer_test_") + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

}  // namespace

TEST_CASE("encode: merges, the split regex, added tokens, NFC (ids as tokenizers gives them)") {
  Tokenizer tok = Tokenizer::from_file(kTiny);
  CHECK(tok.vocab_size() == 275);
  CHECK(tok.encode("Hello world") == std::vector<int>{259, 264});
  CHECK(tok.encode(" the") == std::vector<int>{267});
  CHECK(tok.encode("Hello world<|im_end|>\n") == std::vector<int>{259, 264, 272, 10});
  CHECK(tok.encode("\xC3\xA9") == std::vector<int>{269});   // é
  CHECK(tok.encode("e\xCC\x81") == std::vector<int>{269});  // e + combining acute, composed by NFC
  CHECK(tok.encode("<think>\n\n</think>\n\n") == std::vector<int>{273, 10, 10, 274, 10, 10});
  CHECK(tok.encode("  x") == std::vector<int>{32, 32, 120});
  CHECK(tok.encode("I'll   go\n\n  ") == std::vector<int>{73, 39, 256, 268, 32, 103, 111, 10, 10, 268});
  CHECK(tok.encode("").empty());
  CHECK(tok.encode("Hello world") == std::vector<int>{259, 264});  // again, from the cache
  CHECK(tok.token_id("<|im_end|>") == 272);
  CHECK(tok.token_id("Hello") == 259);
  CHECK(tok.token_id("nope") == -1);
  CHECK(tok.is_special(270));
  CHECK_FALSE(tok.is_special(273));
  // A long piece takes the heap path and agrees with the short one.
  std::string spaces(400, ' ');
  const std::vector<int> ids = tok.encode(spaces + "x");
  CHECK(ids.size() == 202);  // 399 spaces: 199 x "  " and " "; then " " "x"
  CHECK(ids[199] == 32);
  CHECK(ids.front() == 268);
  CHECK(tok.decode(ids) == spaces + "x");
}

TEST_CASE("encode refuses text that is not UTF-8, naming the byte") {
  Tokenizer tok = Tokenizer::from_file(kTiny);
  CHECK(contains(error_of([&] { (void)tok.encode("ab\xFF"); }), "not valid UTF-8 at byte 2"));
  CHECK(contains(error_of([&] { (void)tok.encode("\xC0\xAF"); }), "at byte 0"));          // overlong
  CHECK(contains(error_of([&] { (void)tok.encode("x\xED\xA0\x80"); }), "at byte 1"));     // surrogate
  CHECK(contains(error_of([&] { (void)tok.encode("\xF4\x90\x80\x80"); }), "at byte 0"));  // > U+10FFFF
  CHECK(contains(error_of([&] { (void)tok.encode("\xE4\xBD"); }), "at byte 0"));          // truncated
  CHECK(find_invalid_utf8("\xF0\x9F\x98\x80 ok") == std::string_view::npos);
}

TEST_CASE("decode and the streaming decoder never split a character") {
  Tokenizer tok = Tokenizer::from_file(kTiny);
  CHECK(tok.decode({259, 264, 272}) == "Hello world<|im_end|>");
  CHECK(tok.decode({259, 264, 272}, /*skip_special=*/true) == "Hello world");
  CHECK(contains(error_of([&] { (void)tok.decode({5, 9999}); }), "outside the vocabulary"));

  StreamDecoder d(tok);
  CHECK(d.feed(0xF0) == "");  // 😀 = F0 9F 98 80, one byte token at a time
  CHECK(d.feed(0x9F) == "");
  CHECK(d.feed(0x98) == "");
  CHECK(d.feed(0x80) == "\xF0\x9F\x98\x80");
  CHECK(d.feed(0xC3) == "");
  CHECK(d.feed(259) == "\xEF\xBF\xBD" "Hello");  // C3 followed by 'H': U+FFFD, then the word
  CHECK(d.feed(0xFF) == "\xEF\xBF\xBD");         // never valid
  CHECK(d.feed(0xE4) == "");
  CHECK(d.flush() == "\xEF\xBF\xBD");            // unfinished at the end
  CHECK(d.flush() == "");
  StreamDecoder quiet(tok, /*skip_special=*/true);
  CHECK(quiet.feed(270) == "");
  CHECK(quiet.feed(264) == " world");
}

TEST_CASE("ChatML as Qwen3's template renders it with thinking off") {
  CHECK(chatml_prompt("Hi") == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  CHECK(chatml_prompt("Hi", "Be brief.") ==
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n");
  Tokenizer tok = Tokenizer::from_file(kTiny);
  const std::vector<int> ids = tok.encode(chatml_prompt("Hello world"));
  CHECK(ids.front() == 271);
  CHECK(ids[ids.size() - 6] == 273);  // <think> \n \n </think> \n \n
}

TEST_CASE("end-of-sequence ids: generation_config.json and config.json, else the ChatML tokens") {
  Tokenizer tok = Tokenizer::from_file(kTiny);
  const fs::path d = temp_dir("eos");
  CHECK(eos_token_ids(d, tok) == std::vector<int>{272, 270});
  std::ofstream(d / "config.json") << R"({"eos_token_id": 272})";
  CHECK(eos_token_ids(d, tok) == std::vector<int>{272});
  std::ofstream(d / "generation_config.json") << R"({"eos_token_id": [270, 272]})";
  CHECK(eos_token_ids(d, tok) == std::vector<int>{270, 272});
  std::ofstream(d / "generation_config.json") << R"({"eos_token_id": 9999})";
  CHECK(contains(error_of([&] { (void)eos_token_ids(d, tok); }), "outside the vocabulary"));
  std::ofstream(d / "generation_config.json") << R"({"eos_token_id": "x"})";
  CHECK(contains(error_of([&] { (void)eos_token_ids(d, tok); }), "neither an integer nor a list"));
  std::ofstream(d / "generation_config.json") << "{";
  CHECK(contains(error_of([&] { (void)eos_token_ids(d, tok); }), "not valid JSON"));
  fs::remove_all(d);
}

TEST_CASE("bad tokenizer.json: missing, malformed, unsupported types named") {
  CHECK(contains(error_of([] { (void)Tokenizer::from_file("/nonexistent/tokenizer.json"); }), "no such file"));
  const fs::path d = temp_dir("dir");
  CHECK(contains(error_of([&] { (void)Tokenizer::from_file(d); }), "tokenizer.json: no such file"));
  fs::remove_all(d);
  CHECK(contains(error_of([] { (void)Tokenizer::from_json("{\"model\": ", "x.json"); }), "x.json: not valid JSON"));
  CHECK(contains(error_of([] { (void)Tokenizer::from_json("[1]"); }), "not a JSON object"));

  auto j = tiny_json();
  j["model"]["type"] = "WordPiece";
  CHECK(contains(load_error(j), "model type \"WordPiece\" is not supported"));
  j = tiny_json();
  j["normalizer"] = {{"type", "NFKC"}};
  CHECK(contains(load_error(j), "normalizer type \"NFKC\""));
  j = tiny_json();
  j["pre_tokenizer"]["pretokenizers"][0]["type"] = "Metaspace";
  CHECK(contains(load_error(j), "pre_tokenizer type \"Metaspace\""));
  j = tiny_json();
  j["decoder"] = {{"type", "WordPiece"}};
  CHECK(contains(load_error(j), "decoder type \"WordPiece\""));
  j = tiny_json();
  j["model"]["byte_fallback"] = true;
  CHECK(contains(load_error(j), "byte_fallback"));
  j = tiny_json();
  j["model"]["merges"].push_back("Hel zz");
  CHECK(contains(load_error(j), "not in the vocabulary"));
  j = tiny_json();
  j["model"]["vocab"].erase("A");
  CHECK(contains(load_error(j), "byte 65 has no token"));
  j = tiny_json();
  j["added_tokens"][0]["lstrip"] = true;
  CHECK(contains(load_error(j), "\"lstrip\" is not supported"));
  j = tiny_json();
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(";
  CHECK(contains(load_error(j), "does not compile"));
  j = tiny_json();
  j["model"].erase("vocab");
  CHECK(contains(load_error(j), "model.vocab"));
  // Merges as ["a", "b"] pairs (newer tokenizers) load the same.
  j = tiny_json();
  for (auto& m : j["model"]["merges"]) {
    const std::string s = m.get<std::string>();
    m = nlohmann::json::array({s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1)});
  }
  Tokenizer pairs = Tokenizer::from_json(j.dump());
  CHECK(pairs.encode("Hello world") == std::vector<int>{259, 264});
}
