// examples/qwen/text.cpp: the `qwen` CLI's text flags (see text.hpp).
#include "text.hpp"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <filesystem>

namespace qwen {

namespace {

const char* const kPromptFlags[] = {"--prompt", "--random-prompt", "--prompt-text", "--chat"};

// Comma-separated token ids for --detokenize; every entry must be a decimal integer.
std::vector<int> split_ids(const std::string& s) {
  std::vector<int> ids;
  const char* p = s.data();
  const char* end = p + s.size();
  while (p <= end) {
    const char* comma = std::find(p, end, ',');
    int v = -1;
    const auto [q, ec] = std::from_chars(p, comma, v);
    if (p == comma || ec != std::errc() || q != comma || v < 0)
      throw input_error(fmt::format("--detokenize: entry {} ('{}') is not a token id", ids.size(),
                                    std::string(p, comma)));
    ids.push_back(v);
    p = comma + 1;
  }
  return ids;
}

Tokenizer load(const TextOptions& t, const std::string& model_dir, const char* flag) {
  std::string path = t.tokenizer;
  if (path.empty() && !model_dir.empty()) path = model_dir;
  if (path.empty()) throw input_error(fmt::format("{} needs --tokenizer PATH (or --model DIR holding tokenizer.json)", flag));
  try {
    return Tokenizer::from_file(path);
  } catch (const tokenizer_error& e) {
    throw input_error(fmt::format("--tokenizer: {}", e.what()));
  }
}

std::vector<int> encode(Tokenizer& tok, const std::string& text, const char* flag) {
  try {
    return tok.encode(text);
  } catch (const tokenizer_error& e) {
    throw input_error(fmt::format("{}: {}", flag, e.what()));
  }
}

}  // namespace

void add_text_flags(CLI::App& app, TextOptions& t) {
  app.add_option("--tokenizer", t.tokenizer, "tokenizer.json (or its directory; default: the --model directory's)");
  app.add_option("--tokenize", t.tokenize, "print the token ids of TEXT, comma-separated, and exit (no GPU)");
  app.add_option("--detokenize", t.detokenize, "print the text of comma-separated token ids and exit (no GPU)");
  app.add_option("--prompt-text", t.prompt_text, "prompt as text, encoded with the tokenizer");
  app.add_option("--chat", t.chat, "user message, wrapped in Qwen3's ChatML (thinking off) as the prompt");
  app.add_option("--system", t.system, "system message of --chat");
  app.add_option("--temperature", t.temperature, "sampling temperature (0: greedy, the default)");
  app.add_option("--top-k", t.top_k, "sample among the K largest logits (0: all)");
  app.add_option("--top-p", t.top_p, "sample within the smallest set of mass P, in (0, 1] (1: all)");
  app.add_option("--sample-seed", t.sample_seed, "seed of the sampler's random draws (0..4294967295)");
}

SampleParams sampling_from_flags(const TextOptions& t) {
  if (!(t.temperature >= 0) || !std::isfinite(t.temperature))
    throw input_error(fmt::format("--temperature {} must be finite and >= 0 (0: greedy)", t.temperature));
  if (!(t.top_p > 0 && t.top_p <= 1)) throw input_error(fmt::format("--top-p {} must be in (0, 1]", t.top_p));
  if (t.top_k < 0) throw input_error(fmt::format("--top-k {} must be >= 0 (0: all)", t.top_k));
  if (t.sample_seed < 0 || t.sample_seed > 0xffffffffLL)
    throw input_error(fmt::format("--sample-seed {} must be in 0..4294967295", t.sample_seed));
  SampleParams p{static_cast<float>(t.temperature), static_cast<float>(t.top_p), t.top_k,
                 static_cast<std::uint32_t>(t.sample_seed)};
  p.validate();
  return p;
}

TextPrinter::TextPrinter(std::shared_ptr<const Tokenizer> tok, std::FILE* out)
    : tok_(std::move(tok)), dec_(*tok_), out_(out) {}

void TextPrinter::token(int id) {
  fmt::print(out_, "{}", dec_.feed(id));
  std::fflush(out_);
}

void TextPrinter::finish() { fmt::print(out_, "{}\n", dec_.flush()); }

bool text_tool_requested(const CLI::App& app) {
  return app.count("--tokenize") > 0 || app.count("--detokenize") > 0;
}

int run_text_tool(const CLI::App& app, const TextOptions& t, std::FILE* out) {
  try {
    if (app.count("--tokenize") > 0 && app.count("--detokenize") > 0)
      throw input_error("--tokenize and --detokenize are exclusive");
    Tokenizer tok = load(t, {}, app.count("--tokenize") > 0 ? "--tokenize" : "--detokenize");
    if (app.count("--tokenize") > 0) {
      fmt::print(out, "{}\n", fmt::join(encode(tok, t.tokenize, "--tokenize"), ","));
    } else {
      const std::vector<int> ids = split_ids(t.detokenize);
      for (std::size_t i = 0; i < ids.size(); ++i)
        if (ids[i] >= tok.vocab_size())
          throw input_error(fmt::format("--detokenize: id {} at position {} is outside the vocabulary (0..{})", ids[i],
                                        i, tok.vocab_size() - 1));
      fmt::print(out, "{}\n", tok.decode(ids));
    }
    return 0;
  } catch (const input_error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 2;
  }
}

bool text_prompt_requested(const CLI::App& app) {
  return app.count("--prompt-text") > 0 || app.count("--chat") > 0 || app.count("--system") > 0;
}

TextSession text_session(const CLI::App& app, const TextOptions& t, const std::string& model_dir) {
  std::vector<std::string> given;
  for (const char* f : kPromptFlags)
    if (app.count(f) > 0) given.emplace_back(f);
  if (given.size() > 1) throw input_error(fmt::format("{} are exclusive: give one prompt", fmt::join(given, " and ")));
  if (app.count("--system") > 0 && app.count("--chat") == 0) throw input_error("--system needs --chat");
  const char* flag = app.count("--chat") > 0 ? "--chat" : "--prompt-text";
  const std::string& text = app.count("--chat") > 0 ? t.chat : t.prompt_text;
  if (text.empty()) throw input_error(fmt::format("{}: empty text", flag));
  for (const auto& [f, s] : {std::pair{flag, &text}, std::pair{"--system", &t.system}})
    if (const std::size_t bad = find_invalid_utf8(*s); bad != std::string::npos)
      throw input_error(fmt::format("{}: text is not valid UTF-8 at byte {}", f, bad));
  auto tok = std::make_shared<Tokenizer>(load(t, model_dir, flag));
  TextSession s;
  s.prompt = encode(*tok, app.count("--chat") > 0 ? chatml_prompt(t.chat, t.system) : t.prompt_text, flag);
  // The checkpoint's generation_config.json / config.json sit next to tokenizer.json.
  std::filesystem::path dir = t.tokenizer.empty() ? std::filesystem::path(model_dir) : std::filesystem::path(t.tokenizer);
  if (!std::filesystem::is_directory(dir)) dir = dir.parent_path();
  try {
    s.stop = eos_token_ids(dir, *tok);
  } catch (const tokenizer_error& e) {
    throw input_error(fmt::format("end-of-sequence ids: {}", e.what()));
  }
  s.tokenizer = std::move(tok);
  return s;
}

}  // namespace qwen
