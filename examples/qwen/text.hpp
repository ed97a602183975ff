// examples/qwen/text.hpp: the `qwen` CLI's text flags. Host only: --tokenize and --detokenize run
// without touching CUDA, and the prompt flags turn text into prompt ids before any GPU work.
//
//   qwen --tokenizer dir/tokenizer.json --tokenize "Hello, world"     # 9707,11,1879
//   qwen --tokenizer dir/tokenizer.json --detokenize 9707,11,1879     # Hello, world
//   qwen --model dir --prompt-text "Once upon a time" --gen 32
//   qwen --model dir --chat "Why is the sky blue?" --system "Answer briefly." --gen 64
#pragma once

#include "config.hpp"
#include "tokenizer.hpp"

#include <CLI/CLI.hpp>

#include <cstdio>
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
};

/// Adds --tokenizer, --tokenize, --detokenize, --prompt-text, --chat and --system to `app`.
void add_text_flags(CLI::App& app, TextOptions& t);

/// Whether the command line asks for --tokenize or --detokenize (no model is run then).
bool text_tool_requested(const CLI::App& app);

/// Runs --tokenize or --detokenize, printing to `out`; returns the exit code (2 with a message on
/// stderr for bad input: a missing or malformed tokenizer.json, text that is not UTF-8, bad ids).
int run_text_tool(const CLI::App& app, const TextOptions& t, std::FILE* out = stdout);

/// Whether the prompt is given as text (--prompt-text or --chat; --system counts, to be refused
/// without --chat).
bool text_prompt_requested(const CLI::App& app);

/// The prompt ids of --prompt-text or --chat [--system], encoded with --tokenizer (default: the
/// tokenizer.json in `model_dir`). Throws input_error naming the flag: a second prompt flag
/// (--prompt, --random-prompt, --prompt-text, --chat are exclusive), --system without --chat, no
/// tokenizer, a bad tokenizer.json or text that is not UTF-8.
std::vector<int> text_prompt_ids(const CLI::App& app, const TextOptions& t, const std::string& model_dir);

}  // namespace qwen
