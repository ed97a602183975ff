// examples/qwen/text.hpp: the `qwen` CLI's text flags: text in (tokenize, prompt text, chat), the
// sampling flags, and text out (generated ids printed as UTF-8 as they come, stopping at the
// checkpoint's end-of-sequence ids). Host only: --tokenize and --detokenize run without touching
// CUDA, and every flag is checked before any GPU work.
//
//   qwen --tokenizer dir/tokenizer.json --tokenize "Hello, world"     # 9707,11,1879
//   qwen --tokenizer dir/tokenizer.json --detokenize 9707,11,1879     # Hello, world
//   qwen --model dir --prompt-text "Once upon a time" --gen 32
//   qwen --model dir --chat "Why is the sky blue?" --system "Answer briefly." --gen 64
//   qwen --model dir --chat "Hi" --temperature 0.7 --top-p 0.9 --top-k 40 --sample-seed 7
#pragma once

#include "config.hpp"
#include "options.hpp"
#include "tokenizer.hpp"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace qwen {

/// The text flags: one field per flag, described by its help text in add_text_flags().
struct TextOptions {
  std::string tokenizer;    ///< --tokenizer: tokenizer.json or a directory holding one
  std::string tokenize;     ///< --tokenize: text to print as ids
  std::string detokenize;   ///< --detokenize: comma-separated ids to print as text
  std::string prompt_text;  ///< --prompt-text: the prompt as plain text
  std::string chat;         ///< --chat: a user message, wrapped in ChatML
  std::string system;       ///< --system: the system message of --chat
  double temperature = 0;   ///< --temperature: 0 is greedy
  double top_p = 1;         ///< --top-p: nucleus mass in (0, 1]
  int top_k = 0;            ///< --top-k: largest logits kept (0: all)
  long long sample_seed = 0;  ///< --sample-seed: the random stream of the draws
};

/// Adds --tokenizer, --tokenize, --detokenize, --prompt-text, --chat, --system and the sampling
/// flags (--temperature, --top-k, --top-p, --sample-seed) to `app`.
void add_text_flags(CLI::App& app, TextOptions& t);

/// Whether the command line asks for --tokenize or --detokenize (no model is run then).
bool text_tool_requested(const CLI::App& app);

/// Runs --tokenize or --detokenize, printing to `out`; returns the exit code (2 with a message on
/// stderr for bad input: a missing or malformed tokenizer.json, text that is not UTF-8, bad ids).
int run_text_tool(const CLI::App& app, const TextOptions& t, std::FILE* out = stdout);

/// Whether the prompt is given as text (--prompt-text or --chat; --system counts, to be refused
/// without --chat).
bool text_prompt_requested(const CLI::App& app);

/// A text prompt and what turns generated ids back into text.
struct TextSession {
  std::vector<int> prompt;                     ///< the encoded prompt
  std::vector<int> stop;                       ///< end-of-sequence ids (eos_token_ids)
  std::shared_ptr<const Tokenizer> tokenizer;  ///< for the streamed output
};

/// The prompt of --prompt-text or --chat [--system], encoded with --tokenizer (default: the
/// tokenizer.json in `model_dir`), and the end-of-sequence ids of the checkpoint (generation_config
/// / config.json next to the tokenizer, else the tokenizer's <|im_end|> and <|endoftext|>). Throws
/// input_error naming the flag: a second prompt flag (--prompt, --random-prompt, --prompt-text,
/// --chat are exclusive), --system without --chat, no tokenizer, a bad tokenizer.json or config,
/// or text that is not UTF-8.
TextSession text_session(const CLI::App& app, const TextOptions& t, const std::string& model_dir);

/// The sampling flags as SampleParams; throws input_error naming the flag for a value out of range
/// (temperature < 0, top-p outside (0, 1], top-k < 0, a seed outside 0..2^32-1).
SampleParams sampling_from_flags(const TextOptions& t);

/// Prints the generated ids of one sequence as text while they come (UTF-8 sequences split across
/// tokens are held back until complete), and the rest at the end.
class TextPrinter {
 public:
  TextPrinter(std::shared_ptr<const Tokenizer> tok, std::FILE* out = stdout);
  void token(int id);  ///< prints the characters `id` completes, then flushes
  void finish();       ///< prints what is held back and a newline

 private:
  std::shared_ptr<const Tokenizer> tok_;
  StreamDecoder dec_;
  std::FILE* out_;
};

}  // namespace qwen
